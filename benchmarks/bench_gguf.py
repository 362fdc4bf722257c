"""Loading GGUF files: handformer vs transformers, on the two shipped models.

For SmolLM2-135M-Instruct (Q4_1, 98 MB) and Gemma 3 270M (Q4_K_M, 253 MB), each load runs in
a fresh subprocess that measures the wall time of the call and its peak RSS growth (VmHWM
after the call - VmRSS before it, the peak reset through /proc/self/clear_refs):

* handformer: ``load_lm(file, tokenizer=False)`` when ``handformer.pretrained.load_lm``
  exists, else ``gguf_to_hf(file)`` (read the header, dequantize every tensor, undo
  llama.cpp's fix-ups: everything but building the modules);
* transformers: ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
  dtype=torch.float32)`` (model only, no tokenizer).

Targets: handformer >= 3x faster than transformers; its peak RSS growth <= 1.5x the float32
model's bytes. Also recorded: ``read_gguf`` alone (the header, Gemma's 262k-token arrays
included) and, when ``LMTokenizer`` exists, building the tokenizer from the metadata.

Run: ``.venv/bin/python benchmarks/bench_gguf.py`` (or ``make bench``);
``HANDFORMER_BENCH_QUICK=1`` for a smoke run (SmolLM2 only, handformer only, one run).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QUICK, machine, machine_line, run_script, write_results  # noqa: E402
from handformer.pretrained.gguf import read_gguf, shipped_path  # noqa: E402

MODELS = ("smollm2-135m-instruct",) if QUICK else ("smollm2-135m-instruct", "gemma3-270m")
RUNS = 1 if QUICK else 3
TRANSFORMERS_RUNS = 0 if QUICK else 1

LOAD_SCRIPT = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
import torch
from common import measure_load
which, path = sys.argv[1], sys.argv[2]
if which == "handformer":
    try:
        from handformer.pretrained import load_lm
    except ImportError:
        load_lm = None
    from handformer.pretrained.gguf import gguf_to_hf
    if load_lm is not None:
        api = "load_lm(file, tokenizer=False)"
        def load():
            model, _ = load_lm(path, tokenizer=False)
            return {k: v for k, v in model.state_dict().items()}
    else:
        api = "gguf_to_hf(file)"
        def load():
            return gguf_to_hf(path)[1]
else:
    import os, transformers
    api = "AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=float32)"
    def load():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
        return model.state_dict()
state, measured = measure_load(load)
seen, params = set(), 0
for t in state.values():
    if t.data_ptr() not in seen:  # a tied head counts once
        seen.add(t.data_ptr())
        params += t.numel()
print(json.dumps({"api": api, "seconds": measured["seconds"],
                  "rss_before": measured["rss_before"], "hwm_after": measured["hwm_after"],
                  "params": params}))
"""

TOKENIZER_SCRIPT = r"""
import json, sys, time
from handformer.pretrained.gguf import read_gguf
try:
    from handformer.tokenizers.lm import LMTokenizer
except ImportError:
    print(json.dumps(None)); sys.exit(0)
start = time.perf_counter()
f = read_gguf(sys.argv[1])
tok = LMTokenizer.from_gguf_metadata(f.metadata, source=sys.argv[1])
print(json.dumps({"seconds": time.perf_counter() - start, "vocab": len(tok)}))
"""


def bench_model(name: str) -> dict[str, object]:
    path = shipped_path(name)  # Gemma's assembly (first use) is not timed
    header = []
    for _ in range(RUNS):
        start = time.perf_counter()
        read_gguf(path)
        header.append(time.perf_counter() - start)
    out: dict[str, object] = {"file": path.name, "file_bytes": path.stat().st_size,
                              "read_gguf_s": statistics.median(header)}
    for which, n in (("handformer", RUNS), ("transformers", TRANSFORMERS_RUNS)):
        runs = [run_script(LOAD_SCRIPT, which, str(path), timeout=900) for _ in range(n)]
        if not runs:
            continue
        params = runs[0]["params"]
        growth = max(r["hwm_after"] - r["rss_before"] for r in runs)
        out[which] = {"api": runs[0]["api"], "seconds": min(r["seconds"] for r in runs),
                      "all_seconds": [r["seconds"] for r in runs], "params": params,
                      "float32_bytes": params * 4, "peak_growth_bytes": growth,
                      "growth_over_float32": growth / (params * 4)}
    tok = run_script(TOKENIZER_SCRIPT, str(path), timeout=900)
    if tok is not None:
        out["tokenizer_s"] = tok["seconds"]
    if "transformers" in out:
        out["speedup"] = out["transformers"]["seconds"] / out["handformer"]["seconds"]
    return out


def main() -> int:
    load_start = os.getloadavg()[0]
    results = {name: bench_model(name) for name in MODELS}
    load_end = os.getloadavg()[0]
    mib = 2**20
    md = ["# Loading GGUF files: handformer vs transformers", "",
          f"Machine: {machine_line()} (shared with other jobs: timings are noisy)", "",
          "Each load in a fresh process; time of the call (best of "
          f"{RUNS} for handformer, {TRANSFORMERS_RUNS} run for transformers) and peak RSS "
          "growth over the RSS before the call. Targets: >= 3x faster than transformers, "
          "growth <= 1.5x the float32 model's bytes.", "",
          "| model | handformer call | handformer s | transformers s | speed-up | growth MiB "
          "| float32 MiB | growth / float32 | transformers growth MiB | header s |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        ours = r["handformer"]
        theirs = r.get("transformers")
        md.append(
            f"| {name} | `{ours['api']}` | {ours['seconds']:.2f} | "
            f"{theirs['seconds']:.1f} | {r['speedup']:.1f}x | " if theirs else
            f"| {name} | `{ours['api']}` | {ours['seconds']:.2f} | - | - | ")
        md[-1] += (f"{ours['peak_growth_bytes'] / mib:.0f} | {ours['float32_bytes'] / mib:.0f} | "
                   f"{ours['growth_over_float32']:.2f} | "
                   + (f"{theirs['peak_growth_bytes'] / mib:.0f}" if theirs else "-")
                   + f" | {r['read_gguf_s']:.3f} |")
    for name, r in results.items():
        if "tokenizer_s" in r:
            md.append(f"\nTokenizer from {name}'s metadata (read_gguf + "
                      f"LMTokenizer.from_gguf_metadata): {r['tokenizer_s']:.2f} s.")
    met = {name: {"speed": r.get("speedup", float("nan")) >= 3.0,
                  "memory": r["handformer"]["growth_over_float32"] <= 1.5}
           for name, r in results.items()}
    text = "\n".join(md) + "\n"
    print(text)
    write_results("gguf", {"machine": machine(), "quick": QUICK, "models": results,
                           "targets_met": met,
                           "load_average_start_end": [load_start, load_end]}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
