"""Attention sinks (StreamingLLM, Xiao et al. 2023): perplexity of a causal LM over a long
text with full attention, with a sliding window, and with the window plus 4 sink tokens.

Every layer's attention is swapped for the kind under test (its soft-cap kept): full
attention as loaded; ``LocalAttention(511, causal=True)`` (each query sees its last 256
keys); ``SinkAttention(511, sink_tokens=4)``. The text is the English tutorial, cut to
``--tokens`` tokens (2,000 by default). One forward per kind gives every position's
next-token loss (what decoding with the kind's rolling cache gives, see tests/test_sinks.py);
their rolling means go into the JSON for the plot of ``docs/make_benchmarks.py``.

Usage: ``python benchmarks/bench_sinks.py [--model SOURCE] [--tokens N] [--window W]``:
``SOURCE`` any causal LM ``load_lm`` takes (default the shipped SmolLM2-135M-Instruct).
Writes ``results/sinks.{json,md}``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, machine_line, write_results  # noqa: E402
from handformer.attention import LocalAttention, SinkAttention  # noqa: E402

TEXT = Path(__file__).resolve().parents[1] / "docs" / "tutorial.en.md"


def load(source: str) -> tuple[torch.nn.Module, object]:
    """A causal LM and its tokenizer (``load_lm`` where the package has it, else a GPT-2
    folder)."""
    import importlib.util

    if importlib.util.find_spec("handformer.pretrained.lm") is not None:
        from handformer.pretrained.lm import load_lm

        return load_lm(source)
    from handformer.pretrained.gpt2 import load_gpt2

    return load_gpt2(source)


def swap(model: torch.nn.Module, make: object) -> None:
    """Every layer's attention kind replaced by ``make(old_kind)``."""
    for layer in model.blocks:
        layer.attn.attention = make(layer.attn.attention)


def token_losses(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``(L - 1,)`` next-token negative log-likelihoods, float64."""
    with torch.inference_mode():
        logits = model(ids).logits[0, :-1].float()  # (L - 1, V)
    return F.cross_entropy(logits, ids[0, 1:], reduction="none").double()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--window", type=int, default=511)
    parser.add_argument("--sinks", type=int, default=4)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    model, tokenizer = load(args.model)
    model.eval()
    ids = tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:args.tokens]
    if len(ids) < args.tokens:
        raise SystemExit(f"the text has only {len(ids)} tokens")
    ids = torch.tensor([ids])  # (1, L)
    originals = [layer.attn.attention for layer in model.blocks]
    kinds = {
        "full attention": lambda old: old,
        f"window {args.window} (last {args.window // 2 + 1} keys)":
            lambda old: LocalAttention(args.window, causal=True, softcap=old.softcap),
        f"window {args.window} + {args.sinks} sinks":
            lambda old: SinkAttention(args.window, sink_tokens=args.sinks, softcap=old.softcap),
    }
    losses, seconds = {}, {}
    for label, make in kinds.items():
        for layer, old in zip(model.blocks, originals, strict=True):
            layer.attn.attention = make(old)
        start = time.perf_counter()
        losses[label] = token_losses(model, ids)
        seconds[label] = time.perf_counter() - start
    for layer, old in zip(model.blocks, originals, strict=True):
        layer.attn.attention = old
    ppl = {k: math.exp(float(v.mean())) for k, v in losses.items()}
    past = {k: math.exp(float(v[args.window:].mean())) for k, v in losses.items()}
    positions, curves = _curves(losses)
    data = {"machine": machine(), "model": args.model, "tokens": ids.shape[1],
            "window": args.window, "sinks": args.sinks, "perplexity": ppl,
            "perplexity_past_window": past, "seconds": seconds,
            "curve_positions": positions, "curves": curves,
            "load_average_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)]}
    rows = "\n".join(f"| {k} | {ppl[k]:.2f} | {past[k]:.2f} | {seconds[k]:.1f} s |"
                     for k in kinds)
    md = f"""# Attention sinks (StreamingLLM)

{machine_line()}

`python benchmarks/bench_sinks.py --model {args.model}` · {ids.shape[1]} tokens of the English
tutorial · every layer's attention swapped.

| attention | perplexity | perplexity after token {args.window} | forward |
|---|---|---|---|
{rows}
"""
    write_results("sinks", data, md)
    print(md)


def _curves(losses: dict[str, torch.Tensor], span: int = 64, step: int = 8
            ) -> tuple[list[int], dict[str, list[float]]]:
    """Rolling means of ``span`` next-token losses, every ``step`` positions (for the plot
    ``docs/make_benchmarks.py`` draws)."""
    kernel = torch.ones(1, 1, span, dtype=torch.float64) / span
    curves = {}
    for label, values in losses.items():
        smooth = F.conv1d(values[None, None], kernel)[0, 0]  # (L - span,)
        curves[label] = [round(float(v), 4) for v in smooth[::step]]
    positions = list(range(span, span + step * len(next(iter(curves.values()))), step))
    return positions, curves


if __name__ == "__main__":
    main()
