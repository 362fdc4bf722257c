"""Training speed.

1. Time to 99%: ``handformer train reverse`` with the default settings, run as a subprocess
   (the recorded command), timed to the first evaluation with exact-match >= 99% (from the
   run's ``metrics.jsonl``, ``elapsed_s``). Target: <= 180 s on 2 CPU cores. (The default
   model is small, so it trains on one thread; ``--threads 2`` was 5-7x slower per step when
   other jobs shared the 2 cores.)
2. Throughput: tokens/s of a training step (forward, loss, backward, clipping, AdamW) of a
   4-layer, d_model=256 causal LM vs the same model built from ``torch.nn.TransformerEncoder``
   with a causal mask; same data, same optimiser; interleaved runs, median. Target: ratio
   (handformer tokens/s / torch tokens/s) >= 0.95.

Run: ``make bench`` or ``.venv/bin/python benchmarks/bench_train.py``
(``HANDFORMER_BENCH_QUICK=1`` for a seconds-long smoke run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QUICK, interleaved, machine, machine_line, write_results  # noqa: E402
from handformer.models.causal_lm import CausalLM, CausalLMConfig  # noqa: E402

V, LAYERS, E, H, FF = (96, 1, 64, 4, 128) if QUICK else (96, 4, 256, 4, 1024)
B, L = (4, 32) if QUICK else (16, 128)
REPEATS = 3 if QUICK else 15
QUICK_ARGS = ["--steps", "20", "--eval-every", "10", "--eval-size", "50", "--warmup", "5",
              "--layers", "1", "--d-model", "32", "--d-ff", "64"]


def time_to_99(extra: list[str]) -> dict[str, object]:
    """Run ``handformer train reverse`` and read when it first reached 99%."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        args = ["reverse", "--out", str(out), "--no-progress", *extra,
                *(QUICK_ARGS if QUICK else [])]
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "handformer", "train", *args],
                              capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr)
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["split"] == "eval"]
    hit = next((r for r in evals if r["accuracy"] >= 0.99), None)
    shown = " ".join(a if a != str(out) else "RUN_DIR" for a in args)
    return {"command": f"handformer train {shown}", "wall_s": round(wall, 1),
            "seconds_to_99": None if hit is None else hit["elapsed_s"],
            "step_at_99": None if hit is None else hit["step"],
            "final_accuracy": evals[-1]["accuracy"]}


class TorchCausalLM(nn.Module):
    """The same model from torch.nn: embeddings, pre-LN TransformerEncoder, tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(V, E)
        self.pos_emb = nn.Parameter(torch.randn(L, E) * 0.02)
        layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, norm=nn.LayerNorm(E),
                                             enable_nested_tensor=False)
        self.lm_head = nn.Linear(E, V, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(L))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(ids) + self.pos_emb[:ids.shape[1]]  # (B, L, E)
        x = self.encoder(x, mask=self.mask, is_causal=True)
        return self.lm_head(x)  # (B, L, V)


def throughput() -> dict[str, float]:
    torch.manual_seed(0)
    ours = CausalLM(CausalLMConfig(vocab_size=V, max_len=L, d_model=E, num_heads=H,
                                   num_layers=LAYERS, d_ff=FF)).train()
    theirs = TorchCausalLM().train()
    ids = torch.randint(V, (B, L + 1))

    def stepper(model: nn.Module, logits_of):  # noqa: ANN001, ANN202
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step() -> None:
            logits = logits_of(ids[:, :-1])  # (B, L, V)
            loss = F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    t = interleaved({"handformer": stepper(ours, lambda x: ours(x).logits),
                     "torch": stepper(theirs, theirs)}, repeats=REPEATS, warmup=2)
    return {name: B * L / seconds for name, seconds in t.items()}


def main() -> None:
    load = os.getloadavg()[0]
    speed = throughput()
    ratio = speed["handformer"] / speed["torch"]
    print(f"throughput: handformer {speed['handformer']:,.0f} tok/s, torch.nn "
          f"{speed['torch']:,.0f} tok/s, ratio {ratio:.3f} (target >= 0.95)")
    runs = [time_to_99([])]
    for r in runs:
        print(f"{r['command']}: 99% at step {r['step_at_99']} after {r['seconds_to_99']} s "
              f"(process wall {r['wall_s']} s; target <= 180 s)")
    rows = [f"| `{r['command']}` | {r['step_at_99']} | {r['seconds_to_99']} | {r['wall_s']} | "
            f"{r['final_accuracy']:.4f} | "
            f"{'yes' if r['seconds_to_99'] is not None and r['seconds_to_99'] <= 180 else 'NO'} |"
            for r in runs]
    md = "\n".join([
        "# Training: time to 99% on reverse, and causal-LM training throughput",
        "",
        f"Machine: {machine_line()}",
        "",
        f"Load average at the start: {load:.1f} on {os.cpu_count()} cores (other jobs shared the",
        "machine: absolute speeds are depressed and noisy; the two models were timed",
        "interleaved, so their ratio is the figure to read).",
        "",
        "## Time to 99% exact match (`reverse`, default settings)",
        "",
        "Seconds of training (from `metrics.jsonl`) to the first evaluation >= 99% on 1000",
        "held-out sequences; evaluations every 100 steps. Target: <= 180 s.",
        "",
        "| command | step | seconds to 99% | process wall s | final accuracy | met |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "## Training throughput",
        "",
        f"{LAYERS} layers, d_model={E}, {H} heads, d_ff={FF}, vocab {V}, B={B}, L={L}, float32,",
        f"AdamW + clipping; median of {REPEATS} interleaved steps. Target: ratio >= 0.95.",
        "",
        "| model | tokens/s |",
        "|---|---|",
        f"| handformer CausalLM | {speed['handformer']:,.0f} |",
        f"| torch.nn.TransformerEncoder (causal mask) | {speed['torch']:,.0f} |",
        f"| ratio | {ratio:.3f} ({'met' if ratio >= 0.95 else 'NOT met'}) |",
        "",
    ])
    write_results("train", {"machine": machine(), "load_average": load, "time_to_99": runs,
                            "throughput_tokens_per_s": speed, "throughput_ratio": ratio}, md)


if __name__ == "__main__":
    main()
