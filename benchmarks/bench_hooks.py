"""Hook points, the activation cache and head ablation on the bundled all-MiniLM-L6-v2.

Three measurements, each against a reference timed interleaved in the same process:

* **no-hook overhead**: a forward of 32 sentences with the hook points in place (nothing
  listening) vs the same forward with every hook point reduced to ``return x`` (what the
  code costs without them). Target <= 1.02x.
* **cache everything**: ``run_with_cache`` of all 81 hook points vs a forward with
  ``need_weights=True`` (which also builds every attention matrix). Target <= 1.5x.
* **head-ablation sweep**: ``pair_similarity_effects`` (72 heads, zero ablation, one sentence
  pair), seconds. Target <= 10 s on 2 cores.
* **cache everything, causal LM**: ``run_with_cache`` of every hook point of SmolLM2-135M on 512
  tokens vs its plain forward (fused attention), one thread, CPU time of this process (a
  shared host's load drops out). Target <= 1.2x (TransformerLens: 1.16x its own forward).

Usage: ``python benchmarks/bench_hooks.py`` (``HANDFORMER_BENCH_QUICK=1``: one quick round).
"""

from __future__ import annotations

import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import QUICK, interleaved_runs, machine, machine_line, write_results  # noqa: E402
from handformer import hooks as hook_module  # noqa: E402
from handformer.inspect import run_with_cache  # noqa: E402
from handformer.inspect.heads import pair_similarity_effects  # noqa: E402
from handformer.pretrained import load_bert, load_lm  # noqa: E402

SENTENCES = [
    "The animal didn't cross the street because it was too tired",
    "A man is eating food.", "A man is eating a piece of bread.",
    "The girl is carrying a baby.", "A man is riding a horse.",
    "A woman is playing violin.", "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
] * 4  # 32 sentences
PAIR = ("The animal didn't cross the street because it was too tired",
        "The animal was exhausted.")
TARGETS = {"no_hooks_vs_stripped": 1.02, "cache_all_vs_need_weights": 1.5, "sweep_s": 10.0,
           "llm_cache_all_vs_forward": 1.2}
LLM, LLM_TOKENS = "smollm2-135m-instruct", 512


def llm_cache_all(repeats: int) -> dict:
    """``run_with_cache`` of every hook point vs the plain forward of the shipped SmolLM2,
    one thread, CPU time, interleaved; medians and minima."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, _ = load_lm(LLM, tokenizer=False)
        model.eval()
        ids = torch.randint(100, 40_000, (1, 64 if QUICK else LLM_TOKENS),
                            generator=torch.Generator().manual_seed(0))

        def forward() -> None:
            with torch.inference_mode():
                model(ids)

        def cache_all() -> None:
            with torch.inference_mode():
                run_with_cache(model, ids)

        runs = interleaved_runs({"forward": forward, "cache_all": cache_all},
                                repeats=repeats, warmup=1, clock=time.process_time)
        with torch.inference_mode():
            logits = model(ids).logits
            out, cache = run_with_cache(model, ids)
    finally:
        torch.set_num_threads(threads)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"model": LLM, "tokens": ids.shape[1], "threads": 1, "clock": "process_time",
            "median_s": med, "min_s": {k: min(v) for k, v in runs.items()},
            "ratio": med["cache_all"] / med["forward"],
            "ratio_of_minima": min(runs["cache_all"]) / min(runs["forward"]),
            "cached_points": len(cache),
            "max_logit_diff": float((out.logits - logits).abs().max())}


@contextmanager
def stripped_hook_points():
    """Every HookPoint a bare ``return x``: the model as if it had no hook points."""
    call, listening = hook_module.HookPoint.__call__, hook_module.HookPoint.listening
    hook_module.HookPoint.__call__ = lambda self, x: x
    hook_module.HookPoint.listening = lambda self: False
    try:
        yield
    finally:
        hook_module.HookPoint.__call__, hook_module.HookPoint.listening = call, listening


def main() -> None:
    torch.manual_seed(0)
    model, tok = load_bert()
    model.eval()
    batch = tok(SENTENCES[:8] if QUICK else SENTENCES)
    repeats = 3 if QUICK else 15

    def plain() -> None:
        with torch.inference_mode():
            model(**batch)

    def stripped() -> None:
        with stripped_hook_points():
            plain()

    def weights() -> None:
        with torch.inference_mode():
            model(**batch, need_weights=True)

    def cache_all() -> None:
        with torch.inference_mode():
            run_with_cache(model, batch)

    runs = interleaved_runs({"hooked": plain, "stripped": stripped, "need_weights": weights,
                             "cache_all": cache_all}, repeats=repeats, warmup=2)
    med = {k: statistics.median(v) for k, v in runs.items()}
    sweeps = []
    for _ in range(1 if QUICK else 3):
        start = time.perf_counter()
        result = pair_similarity_effects(model, tok, *PAIR, progress=False)
        sweeps.append(time.perf_counter() - start)
    with torch.inference_mode():
        out = model(**batch, need_weights=True)
        _, cache = run_with_cache(model, batch)
    exact = max(float((cache["pattern", i] - out.attentions[i]).abs().max()) for i in range(6))
    llm = llm_cache_all(3 if QUICK else 9)
    ratios = {"no_hooks_vs_stripped": med["hooked"] / med["stripped"],
              "cache_all_vs_need_weights": med["cache_all"] / med["need_weights"],
              "llm_cache_all_vs_forward": llm["ratio"]}
    data = {"machine": machine(), "batch": len(batch["input_ids"]),
            "tokens": int(batch["attention_mask"].sum()), "median_s": med,
            "ratios": ratios, "sweep_s": min(sweeps), "sweep_runs_s": sweeps,
            "cached_points": len(cache), "max_pattern_diff": exact,
            "top_heads": result.top(5), "llm": llm, "targets": TARGETS}
    ok = {k: ("met" if v <= TARGETS[k] else "MISSED") for k, v in
          {**ratios, "sweep_s": min(sweeps)}.items()}
    rows = [
        ("forward, hook points in place / hook points stripped",
         f"{ratios['no_hooks_vs_stripped']:.3f}x", "<= 1.02x", ok["no_hooks_vs_stripped"]),
        (f"`run_with_cache` (all {len(cache)} points) / forward with `need_weights=True`",
         f"{ratios['cache_all_vs_need_weights']:.3f}x", "<= 1.5x",
         ok["cache_all_vs_need_weights"]),
        ("head-ablation sweep, 72 heads, one sentence pair", f"{min(sweeps):.2f} s", "<= 10 s",
         ok["sweep_s"]),
        (f"SmolLM2-135M, {llm['tokens']} tokens: `run_with_cache` (all {llm['cached_points']} "
         "points) / plain forward", f"{llm['ratio']:.3f}x", "<= 1.2x",
         ok["llm_cache_all_vs_forward"]),
    ]
    table = "\n".join(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows)
    md = f"""# Hooks, activation cache, head ablation

{machine_line()}

`python benchmarks/bench_hooks.py` · bundled all-MiniLM-L6-v2 · {data['batch']} sentences,
{data['tokens']} tokens · medians of {repeats} interleaved runs.

| measurement | value | target | |
|---|---|---|---|
{table}

Forward times: hooked {med['hooked'] * 1e3:.1f} ms, stripped {med['stripped'] * 1e3:.1f} ms,
need_weights {med['need_weights'] * 1e3:.1f} ms, cache everything {med['cache_all'] * 1e3:.1f} ms.
Cached patterns = `need_weights` patterns within {exact:.1e}.

SmolLM2-135M ({llm['tokens']} tokens, 1 thread, CPU time of the process, medians of
{3 if QUICK else 9} interleaved runs): forward {llm['median_s']['forward'] * 1e3:.0f} ms,
`run_with_cache` of every hook point {llm['median_s']['cache_all'] * 1e3:.0f} ms
(ratio of the fastest runs {llm['ratio_of_minima']:.3f}x); its logits equal the forward's
within {llm['max_logit_diff']:.1e}.
"""
    write_results("hooks", data, md)
    print(md)


if __name__ == "__main__":
    main()
