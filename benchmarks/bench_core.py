"""Core speed: MultiHeadAttention and EncoderLayer against torch.nn, same process.

CPU, float32, B=8, L=512, d_model=512, 8 heads, d_ff=2048; interleaved runs, median.
Targets: MHA forward+backward ratio <= 1.05; EncoderLayer eval forward ratio <= 1.10.
Run: ``make bench`` or ``.venv/bin/python benchmarks/bench_core.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QUICK, interleaved, machine, machine_line, write_results  # noqa: E402
from handformer.interop import from_torch  # noqa: E402

B, L, E, H, FF = (2, 64, 64, 4, 128) if QUICK else (8, 512, 512, 8, 2048)
REPEATS = 3 if QUICK else 9


def bench_mha() -> dict[str, float]:
    theirs = nn.MultiheadAttention(E, H, batch_first=True)
    ours = from_torch(theirs)
    x = torch.randn(B, L, E, requires_grad=True)

    def run_theirs() -> None:
        out, _ = theirs(x, x, x, need_weights=False)
        out.sum().backward()

    def run_ours() -> None:
        out, _ = ours(x)
        out.sum().backward()

    return interleaved({"handformer": run_ours, "torch": run_theirs}, repeats=REPEATS)


def bench_encoder_layer() -> dict[str, float]:
    theirs = nn.TransformerEncoderLayer(E, H, FF, batch_first=True).eval()
    ours = from_torch(theirs).eval()
    x = torch.randn(B, L, E)

    def run_theirs() -> None:
        with torch.inference_mode():
            theirs(x)

    def run_ours() -> None:
        with torch.inference_mode():
            ours(x)

    return interleaved({"handformer": run_ours, "torch": run_theirs}, repeats=REPEATS)


def main() -> None:
    torch.manual_seed(0)
    rows = []
    results = {}
    for name, fn, target in (("MultiHeadAttention fwd+bwd", bench_mha, 1.05),
                             ("EncoderLayer eval fwd", bench_encoder_layer, 1.10)):
        t = fn()
        ratio = t["handformer"] / t["torch"]
        results[name] = {**t, "ratio": ratio, "target": target}
        ok = "yes" if ratio <= target else "NO"
        rows.append(f"| {name} | {t['handformer'] * 1e3:.1f} | {t['torch'] * 1e3:.1f} | "
                    f"{ratio:.3f} | ≤ {target} | {ok} |")
        print(f"{name}: handformer {t['handformer'] * 1e3:.1f} ms, torch "
              f"{t['torch'] * 1e3:.1f} ms, ratio {ratio:.3f} (target <= {target})")
    md = "\n".join([
        "# Core: handformer vs torch.nn",
        "",
        f"B={B}, L={L}, d_model={E}, heads={H}, d_ff={FF}, float32, CPU; median of {REPEATS} "
        "interleaved runs (time ratio = handformer / torch, lower is better).",
        "",
        f"Machine: {machine_line()}",
        "",
        "| benchmark | handformer ms | torch ms | ratio | target | met |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "Reproduce: `.venv/bin/python benchmarks/bench_core.py` (or `make bench`).",
        "",
    ])
    write_results("core", {"machine": machine(), "config": dict(B=B, L=L, E=E, H=H, FF=FF),
                           "results": results}, md)


if __name__ == "__main__":
    main()
