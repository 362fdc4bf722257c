"""Decoding speed: incremental decoding with caches vs recomputation, and long contexts.

CPU, float32, batch 1, a small CausalLM (d_model=256, 4 heads, 4 layers, d_ff=1024,
vocabulary 1000). Three measurements, each in one process with interleaved runs (median):

1. per-token latency with a KV cache at context 1024 vs context 128 (full attention);
   target ratio <= 2;
2. generating 512 tokens with the cache vs without (recomputing the whole sequence at every
   step); target speed-up >= 5;
3. linear-attention decoding at contexts 1k..16k: per-token time and cache memory, which
   should stay flat (the (S, z) state has a fixed size), beside full attention's growing KV
   cache for contrast;
4. against the tool users would pick instead: the same GPT-2-shaped model (random weights
   saved as a GPT-2 folder, loaded by ``handformer.pretrained.load_gpt2`` and by
   ``transformers.GPT2LMHeadModel``) generating 128 tokens greedily after contexts of 128 and
   1024 tokens, with handformer's ``generate`` (eager: the default, each new token through
   the plain-function step; ``plain_step=False``, every step through the modules; and
   ``compile=True``) and transformers' ``generate`` (its KV cache); identical tokens
   asserted; target
   handformer / transformers <= 0.5 in ms per new token.

Run: ``make bench`` or ``.venv/bin/python benchmarks/bench_decode.py``
(``HANDFORMER_BENCH_QUICK=1`` for tiny sizes).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QUICK, interleaved, machine, machine_line, write_results  # noqa: E402
from handformer import CausalLM, CausalLMConfig  # noqa: E402
from handformer.pretrained import load_gpt2  # noqa: E402

V = 1000
SIZE = dict(d_model=32, num_heads=2, num_layers=1, d_ff=64) if QUICK else \
    dict(d_model=256, num_heads=4, num_layers=4, d_ff=1024)
SHORT, LONG = (16, 64) if QUICK else (128, 1024)
GEN_TOKENS = 8 if QUICK else 512
CONTEXTS = [32, 64] if QUICK else [1024, 2048, 4096, 8192, 16384]
STEPS = 3 if QUICK else 16  # decode steps timed per measurement
HF_CONTEXTS = (16, 64) if QUICK else (128, 1024)  # the comparison with transformers
HF_NEW = 8 if QUICK else 128  # tokens generated after each context
HF_REPEATS = 1 if QUICK else 7
# torch.compile with Inductor: its C++ build of the decode step takes about a minute on a
# 2-core machine; HANDFORMER_BENCH_COMPILE=0 leaves the compiled column out.
HF_COMPILE = os.environ.get("HANDFORMER_BENCH_COMPILE", "0" if QUICK else "1") == "1"


def model(attention: str = "full", max_len: int = 2048) -> CausalLM:
    torch.manual_seed(0)
    config = CausalLMConfig(vocab_size=V, max_len=max_len, attention=attention,
                            positional="rotary", **SIZE)
    return CausalLM(config).eval()


def prefill(m: CausalLM, n: int):  # noqa: ANN201 - a DecodingCache
    cache = m.new_cache()
    with torch.inference_mode():
        for start in range(0, n, 4096):  # long prompts in pieces (bounded activations)
            m(torch.randint(0, V, (1, min(4096, n - start))), cache=cache)
    return cache


def step_timer(m: CausalLM, cache) -> callable:  # noqa: ANN001
    token = torch.randint(0, V, (1, 1))

    def step() -> None:
        with torch.inference_mode():
            m(token, cache=cache)

    return step


def bench_context_latency() -> dict[str, float]:
    m = model(max_len=LONG + 4 * STEPS + 8)
    fns = {f"ctx{SHORT}": step_timer(m, prefill(m, SHORT)),
           f"ctx{LONG}": step_timer(m, prefill(m, LONG))}
    return interleaved(fns, repeats=STEPS, warmup=2)


def bench_generate() -> dict[str, float]:
    m = model(max_len=GEN_TOKENS + 8)
    prompt = torch.randint(0, V, (1, 4))

    def gen(use_cache: bool) -> callable:
        return lambda: m.generate(prompt, max_new_tokens=GEN_TOKENS, use_cache=use_cache)

    return interleaved({"cached": gen(True), "uncached": gen(False)}, repeats=1 if QUICK else 3,
                       warmup=0)


def bench_long_contexts() -> list[dict[str, float]]:
    linear = model("linear", max_len=CONTEXTS[-1] + 4 * STEPS + 8)
    full = model("full", max_len=CONTEXTS[-1] + 4 * STEPS + 8)
    caches = {(name, n): prefill(m, n) for n in CONTEXTS
              for name, m in (("linear", linear), ("full", full))}
    fns = {key: step_timer(linear if key[0] == "linear" else full, cache)
           for key, cache in caches.items()}
    # All (kind, context) steps interleaved round by round: a change in the machine's load
    # hits every context alike.
    times = interleaved(fns, repeats=STEPS, warmup=1)
    rows = []
    for n in CONTEXTS:
        row: dict[str, float] = {"context": n}
        for name in ("linear", "full"):
            row[f"{name}_ms"] = times[(name, n)] * 1e3
            row[f"{name}_cache_kib"] = caches[(name, n)].nbytes() / 1024
        rows.append(row)
        print(f"context {n:>6}: linear {row['linear_ms']:.2f} ms/token, "
              f"{row['linear_cache_kib']:.0f} KiB | full {row['full_ms']:.2f} ms/token, "
              f"{row['full_cache_kib']:.0f} KiB", flush=True)
    return rows


def save_gpt2_folder(folder: Path) -> None:
    """A random GPT-2 of the benchmark's size, saved by transformers (safetensors)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=V, n_positions=HF_CONTEXTS[-1] + HF_NEW,
                                     n_embd=SIZE["d_model"], n_layer=SIZE["num_layers"],
                                     n_head=SIZE["num_heads"], n_inner=SIZE["d_ff"],
                                     bos_token_id=V - 1, eos_token_id=V - 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.GPT2LMHeadModel(config).eval().save_pretrained(folder)


def bench_vs_transformers() -> dict[str, object]:
    """ms per new token: handformer's generate (eager; compiled) vs transformers' generate.

    Each library generates ``HF_NEW`` tokens and, separately, 1 token after the same
    prompt; ``(t(HF_NEW) - t(1)) / (HF_NEW - 1)`` is the time of one decoding step with the
    cache (the prompt's prefill cancels out). All calls interleaved round by round, medians.
    """
    import transformers

    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        save_gpt2_folder(Path(tmp))
        ours, _ = load_gpt2(tmp, tokenizer=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp).eval()
    # Greedy, no early stop: the eos id is never produced on purpose (min_new_tokens would
    # change the scores), so both sides always generate HF_NEW tokens.
    theirs.generation_config.eos_token_id = None

    def run_theirs(prompt: torch.Tensor, n: int) -> torch.Tensor:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return theirs.generate(prompt, attention_mask=torch.ones_like(prompt),
                                   max_new_tokens=n, do_sample=False, pad_token_id=V - 1)

    # The floor: one step's matrix-vector products alone (the model's Linear layers, LM head
    # included, on a batch-1 input), n times. Both libraries read the same float32 weights
    # (13.6 MB) per token; this is what that costs here, with no other work.
    linears = [mod for mod in ours.modules() if isinstance(mod, torch.nn.Linear)]
    inputs = {n: torch.randn(1, 1, n) for n in {mod.in_features for mod in linears}}

    def run_matmuls(prompt: torch.Tensor, n: int) -> None:
        with torch.inference_mode():
            for _ in range(n):
                for mod in linears:
                    torch.nn.functional.linear(inputs[mod.in_features], mod.weight, mod.bias)

    variants = {"handformer": lambda p, n: ours.generate(p, max_new_tokens=n),
                "handformer_modules":
                    lambda p, n: ours.generate(p, max_new_tokens=n, plain_step=False),
                "transformers": run_theirs, "matmuls_only": run_matmuls}
    compile_s: dict[str, float] = {}  # context -> seconds of the first (compiling) call
    if HF_COMPILE:
        # A fresh Inductor cache folder: the compile time reported is a cold compile, as a
        # user's first call (kernels compiled by earlier runs are not reused).
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="handformer-inductor-")
        variants["handformer_compiled"] = \
            lambda p, n: ours.generate(p, max_new_tokens=n, compile=True)
    rows = []
    for n_ctx in HF_CONTEXTS:
        prompt = torch.randint(0, V - 1, (1, n_ctx), generator=torch.Generator().manual_seed(n_ctx))
        tokens = {}
        for name, fn in variants.items():
            start = time.perf_counter()
            tokens[name] = fn(prompt, HF_NEW)  # also the warm-up (compiles once)
            if name == "handformer_compiled":
                compile_s[str(n_ctx)] = time.perf_counter() - start
        for name, ids in tokens.items():
            if name == "matmuls_only":
                continue
            assert ids.shape == (1, n_ctx + HF_NEW), (name, ids.shape)
            assert ids.tolist() == tokens["transformers"].tolist(), \
                f"{name} and transformers chose different greedy tokens at context {n_ctx}"
        fns = {}
        for name, fn in variants.items():
            fns[(name, HF_NEW)] = lambda fn=fn, p=prompt: fn(p, HF_NEW)
            fns[(name, 1)] = lambda fn=fn, p=prompt: fn(p, 1)
        times = interleaved(fns, repeats=HF_REPEATS, warmup=1)
        cpu = interleaved(fns, repeats=HF_REPEATS, warmup=0, clock=time.process_time)
        row: dict[str, object] = {"context": n_ctx, "new_tokens": HF_NEW,
                                  "identical_tokens": True}
        for name in variants:
            row[f"{name}_ms_per_token"] = \
                (times[(name, HF_NEW)] - times[(name, 1)]) / (HF_NEW - 1) * 1e3
            row[f"{name}_cpu_ms_per_token"] = \
                (cpu[(name, HF_NEW)] - cpu[(name, 1)]) / (HF_NEW - 1) * 1e3
            row[f"{name}_total_s"] = times[(name, HF_NEW)]
        for name in variants:
            if name != "transformers":  # (for matmuls_only: the floor, as a fraction)
                row[f"{name}_ratio"] = (row[f"{name}_ms_per_token"]
                                        / row["transformers_ms_per_token"])
                row[f"{name}_cpu_ratio"] = (row[f"{name}_cpu_ms_per_token"]
                                            / row["transformers_cpu_ms_per_token"])
        rows.append(row)
        print(f"vs transformers, context {n_ctx}: " + ", ".join(
            f"{name} {row[f'{name}_ms_per_token']:.2f} ms/token "
            f"({row[f'{name}_cpu_ms_per_token']:.2f} CPU)" for name in variants)
            + f"; ratio {row['handformer_ratio']:.2f}, CPU {row['handformer_cpu_ratio']:.2f} "
            "(target <= 0.5)", flush=True)
    if HF_COMPILE:  # the kernels are loaded; their fresh cache folder can go
        shutil.rmtree(os.environ.pop("TORCHINDUCTOR_CACHE_DIR"), ignore_errors=True)
    weights_mb = sum(mod.weight.numel() for mod in linears) * 4 / 1e6
    return {"rows": rows, "target": 0.5, "compile_s": compile_s, "weights_mb": weights_mb,
            "matmuls": len(linears),
            "transformers": transformers.__version__}


def bench_memory_regime() -> list[dict[str, float]]:
    """How fast this machine streams float32 weights through matrix-vector products, by the
    size of the working set: 1 MB matrices (1024 x 256, batch-1 input), looped over.

    A step reads every weight once; while they fit in the caches they stream at cache speed,
    past that at memory speed. Where that edge lies decides how much of a decoding step is
    the weights' floor (the same for every library), so it is recorded beside the timings.
    """
    x = torch.randn(1, 256)
    rows = []
    for megabytes in ((2, 4) if QUICK else (4, 8, 16, 32)):
        weights = [torch.randn(1024, 256) for _ in range(megabytes)]

        def sweep(weights: list[torch.Tensor] = weights) -> None:
            with torch.inference_mode():
                for w in weights:
                    torch.nn.functional.linear(x, w)

        seconds = interleaved({"sweep": sweep}, repeats=5 if QUICK else 25, warmup=3)["sweep"]
        rows.append({"megabytes": megabytes, "gb_per_s": megabytes * 1.048576e6 / seconds / 1e9})
    return rows


def main() -> None:
    # One thread: a single-token step is a chain of small ops that two threads cannot share
    # usefully, and on a CPU shared with other processes two threads stall at every barrier
    # (per-token times of 100+ ms instead of a few). The same setting for every variant.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    load_start = os.getloadavg()[0]
    peer = bench_vs_transformers()
    regime = bench_memory_regime()
    print("weights streamed by matrix-vector products: " + ", ".join(
        f"{r['megabytes']} MB at {r['gb_per_s']:.1f} GB/s" for r in regime), flush=True)
    lat = bench_context_latency()
    lat_ratio = lat[f"ctx{LONG}"] / lat[f"ctx{SHORT}"]
    print(f"per-token latency: ctx {SHORT} {lat[f'ctx{SHORT}'] * 1e3:.2f} ms, ctx {LONG} "
          f"{lat[f'ctx{LONG}'] * 1e3:.2f} ms, ratio {lat_ratio:.2f} (target <= 2)", flush=True)
    gen = bench_generate()
    speedup = gen["uncached"] / gen["cached"]
    print(f"generate {GEN_TOKENS} tokens: cached {gen['cached']:.2f} s, uncached "
          f"{gen['uncached']:.2f} s, speed-up {speedup:.1f}x (target >= 5)", flush=True)
    rows = bench_long_contexts()
    lin = [r["linear_ms"] for r in rows]
    flat_time = max(lin) / min(lin)
    flat_mem = max(r["linear_cache_kib"] for r in rows) / min(r["linear_cache_kib"] for r in rows)
    print(f"linear decoding: time max/min {flat_time:.2f}, cache memory max/min {flat_mem:.2f}")
    ok = lambda c: "yes" if c else "NO"  # noqa: E731
    compiled = HF_COMPILE
    names = ["handformer", "handformer_modules", *(["handformer_compiled"] if compiled else []),
             "transformers"]

    def both(r: dict, key: str) -> str:  # "wall (CPU)"
        cpu = key.replace("_ms", "_cpu_ms").replace("_ratio", "_cpu_ratio")
        return f"{r[key]:.2f} ({r[cpu]:.2f})"

    floor = [f"| {r['context']} | {both(r, 'matmuls_only_ms_per_token')} | "
             f"{both(r, 'matmuls_only_ratio')} |" for r in peer["rows"]]

    peer_rows = [
        f"| {r['context']} | " + " | ".join(both(r, f"{n}_ms_per_token") for n in names)
        + " | " + " | ".join(both(r, f"{n}_ratio") + f" {ok(r[f'{n}_ratio'] <= 0.5)}"
                             for n in names[:-1]) + " |"
        for r in peer["rows"]]
    md = "\n".join([
        "# Decoding: caches vs recomputation",
        "",
        f"CausalLM {SIZE}, vocabulary {V}, rotary positions, batch 1, float32, CPU, one torch "
        "thread. Interleaved runs, medians. Other processes shared the CPU: figures are noisy.",
        "",
        f"Machine: {machine_line()}",
        "",
        "| measurement | value | target | met |",
        "|---|---|---|---|",
        f"| per-token latency with KV cache, context {SHORT} | "
        f"{lat[f'ctx{SHORT}'] * 1e3:.2f} ms | | |",
        f"| per-token latency with KV cache, context {LONG} | "
        f"{lat[f'ctx{LONG}'] * 1e3:.2f} ms | | |",
        f"| ratio {LONG} / {SHORT} | {lat_ratio:.2f} | ≤ 2 | {ok(lat_ratio <= 2)} |",
        f"| generate {GEN_TOKENS} tokens, cached | {gen['cached']:.2f} s | | |",
        f"| generate {GEN_TOKENS} tokens, uncached | {gen['uncached']:.2f} s | | |",
        f"| speed-up | {speedup:.1f}× | ≥ 5× | {ok(speedup >= 5)} |",
        "",
        "## Long contexts: per-token decoding time and cache memory",
        "",
        "| context | linear ms/token | linear cache KiB | full ms/token | full KV cache KiB |",
        "|---|---|---|---|---|",
        *[f"| {r['context']} | {r['linear_ms']:.2f} | {r['linear_cache_kib']:.0f} | "
          f"{r['full_ms']:.2f} | {r['full_cache_kib']:.0f} |" for r in rows],
        "",
        f"Linear attention: time max/min {flat_time:.2f}, cache memory max/min {flat_mem:.2f} "
        "(flat = 1). The full-attention KV cache grows with the context (its buffer doubles).",
        "",
        f"## Against transformers {peer['transformers']}: GPT2LMHeadModel.generate",
        "",
        f"The same random GPT-2 ({SIZE['num_layers']} layers, d={SIZE['d_model']}, "
        f"{SIZE['num_heads']} heads, vocabulary {V}) saved as a GPT-2 folder, loaded by "
        "`handformer.pretrained.load_gpt2` and by `transformers.GPT2LMHeadModel`; greedy "
        f"generation of {HF_NEW} tokens after the context, both with their KV cache, one torch "
        "thread, identical tokens asserted. ms per new token = (time for "
        f"{HF_NEW} tokens - time for 1 token) / {HF_NEW - 1} (the prompt's prefill cancels "
        f"out); medians of {HF_REPEATS} interleaved rounds.",
        "",
        "Each cell: wall-clock median (CPU-time median of this process in brackets: what the "
        "one-threaded run itself cost, less disturbed by other jobs on a shared CPU). Target: "
        "handformer / transformers ≤ 0.5.",
        "",
        "handformer is `generate`'s default: the prompt through the modules, each new token "
        "through the plain-function step (`handformer/models/plain_step.py`); "
        "`plain_step=False` runs every step through the modules (`CausalLM.decode_step`), "
        "the same tokens.",
        "",
        "| context | handformer ms/token | plain_step=False ms/token | "
        + ("compile=True ms/token | " if compiled else "")
        + "transformers ms/token | handformer / transformers | plain_step=False / transformers |"
        + (" compile=True / transformers |" if compiled else ""),
        "|---|---|---|---|---|---|" + ("---|---|" if compiled else ""),
        *peer_rows,
        "",
        f"The floor: the same weights' {peer['matmuls']} matrix-vector products alone (every "
        "Linear layer and the LM head on a batch-1 input, nothing else), per token. Both "
        f"libraries read these {peer['weights_mb']:.1f} MB of float32 weights at every step: "
        "this part no saving on dispatch removes, so handformer / transformers cannot go "
        "below this fraction by overhead cuts alone.",
        "",
        "| context | matrix-vector products alone, ms/token | as a fraction of transformers' "
        "step |",
        "|---|---|---|",
        *floor,
        "",
        ("`compile=True` (torch.compile, Inductor, C++ wrapper): the first call, which "
         "compiles, took " + ", ".join(f"{v:.0f} s (context {k})"
                                       for k, v in peer["compile_s"].items())
         + ", from a cold cache; later calls with the same model, batch size and cache size "
         "(prompt plus new tokens rounded up to 256) reuse the graph."
         if compiled
         else "`compile=True` was not measured (HANDFORMER_BENCH_COMPILE=0)."),
        "",
        "How fast this machine streams float32 weights through matrix-vector products "
        "(1 MB matrices looped over, one thread), by the size of the working set: while the "
        f"weights fit in the caches they stream at cache speed; the model's "
        f"{peer['weights_mb']:.1f} MB of weights may not.",
        "",
        "| working set | GB/s |",
        "|---|---|",
        *[f"| {r['megabytes']} MB | {r['gb_per_s']:.1f} |" for r in regime],
        "",
        "Reproduce: `.venv/bin/python benchmarks/bench_decode.py` (or `make bench`).",
        "",
    ])
    write_results("decode", {
        "machine": machine(), "config": {**SIZE, "vocab_size": V},
        "latency": {**lat, "ratio": lat_ratio, "target": 2.0},
        "generate": {**gen, "tokens": GEN_TOKENS, "speedup": speedup, "target": 5.0},
        "long_contexts": rows, "linear_time_max_over_min": flat_time,
        "linear_memory_max_over_min": flat_mem, "vs_transformers": peer,
        "memory_regime": regime,
        "load_average_start_end": [load_start, os.getloadavg()[0]],
    }, md)


if __name__ == "__main__":
    main()
