"""Cold start of ``handformer viz`` on the seed sentence, in a new process each time.

What a user waits for after typing the command: Python start, ``import torch``, loading the
bundled all-MiniLM-L6-v2 from disk, the forward pass with weights, two PNGs and the HTML
viewer. Target: <= 5 s on 2 CPU cores.

Reference, measured interleaved with it: a new process that only runs ``import torch,
handformer`` (the floor no command can go under); the ratio says how much the command adds.
Also the size and write time of the viewer for 512 tokens (budget: < 10 MB).

Usage: ``python benchmarks/bench_viz.py`` (``HANDFORMER_BENCH_QUICK=1`` for one quick round).
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import QUICK, machine, machine_line, write_results  # noqa: E402

SEED = "The animal didn't cross the street because it was too tired"
TARGET_S = 5.0


def _cpu_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _time(cmd: list[str]) -> tuple[float, float]:
    """Wall-clock and CPU seconds (user + system) of one new process."""
    cpu = _cpu_children()
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-500:]}")
    return elapsed, _cpu_children() - cpu


def cold_start(repeats: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as out:
        viz = [sys.executable, "-m", "handformer", "viz", SEED, "--out", out]
        floor = [sys.executable, "-c", "import torch, handformer"]
        _time(floor)  # warm the OS file cache once, as for a user's second command
        times: dict[str, list[float]] = {"viz": [], "import": [], "viz_cpu": [],
                                         "import_cpu": []}
        for _ in range(repeats):
            for name, cmd in (("viz", viz), ("import", floor)):
                wall, cpu = _time(cmd)
                times[name].append(wall)
                times[f"{name}_cpu"].append(cpu)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"repeats": repeats, "viz_s": med["viz"], "import_s": med["import"],
            "viz_cpu_s": med["viz_cpu"], "import_cpu_s": med["import_cpu"],
            "ratio": med["viz"] / med["import"], "runs": times,
            "within_target": med["viz"] <= TARGET_S}


def viewer_512() -> dict[str, object]:
    import torch

    from handformer.pretrained import load_bert
    from handformer.viz import save_html

    model, tokenizer = load_bert()
    enc = tokenizer.encode_batch([" ".join([SEED + "."] * 50)], max_length=512)
    with torch.inference_mode():
        attentions = model(**tokenizer.pad(enc), need_weights=True).attentions
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        path = save_html(attentions, enc[0].tokens, Path(out) / "index.html")
        seconds = time.perf_counter() - start
        size = path.stat().st_size
    return {"tokens": len(enc[0].tokens), "html_mb": size / 1e6, "write_s": seconds}


def main() -> int:
    import warnings

    warnings.simplefilter("ignore")  # the 512-token text is truncated on purpose
    load_before = os.getloadavg()[0]
    cold = cold_start(1 if QUICK else 5)
    cold["load_average_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    html = viewer_512() if not QUICK else {"tokens": 0, "html_mb": 0.0, "write_s": 0.0}
    print(f"handformer viz cold start: {cold['viz_s']:.2f} s (median of {cold['repeats']}; "
          f"target <= {TARGET_S:.0f} s: {'met' if cold['within_target'] else 'MISSED'})")
    print(f"import torch + handformer alone: {cold['import_s']:.2f} s; "
          f"ratio viz / import = {cold['ratio']:.2f}")
    print(f"CPU time (user + system): viz {cold['viz_cpu_s']:.2f} s, import "
          f"{cold['import_cpu_s']:.2f} s (less sensitive to other processes than wall time)")
    if not QUICK:
        print(f"viewer for {html['tokens']} tokens: {html['html_mb']:.2f} MB, written in "
              f"{html['write_s']:.2f} s")
    markdown = "\n".join([
        "# handformer viz: cold start",
        "",
        machine_line(),
        "",
        "| measurement | value |",
        "|---|---|",
        f"| `handformer viz` on the seed sentence, new process (median of {cold['repeats']}) "
        f"| {cold['viz_s']:.2f} s |",
        f"| `python -c 'import torch, handformer'` (reference, interleaved) "
        f"| {cold['import_s']:.2f} s |",
        f"| ratio viz / import | {cold['ratio']:.2f} |",
        f"| CPU time (user + system): viz / import | {cold['viz_cpu_s']:.2f} s / "
        f"{cold['import_cpu_s']:.2f} s |",
        f"| target <= {TARGET_S:.0f} s | {'met' if cold['within_target'] else 'missed'} |",
        f"| load average (1 min) before / after, on {os.cpu_count()} CPUs | "
        f"{cold['load_average_1min'][0]} / {cold['load_average_1min'][1]} |",
        f"| index.html for {html['tokens']} tokens x 6 layers x 12 heads | "
        f"{html['html_mb']:.2f} MB, written in {html['write_s']:.2f} s |",
        "",
        "Other processes may share the CPU while this runs; see the individual runs in the "
        "JSON file.",
        "",
    ])
    write_results("viz", {"machine": machine(), "cold_start": cold, "viewer_512": html},
                  markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
