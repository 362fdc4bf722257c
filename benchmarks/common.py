"""Shared benchmark helpers: interleaved timing, machine description, atomic result files,
and loads measured in a fresh process."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parent
RESULTS = BENCHMARKS / "results"
QUICK = os.environ.get("HANDFORMER_BENCH_QUICK") == "1"


def machine() -> dict[str, object]:
    """A short description of where the benchmark ran."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def interleaved_runs(fns: dict[str, Callable[[], object]], *, repeats: int, warmup: int = 1,
                     clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds of every call of each function, the calls interleaved round by round.

    ``clock`` is wall time by default; ``time.process_time`` counts this process's CPU time
    only (what a single-threaded run costs, less disturbed by other jobs on a shared CPU).
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return times


def interleaved(fns: dict[str, Callable[[], object]], *, repeats: int, warmup: int = 1,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per call of each function, the calls interleaved round by round."""
    runs = interleaved_runs(fns, repeats=repeats, warmup=warmup, clock=clock)
    return {name: statistics.median(t) for name, t in runs.items()}


def seconds_per_call(fn: Callable[[], object], calls: int) -> float:
    """Mean wall seconds of ``calls`` back-to-back calls of ``fn``."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def memory_status() -> dict[str, int]:
    """This process's resident memory now (``VmRSS``) and at its peak (``VmHWM``), in bytes,
    from ``/proc/self/status`` (Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024  # the file counts kB
    return out


def measure_load(load: Callable[[], object]) -> tuple[object, dict[str, float]]:
    """Call ``load()`` once: its result, its wall seconds and the memory around it.

    The peak (``VmHWM``) is reset first through ``/proc/self/clear_refs`` (where the kernel
    allows it), so ``hwm_after - rss_before`` is the peak growth of the load alone. Meant for
    a fresh process (:func:`run_script`): one that has freed memory before could reuse it
    for the load and show less growth.

    Args:
        load: the call to measure.

    Returns:
        ``(result, {"seconds", "rss_before", "hwm_before", "hwm_after", "rss_after"})``,
        memory in bytes.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    before = memory_status()
    start = time.perf_counter()
    result = load()
    seconds = time.perf_counter() - start
    after = memory_status()
    return result, {"seconds": seconds, "rss_before": before["VmRSS"],
                    "hwm_before": before["VmHWM"], "hwm_after": after["VmHWM"],
                    "rss_after": after["VmRSS"]}


def run_script(script: str, *args: str, timeout: float | None = None) -> object:
    """Run ``python -c script args...`` in a fresh interpreter; the JSON of its last line.

    The script may import this module (``from common import measure_load``): the benchmarks
    folder goes first on its ``PYTHONPATH``.

    Args:
        script: the Python source; it prints one JSON value last.
        args: its ``sys.argv[1:]``.
        timeout: seconds before it is stopped (None: no limit).

    Returns:
        The parsed last line of its standard output.
    """
    path = os.pathsep.join(p for p in (str(BENCHMARKS), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", script, *args], check=True,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": path})
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_results(name: str, data: dict[str, object], markdown: str) -> None:
    """Write ``results/<name>.json`` and ``results/<name>.md`` atomically.

    Quick (smoke-test) runs write to a temporary folder instead, so tests never touch the
    recorded results.
    """
    out = Path(tempfile.gettempdir()) / "handformer-bench-quick" if QUICK else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(data, indent=2) + "\n"), (".md", markdown)):
        fd, tmp = tempfile.mkstemp(dir=out, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, out / f"{name}{suffix}")


def machine_line() -> str:
    m = machine()
    return (f"{m['date']} · {m['platform']} · {m['cpu_count']} CPUs · torch {m['torch']} · "
            f"{m['torch_threads']} threads")
