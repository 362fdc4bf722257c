"""Shared benchmark helpers: interleaved timing, machine description, atomic result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
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
