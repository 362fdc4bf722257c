"""A SmolLM2-135M-shaped Llama, side by side with transformers (issue 20, "Speed").

Random weights in SmolLM2-135M's shape (30 layers, d=576, 9 heads, 3 KV heads, head dim 64,
d_ff 1536, vocabulary 49152, tied head; 538 MB of float32) saved as a Llama folder, loaded by
``handformer.pretrained.load_lm`` and by ``transformers.AutoModelForCausalLM`` (sdpa). CPU,
float32, batch 1, at 1 and 2 torch threads, all calls interleaved round by round (medians):

1. forward of 512 tokens; target handformer / transformers <= 1.0;
2. greedy decoding, ms per new token after contexts of 128 and 1024 tokens: a streamer
   timestamps every new token of both ``generate``s, and the time from the first new token to
   the last over the ``N - 1`` steps between them is decoding alone (the prefill comes before
   the first token; taking it out by ``(t(N) - t(1)) / (N - 1)`` left its noise, divided by
   ``N - 1``, in the figure); identical tokens checked;
   target <= 0.9 x transformers, and <= 1.3 x the floor;
3. the floor, measured in the same run: one step's matrix-vector products (every Linear of
   the model and the tied LM head, batch-1 input) plus one fused attention per layer over a
   cache of that context (``scaled_dot_product_attention`` with ``enable_gqa``): a float32
   step must read every weight once, and this is what that costs here with no other work;
4. KV-cache bytes at context 1024: handformer's cache against a multi-head cache of the same
   model (target ``num_kv_heads / num_heads`` = 1/3) and transformers' cache; and a sliding
   layer's cache (window 256) at 1024 tokens, which stays at its window;
5. how fast this host streams float32 weights (the floor's bytes over its time, and small
   working sets as in ``bench_decode.py``), and the load average at start and end: decoding
   is memory-bound, so hosts differ.
6. int8 (``load_lm(..., quantize="int8")``) on both shipped GGUF models (``llm_int8.py``):
   decode ms/token against float32, its floor and llama.cpp at 1 and 2 threads, prefill,
   peak RSS growth of each load in a fresh process against the GGUF file, and agreement with
   float32 on English, Chinese and code prompts.
7. bfloat16 decoding against float32 and its floor (``llm_bf16.py``, issue 37).

Run: ``.venv/bin/python benchmarks/bench_llm.py`` (``HANDFORMER_BENCH_QUICK=1``: a tiny
model, for the smoke test; ``--int8``: section 6 alone, written into the results in place
of the last one; ``--int8 --decode-only [--threads 2]``: only section 6's decoding rows,
measured again, the rest of it kept).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    QUICK,
    interleaved,
    interleaved_runs,
    machine,
    machine_line,
    seconds_per_call,
    write_results,
)
from handformer.pretrained import load_lm  # noqa: E402
from llm_bf16 import bench_bf16  # noqa: E402
from llm_int8 import bench_int8, bench_int8_decode  # noqa: E402

SHAPE = (dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2) if QUICK else
         dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
              num_attention_heads=9, num_key_value_heads=3))
MAX_LEN = 256 if QUICK else 2048
FORWARD_LEN = 32 if QUICK else 512
CONTEXTS = (16, 64) if QUICK else (128, 1024)
NEW = 4 if QUICK else 32  # tokens generated per timed call
REPEATS = 1 if QUICK else 5
FORWARD_REPEATS = 1 if QUICK else 11  # the forward ratio sits near 1: more rounds, less noise
THREADS = (1,) if QUICK else (1, 2)
WINDOW = 8 if QUICK else 256  # the sliding layer of the cache measurement


def save_folder(folder: Path) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **SHAPE, max_position_embeddings=MAX_LEN, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_theta=100000.0, bos_token_id=None, eos_token_id=None, initializer_range=0.1)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def floor_step(ours: torch.nn.Module, context: int) -> callable:
    """One decoding step's unavoidable work: every matrix-vector product of the model, the
    LM head included, and one fused attention per layer over ``context`` cached keys."""
    c = ours.config
    H, H_kv, D = c.num_heads, c.num_kv_heads, c.head_dim
    q = torch.randn(1, H, 1, D)
    kv = [(torch.randn(1, H_kv, context, D), torch.randn(1, H_kv, context, D))
          for _ in range(c.num_layers)]
    layers = [[m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
              for layer in ours.blocks]
    inputs = {n: torch.randn(1, 1, n) for ls in layers for n in {m.in_features for m in ls}}
    head, x = ours.lm_head.weight, torch.randn(1, 1, c.d_model)

    def step() -> None:
        with torch.inference_mode():
            for linears, (k, v) in zip(layers, kv, strict=True):
                for m in linears:
                    F.linear(inputs[m.in_features], m.weight)
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            F.linear(x, head)

    return step


class TokenClock:
    """A streamer for both ``generate``s: the time of every new token. The seconds between
    the first new token and the last, over the steps between them, are decoding alone (the
    prefill, which a whole ``generate`` call also times, is before the first token)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if value.dim() == 2 and not self.prompt_seen:  # transformers first passes the prompt
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def seconds_per_step(self) -> float:
        if len(self.times) != NEW:
            raise RuntimeError(f"expected {NEW} new tokens, saw {len(self.times)}")
        return (self.times[-1] - self.times[0]) / (NEW - 1)


def bench_threads(ours: torch.nn.Module, theirs: torch.nn.Module, threads: int) -> dict:
    torch.set_num_threads(threads)
    V = SHAPE["vocab_size"]
    ids = torch.randint(0, V, (1, FORWARD_LEN), generator=torch.Generator().manual_seed(1))

    def fwd_ours() -> None:
        with torch.inference_mode():
            ours(ids)

    def fwd_theirs() -> None:
        with torch.inference_mode():
            theirs(ids)

    fwd = interleaved({"handformer": fwd_ours, "transformers": fwd_theirs},
                      repeats=FORWARD_REPEATS, warmup=1)
    out: dict[str, object] = {
        "threads": threads, "forward_tokens": FORWARD_LEN,
        "forward_ms": {k: v * 1e3 for k, v in fwd.items()},
        "forward_ratio": fwd["handformer"] / fwd["transformers"], "decode": []}
    print(f"[{threads} thread(s)] forward {FORWARD_LEN} tokens: handformer "
          f"{fwd['handformer'] * 1e3:.0f} ms, transformers {fwd['transformers'] * 1e3:.0f} ms, "
          f"ratio {out['forward_ratio']:.2f} (target <= 1.0)", flush=True)

    def gen_theirs(prompt: torch.Tensor, n: int, streamer: object = None) -> torch.Tensor:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return theirs.generate(prompt, attention_mask=torch.ones_like(prompt),
                                   max_new_tokens=n, do_sample=False, pad_token_id=0,
                                   streamer=streamer)

    def gen_ours(prompt: torch.Tensor, n: int, streamer: object = None) -> torch.Tensor:
        with torch.inference_mode():
            return ours.generate(prompt, max_new_tokens=n,
                                 streamer=None if streamer is None else streamer.put)

    for context in CONTEXTS:
        prompt = torch.randint(0, V, (1, context), generator=torch.Generator().manual_seed(2))
        same = gen_ours(prompt, NEW).tolist() == gen_theirs(prompt, NEW).tolist()
        step = floor_step(ours, context)
        steps: dict[str, list[float]] = {"handformer": [], "transformers": [], "floor": []}

        def decode(name: str, fn: callable, p: torch.Tensor = prompt,
                   steps: dict[str, list[float]] = steps) -> None:
            clock = TokenClock()
            fn(p, NEW, clock)
            steps[name].append(clock.seconds_per_step())

        def floor(step: callable = step, steps: dict[str, list[float]] = steps) -> None:
            steps["floor"].append(seconds_per_call(step, NEW - 1))

        interleaved_runs({"handformer": lambda: decode("handformer", gen_ours),
                          "transformers": lambda: decode("transformers", gen_theirs),
                          "floor": floor}, repeats=REPEATS, warmup=1)
        ms = {name: statistics.median(t[1:]) * 1e3 for name, t in steps.items()}  # no warmup
        row = {"context": context, "new_tokens": NEW, "identical_tokens": same,
               "ms_per_token": ms, "ratio_vs_transformers": ms["handformer"] / ms["transformers"],
               "ratio_vs_floor": ms["handformer"] / ms["floor"],
               "transformers_vs_floor": ms["transformers"] / ms["floor"]}
        out["decode"].append(row)
        print(f"[{threads} thread(s)] decode after {context}: handformer "
              f"{ms['handformer']:.1f} ms/token, transformers {ms['transformers']:.1f}, floor "
              f"{ms['floor']:.1f}; ratio {row['ratio_vs_transformers']:.2f} (target <= 0.9), "
              f"vs floor {row['ratio_vs_floor']:.2f} (target <= 1.3); identical tokens: {same}",
              flush=True)
    return out


def cache_bytes(ours: torch.nn.Module, theirs: torch.nn.Module) -> dict:
    c = ours.config
    n = CONTEXTS[-1]
    ids = torch.randint(0, SHAPE["vocab_size"], (1, n), generator=torch.Generator().manual_seed(3))
    cache = ours.new_cache(capacity=n)
    with torch.inference_mode():
        ours(ids, cache=cache)
        result = theirs(ids, use_cache=True)
        past = getattr(result, "cache", None) or result.past_key_values
    mha = 2 * c.num_layers * c.num_heads * c.head_dim * n * 4  # K and V, float32
    theirs_bytes = sum(t.numel() * t.element_size() for layer in past.layers
                       for t in (layer.keys, layer.values))
    # a sliding layer (window WINDOW) beside a full one, same head shapes, 2 layers
    from dataclasses import replace

    from handformer import CausalLM

    small = replace(c, num_layers=2, layer_types=["local", "full"], window_size=2 * WINDOW - 1)
    two = CausalLM(small).eval()
    window_cache = two.new_cache(capacity=n)
    with torch.inference_mode():
        two(ids, cache=window_cache)
    sliding, full = (layer.nbytes() for layer in window_cache.layers)
    out = {"context": n, "handformer_bytes": cache.nbytes(), "mha_bytes": mha,
           "transformers_bytes": theirs_bytes, "ratio_vs_mha": cache.nbytes() / mha,
           "expected_ratio": c.num_kv_heads / c.num_heads, "sliding_window": WINDOW,
           "sliding_layer_bytes": sliding, "full_layer_bytes": full,
           "sliding_layer_tokens": sliding // (2 * c.num_kv_heads * c.head_dim * 4)}
    print(f"KV cache at {n} tokens: handformer {cache.nbytes() / 2**20:.1f} MiB, multi-head "
          f"{mha / 2**20:.1f} MiB (ratio {out['ratio_vs_mha']:.3f}, expected "
          f"{out['expected_ratio']:.3f}), transformers {theirs_bytes / 2**20:.1f} MiB; a sliding "
          f"layer (window {WINDOW}) holds {out['sliding_layer_tokens']} tokens", flush=True)
    return out


def streaming(ours: torch.nn.Module, floor_ms: float) -> dict:
    """The host's weight-streaming speed: the floor's bytes over its time, and small
    working sets (1 MB matrices, batch-1 input, looped over)."""
    weights = sum(m.weight.numel() for m in ours.modules()  # the LM head included, once
                  if isinstance(m, torch.nn.Linear)) * 4
    x = torch.randn(1, 256)
    rows = []
    for megabytes in ((2, 4) if QUICK else (4, 16, 64)):
        mats = [torch.randn(1024, 256) for _ in range(megabytes)]

        def sweep(mats: list[torch.Tensor] = mats) -> None:
            with torch.inference_mode():
                for w in mats:
                    F.linear(x, w)

        seconds = interleaved({"sweep": sweep}, repeats=5 if QUICK else 15, warmup=2)["sweep"]
        rows.append({"megabytes": megabytes,
                     "gb_per_s": megabytes * 1.048576e6 / seconds / 1e9})
    return {"model_weight_bytes": weights,
            "floor_gb_per_s": weights / (floor_ms / 1e3) / 1e9, "working_sets": rows}


# VmHWM, not getrusage's ru_maxrss: on Linux ru_maxrss survives exec, so a child forked from
# a big parent would report the parent's size
LOAD_SCRIPT = """
import sys, time
from handformer.pretrained import load_lm
def status(field):
    return int(open("/proc/self/status").read().split(field + ":")[1].split()[0]) * 1024
before = status("VmRSS")
start = time.perf_counter()
model, _ = load_lm(sys.argv[1], tokenizer=False, quantize=(sys.argv[2:] or [None])[0])
seconds = time.perf_counter() - start
peak = status("VmHWM")
size = sum(p.numel() * p.element_size() for p in model.parameters())
print(seconds, peak - before, size)
"""


def load_memory(folder: Path, quantize: str | None = None) -> dict:
    """``load_lm``'s time and peak RSS growth, in a fresh process: built on the meta device
    and filled tensor by tensor, the model should cost about one copy of its weights."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    done = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(folder),
                           *([quantize] if quantize else [])], env=env,
                          capture_output=True, text=True, check=True)
    seconds, growth, size = (float(x) for x in done.stdout.split()[-3:])
    out = {"seconds": seconds, "peak_rss_growth_bytes": growth, "model_bytes": size,
           "growth_over_model": growth / size}
    print(f"load_lm: {seconds:.1f} s, peak RSS growth {growth / 1e6:.0f} MB for a "
          f"{size / 1e6:.0f} MB model ({out['growth_over_model']:.2f}x)", flush=True)
    return out


def write_int8_section(args: list[str]) -> None:
    """Section 6 alone (``--int8``): run it and put it into ``results/llm.json`` and
    ``llm.md`` in place of the last one, the other sections as they were. With
    ``--decode-only`` (and ``--threads 2``, say: comma-separated), only its decoding rows
    are measured again (float32, int8, llama.cpp), its other figures kept."""
    import json

    from common import RESULTS

    old = RESULTS / "llm.json"
    previous = json.loads(old.read_text()) if old.is_file() and not QUICK else {}
    if "--decode-only" in args:
        if "int8" not in previous:
            raise SystemExit("--decode-only re-measures the decoding rows of a complete "
                             "section 6: run --int8 alone first")
        threads = THREADS
        if "--threads" in args:
            threads = tuple(int(t) for t in args[args.index("--threads") + 1].split(","))
        data, lines = bench_int8_decode(previous["int8"], threads)
    else:
        data, lines = bench_int8()
    print("\n".join(lines))
    md = (RESULTS / "llm.md").read_text() if previous else ""
    head = "## int8 "
    if head in md:  # replace the old section (up to the next heading of its level)
        before, _, rest = md.partition(head)
        after = rest.partition("\n## ")[2]
        md = before + "\n".join(lines) + ("\n## " + after if after else "")
    else:
        md = md + "\n" + "\n".join(lines)
    write_results("llm", {**previous, "int8": data}, md)


def main() -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        save_folder(Path(tmp))
        memory = load_memory(Path(tmp))
        start = time.perf_counter()
        ours, _ = load_lm(tmp, tokenizer=False)
        load_s = time.perf_counter() - start
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = transformers.AutoModelForCausalLM.from_pretrained(
                tmp, attn_implementation="sdpa").eval()
        bf16, bf16_lines = bench_bf16(Path(tmp), ours, THREADS, floor_step)  # llm_bf16.py
    theirs.generation_config.eos_token_id = None
    per_threads = [bench_threads(ours, theirs, t) for t in THREADS]
    torch.set_num_threads(1)
    kv = cache_bytes(ours, theirs)
    stream = streaming(ours, per_threads[0]["decode"][0]["ms_per_token"]["floor"])
    print(f"weights streamed: {stream['floor_gb_per_s']:.1f} GB/s in the floor "
          f"({stream['model_weight_bytes'] / 1e6:.0f} MB per step); working sets "
          + ", ".join(f"{r['megabytes']} MB {r['gb_per_s']:.1f} GB/s"
                      for r in stream["working_sets"]), flush=True)
    int8, int8_lines = bench_int8()  # llm_int8.py
    load_end = os.getloadavg()
    data = {"int8": int8, "machine": machine(), "shape": SHAPE, "load_s": load_s,
            "transformers": transformers.__version__, "threads": per_threads,
            "kv_cache": kv, "streaming": stream, "load_memory": memory, "bfloat16": bf16,
            "targets": {"forward_ratio": 1.0, "decode_ratio": 0.9, "decode_vs_floor": 1.3},
            "load_average_start": list(load_start), "load_average_end": list(load_end)}
    ok = lambda c: "yes" if c else "NO"  # noqa: E731
    lines = [
        "# A SmolLM2-135M-shaped Llama against transformers",
        "",
        f"Random weights in SmolLM2-135M's shape ({SHAPE}) saved as a Llama folder, loaded by "
        "`load_lm` and by transformers (sdpa); float32, batch 1, interleaved medians. "
        f"Load average {load_start[0]:.1f} at start, {load_end[0]:.1f} at the end: the CPU "
        "was shared, figures are noisy.",
        "",
        f"Machine: {machine_line()}",
        "",
        "| threads | measurement | handformer | transformers | floor | ratio | target | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in per_threads:
        f = r["forward_ms"]
        lines.append(f"| {r['threads']} | forward {FORWARD_LEN} tokens (ms) | "
                     f"{f['handformer']:.0f} | {f['transformers']:.0f} | | "
                     f"{r['forward_ratio']:.2f} | ≤ 1.0 | {ok(r['forward_ratio'] <= 1.0)} |")
        for d in r["decode"]:
            ms = d["ms_per_token"]
            lines.append(
                f"| {r['threads']} | decode after {d['context']} (ms/token) | "
                f"{ms['handformer']:.1f} | {ms['transformers']:.1f} | {ms['floor']:.1f} | "
                f"{d['ratio_vs_transformers']:.2f} (floor {d['ratio_vs_floor']:.2f}) | ≤ 0.9 "
                f"(floor ≤ 1.3) | {ok(d['ratio_vs_transformers'] <= 0.9)} "
                f"({ok(d['ratio_vs_floor'] <= 1.3)}) |")
    lines += [
        "",
        f"KV cache at {kv['context']} tokens: handformer {kv['handformer_bytes'] / 2**20:.1f} "
        f"MiB, multi-head {kv['mha_bytes'] / 2**20:.1f} MiB: ratio {kv['ratio_vs_mha']:.3f} "
        f"(num_kv_heads / num_heads = {kv['expected_ratio']:.3f}); transformers "
        f"{kv['transformers_bytes'] / 2**20:.1f} MiB. A sliding layer (window "
        f"{kv['sliding_window']}) holds {kv['sliding_layer_tokens']} tokens at "
        f"{kv['context']}.",
        "",
        f"`load_lm` in a fresh process: {memory['seconds']:.1f} s, peak RSS growth "
        f"{memory['growth_over_model']:.2f}x the model's {memory['model_bytes'] / 1e6:.0f} MB "
        "(built on the meta device, filled tensor by tensor).",
        "",
        f"Weights streamed in the floor: {stream['floor_gb_per_s']:.1f} GB/s "
        f"({stream['model_weight_bytes'] / 1e6:.0f} MB per step); small working sets: "
        + ", ".join(f"{r['megabytes']} MB {r['gb_per_s']:.1f} GB/s"
                    for r in stream["working_sets"]) + ".",
        "",
        *int8_lines,
        *bf16_lines,
    ]
    write_results("llm", data, "\n".join(lines))


if __name__ == "__main__":
    if "--int8" in sys.argv[1:]:
        write_int8_section(sys.argv[1:])
    else:
        main()
