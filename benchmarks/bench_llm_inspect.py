"""Looking inside a causal LM: direct logit attribution, attribution patching, idle hook points.

Measurements, each against a reference timed interleaved in the same process, on 64 tokens:

* **attribution**: ``stack_head_results`` + ``decompose_resid`` + ``logit_attrs`` of every
  head and component at every position vs one ``run_with_cache`` forward (all hook points).
  Target <= 1.5x.
* **attribution patching**: ``attribution_patching`` over every head (``hook="z"``) vs one
  forward. Target <= 4x (it stands for ``num_layers * num_heads`` patched forwards).
  Exact ``patching_sweep`` is timed once beside it, with the correlation of the two.
* **idle hook points**: the no-hook forward vs the same forward with every hook point a bare
  ``return x`` (``hook_result`` and ``hook_scale`` idle). Target <= 1.02x.

Usage: ``python benchmarks/bench_llm_inspect.py [--model PATH]``: a causal LM folder (or any
source ``load_lm`` takes); without one, a random model of SmolLM2-135M's shape (30 layers,
576 wide, 9 query heads; GQA, RMSNorm and the gated MLP where the config has them).
``HANDFORMER_BENCH_QUICK=1``: a 6-layer model, one quick round.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_hooks import stripped_hook_points  # noqa: E402
from common import QUICK, interleaved_runs, machine, machine_line, write_results  # noqa: E402
from handformer import CausalLM, CausalLMConfig  # noqa: E402
from handformer.inspect import (  # noqa: E402
    attribution_patching,
    patching_sweep,
    run_with_cache,
)

TARGETS = {"attribution_vs_cache": 1.5, "attr_patching_vs_forward": 4.0,
           "no_hooks_vs_stripped": 1.02}
TOKENS = 64


def random_model() -> CausalLM:
    """A random model of SmolLM2-135M's shape (smaller with QUICK)."""
    names = {f.name for f in dataclasses.fields(CausalLMConfig)}
    settings = dict(vocab_size=49152, max_len=2048, d_model=576, num_heads=9,
                    num_layers=6 if QUICK else 30, d_ff=1536, positional="rotary",
                    tie_weights=True, bias=False)
    modern = dict(num_kv_heads=3, norm="rms", mlp="gated", activation="silu")
    settings.update({k: v for k, v in modern.items() if k in names})
    torch.manual_seed(0)
    return CausalLM(CausalLMConfig(**settings)).eval()


def load(source: str | None) -> tuple[CausalLM, object, str]:
    """The model, its tokenizer (None for the random model) and a name."""
    if source is None:
        model = random_model()
        name = f"random {model.config.num_layers}-layer model of SmolLM2-135M's shape"
        return model, None, name
    from bench_sinks import load as load_with_tokenizer

    model, tokenizer = load_with_tokenizer(source)
    return model.eval(), tokenizer, str(source)


IOI = ("When Mary and John went to the store, John gave a drink to",
       "When Mary and John went to the store, Mary gave a drink to", " Mary", " John")


def ioi_agreement(model: CausalLM, tokenizer: object) -> dict[str, object]:
    """Attribution patching vs exact per-head patching on the IOI pair (Pearson r)."""
    from handformer.inspect import to_single_token, to_tokens

    clean, corrupted = to_tokens(tokenizer, IOI[0]), to_tokens(tokenizer, IOI[1])
    if clean.shape != corrupted.shape:
        return {"skipped": "the two prompts tokenize to different lengths"}
    right, wrong = to_single_token(tokenizer, IOI[2]), to_single_token(tokenizer, IOI[3])

    def logit_diff(out: object) -> torch.Tensor:
        return out.logits[0, -1, right] - out.logits[0, -1, wrong]

    with torch.inference_mode():
        diff = float(logit_diff(model(clean)))
    exact = patching_sweep(model, clean, corrupted, logit_diff, hook="z", progress=False)
    estimate = attribution_patching(model, clean, corrupted, logit_diff, hook="z")
    r = float(torch.corrcoef(torch.stack([estimate.flatten(), exact.flatten()]))[0, 1])
    top = [divmod(int(i), exact.shape[1]) for i in exact.flatten().abs().argsort()[-5:].flip(0)]
    return {"clean_logit_diff": diff, "pearson_r": r, "top_heads_exact": top}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a causal LM source for load_lm")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    model, tokenizer, name = load(args.model)
    for p in model.parameters():
        p.requires_grad_(False)
    N = len(model.blocks)
    H = model.blocks[0].attn.num_heads
    V = model.lm_head.weight.shape[0]
    torch.manual_seed(1)
    ids = torch.randint(min(100, V // 2), min(V, 20000), (1, TOKENS))
    corrupted = ids.clone()
    corrupted[0, TOKENS // 2] = (corrupted[0, TOKENS // 2] + 1) % V
    nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1)  # (1, L): the next token at each position
    a, b = int(ids[0, -1]), int(ids[0, 0])

    def metric(out: object) -> torch.Tensor:
        return out.logits[0, -1, a] - out.logits[0, -1, b]

    def forward() -> None:
        with torch.inference_mode():
            model(ids)

    def stripped() -> None:
        with stripped_hook_points():
            forward()

    def cache_all() -> None:
        with torch.inference_mode():
            run_with_cache(model, ids)

    with torch.inference_mode():
        _, cache = run_with_cache(model, ids)

    def attribution() -> None:
        with torch.inference_mode():
            heads = cache.stack_head_results(incl_remainder=True, return_labels=True)
            cache.logit_attrs(heads, nxt, incl_bias=True)
            parts = cache.decompose_resid(return_labels=True)
            cache.logit_attrs(parts, nxt, incl_bias=True)

    def attr_patching() -> None:
        attribution_patching(model, ids, corrupted, metric, hook="z")

    repeats = 3 if QUICK else 11
    runs = interleaved_runs({"forward": forward, "stripped": stripped, "cache_all": cache_all,
                             "attribution": attribution, "attr_patching": attr_patching},
                            repeats=repeats, warmup=1)
    med = {k: statistics.median(v) for k, v in runs.items()}
    start = time.perf_counter()
    exact = patching_sweep(model, ids, corrupted, metric, hook="z", batch_size=16,
                           progress=False)
    sweep_s = time.perf_counter() - start
    estimate = attribution_patching(model, ids, corrupted, metric, hook="z")
    r = float(torch.corrcoef(torch.stack([estimate.flatten(), exact.flatten()]))[0, 1])
    # the attributions add up (a check that the timed code computes the real thing)
    heads = cache.stack_head_results(incl_remainder=True)
    total = cache.logit_attrs(heads, nxt, incl_bias=True).sum(0)  # (1, L)
    with torch.inference_mode():
        logits = model(ids).logits.float()
    final_softcap = getattr(model.config, "final_softcap", None)
    reference = logits.gather(2, nxt[..., None])[..., 0]
    if final_softcap:  # attributions are of the logit before the cap
        reference = final_softcap * torch.atanh(reference / final_softcap)
    add_up = float((total - reference).abs().max())
    ioi = ioi_agreement(model, tokenizer) if tokenizer is not None else None
    ratios = {"attribution_vs_cache": med["attribution"] / med["cache_all"],
              "attr_patching_vs_forward": med["attr_patching"] / med["forward"],
              "no_hooks_vs_stripped": med["forward"] / med["stripped"]}
    ok = {k: ("met" if v <= TARGETS[k] else "MISSED") for k, v in ratios.items()}
    data = {"machine": machine(), "model": name, "layers": N, "heads": H, "tokens": TOKENS,
            "median_s": med, "ratios": ratios, "targets": TARGETS,
            "patching_sweep_s": sweep_s, "attr_vs_exact_pearson_r": r,
            "attributions_add_up_max_error": add_up, "ioi": ioi,
            "load_average_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)]}
    rows = [
        (f"attribution of every head and component ({N * H} heads, {TOKENS} positions) / "
         "`run_with_cache`", f"{ratios['attribution_vs_cache']:.2f}x", "<= 1.5x",
         ok["attribution_vs_cache"]),
        (f"`attribution_patching` over all {N * H} heads / one forward",
         f"{ratios['attr_patching_vs_forward']:.2f}x", "<= 4x",
         ok["attr_patching_vs_forward"]),
        ("forward, idle hook points / hook points stripped",
         f"{ratios['no_hooks_vs_stripped']:.3f}x", "<= 1.02x", ok["no_hooks_vs_stripped"]),
    ]
    table = "\n".join(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows)
    md = f"""# Inside a causal LM: attribution, attribution patching, idle hooks

{machine_line()}

`python benchmarks/bench_llm_inspect.py` · {name} · {TOKENS} tokens · medians of {repeats}
interleaved runs.

| measurement | value | target | |
|---|---|---|---|
{table}

Times: forward {med['forward'] * 1e3:.1f} ms (stripped {med['stripped'] * 1e3:.1f} ms),
`run_with_cache` {med['cache_all'] * 1e3:.1f} ms, attribution {med['attribution'] * 1e3:.1f} ms,
attribution patching {med['attr_patching'] * 1e3:.1f} ms; exact `patching_sweep` of the same
{N * H} heads {sweep_s:.1f} s. Attribution patching vs exact patching (one random token
changed): Pearson r = {r:.3f}. Head attributions plus the bias term add up to the logits
within {add_up:.1e}.
"""
    if ioi and "pearson_r" in ioi:
        md += (f"\nIOI pair ({IOI[0]!r} vs {IOI[1]!r}): logit({IOI[2]!r}) - "
               f"logit({IOI[3]!r}) = {ioi['clean_logit_diff']:.2f}; attribution patching vs "
               f"exact per-head patching: Pearson r = {ioi['pearson_r']:.3f}.\n")
    write_results("llm_inspect", data, md)
    print(md)


if __name__ == "__main__":
    main()
