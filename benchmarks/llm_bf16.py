"""bfloat16 decoding against float32 decoding, and against bfloat16's floor (issue 37, section 2).

Part of ``bench_llm.py`` (its model folder, its float32 model and its floor step); runnable
alone for a short check: ``.venv/bin/python benchmarks/llm_bf16.py`` (SmolLM2-135M's shape;
add ``gemma3`` for Gemma 3 270M's, 1 thread; prints, writes nothing). Per thread count, all
interleaved round by round, the minimum of each (a shared host only ever adds time):

* ms per new token of ``generate`` in float32 and in bfloat16 (the same folder loaded with
  ``dtype=torch.bfloat16``), a streamer timing the steps after the first new token;
  target bfloat16 <= 0.6 x float32;
* the floor: bytes read per token (every weight matrix once, the LM head included) divided by
  the bandwidth float32 matrix-vector products reach in the same run (``floor_step``: the
  float32 step's products plus one attention per layer). float32's floor is that step's
  time; bfloat16's is half of it (half the bytes, same bandwidth).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QUICK, interleaved_runs, seconds_per_call  # noqa: E402
from handformer.pretrained import load_lm  # noqa: E402

CONTEXT = 16 if QUICK else 128
NEW = 4 if QUICK else 16
REPEATS = 1 if QUICK else 5
TARGET = 0.6  # bfloat16 ms per token over float32's


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every Linear weight (the tied LM head once): what one step reads."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if isinstance(m, torch.nn.Linear))


def bench_bf16(folder: Path, ours32: torch.nn.Module, threads: tuple[int, ...],
               floor_step: callable) -> tuple[dict, list[str]]:
    """bfloat16 against float32 decoding and the floor, per thread count.

    Args:
        folder: the checkpoint folder ``ours32`` was loaded from.
        ours32: the float32 model.
        threads: torch thread counts to run.
        floor_step: ``floor_step(model, context)``, the float32 floor's step function.

    Returns:
        ``(data, markdown lines)``.
    """
    ours16, _ = load_lm(folder, tokenizer=False, dtype=torch.bfloat16)
    bytes32, bytes16 = weight_bytes(ours32), weight_bytes(ours16)
    V = ours32.config.vocab_size
    prompt = torch.randint(0, V, (1, CONTEXT), generator=torch.Generator().manual_seed(2))
    rows, lines = [], []
    for n in threads:
        torch.set_num_threads(n)
        step = floor_step(ours32, CONTEXT)
        times: dict[str, list[float]] = {"float32": [], "bfloat16": [], "floor": []}

        def decode(name: str, model: torch.nn.Module, times: dict = times) -> None:
            stamps: list[float] = []
            with torch.inference_mode():
                model.generate(prompt, max_new_tokens=NEW,
                               streamer=lambda _t: stamps.append(time.perf_counter()))
            times[name].append((stamps[-1] - stamps[0]) / (NEW - 1))

        def floor(step: callable = step, times: dict = times) -> None:
            times["floor"].append(seconds_per_call(step, NEW - 1))

        interleaved_runs({"float32": lambda: decode("float32", ours32),
                          "bfloat16": lambda: decode("bfloat16", ours16),
                          "floor": floor}, repeats=REPEATS, warmup=1)
        ms = {k: min(v[1:] if len(v) > 1 else v) * 1e3 for k, v in times.items()}
        gb_s = bytes32 / (ms["floor"] / 1e3) / 1e9  # float32 matrix-vector bandwidth
        floor16 = bytes16 / gb_s / 1e6  # ms
        row = {"threads": n, "context": CONTEXT, "new_tokens": NEW, "ms_per_token": ms,
               "probe_gb_per_s": gb_s, "floor32_ms": ms["floor"], "floor16_ms": floor16,
               "bf16_over_f32": ms["bfloat16"] / ms["float32"],
               "f32_vs_floor": ms["float32"] / ms["floor"],
               "bf16_vs_floor": ms["bfloat16"] / floor16}
        rows.append(row)
        line = (f"[{n} thread(s)] bfloat16 decode after {CONTEXT}: {ms['bfloat16']:.1f} ms/token,"
                f" float32 {ms['float32']:.1f}: ratio {row['bf16_over_f32']:.2f} (target <= "
                f"{TARGET}); vs floor: bfloat16 {row['bf16_vs_floor']:.2f}x its "
                f"{floor16:.1f} ms, float32 {row['f32_vs_floor']:.2f}x its {ms['floor']:.1f} "
                f"ms (probe {gb_s:.1f} GB/s)")
        print(line, flush=True)
        lines.append(f"| {n} | {ms['float32']:.1f} | {ms['bfloat16']:.1f} | "
                     f"{row['bf16_over_f32']:.2f} (≤ {TARGET}) | {ms['floor']:.1f} | "
                     f"{floor16:.1f} | {row['f32_vs_floor']:.2f} | {row['bf16_vs_floor']:.2f} |")
    header = ["", f"bfloat16 against float32, decode after {CONTEXT} tokens, {NEW} new, "
              f"minimum of {REPEATS} interleaved rounds (weights: float32 {bytes32 / 1e6:.0f} "
              f"MB, bfloat16 {bytes16 / 1e6:.0f} MB per step):", "",
              "| threads | float32 ms/token | bfloat16 ms/token | ratio | float32 floor | "
              "bfloat16 floor | float32 / floor | bfloat16 / floor |",
              "|---|---|---|---|---|---|---|---|"]
    return {"rows": rows, "bytes_f32": bytes32, "bytes_bf16": bytes16,
            "target": TARGET}, header + lines + [""]


def save_gemma3(folder: Path) -> None:
    """Random weights in Gemma 3 270M's shape (18 layers, d=640, 4 heads, 1 KV head of 256,
    d_ff 2048, vocabulary 262,144, tied head; 1.07 GB of float32), a Gemma 3 folder."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        max_position_embeddings=2048, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        initializer_range=0.05)
    transformers.Gemma3ForCausalLM(config).save_pretrained(folder)


def main() -> None:
    """SmolLM2's shape at bench_llm's thread counts; ``gemma3`` as the first argument: Gemma 3
    270M's shape, 1 thread."""
    import bench_llm

    gemma = sys.argv[1:] == ["gemma3"]
    with tempfile.TemporaryDirectory() as tmp:
        (save_gemma3 if gemma else bench_llm.save_folder)(Path(tmp))
        ours32, _ = load_lm(tmp, tokenizer=False)
        _, lines = bench_bf16(Path(tmp), ours32, (1,) if gemma else bench_llm.THREADS,
                              bench_llm.floor_step)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
