"""int8 against float32 on the two shipped GGUF models (issue 37, section 1).

Section 6 of ``bench_llm.py``; alone: ``.venv/bin/python benchmarks/bench_llm.py --int8``
(it writes this section into ``results/llm.json`` and ``llm.md`` and keeps the others).
Per model (SmolLM2-135M-Instruct, Q4_1, 98 MB; Gemma 3 270M, Q4_K_M, 253 MB; quick mode:
SmolLM2 alone, short runs), float32 and int8 loaded from the same file:

1. ``load_lm`` in a fresh process, float32 and ``quantize="int8"``: seconds and peak RSS
   growth after ``import handformer`` (VmHWM less VmRSS before the call); goal int8 <= 2x
   the GGUF file;
2. agreement with float32 on an English, a Chinese and a code prompt (those of
   ``tests/test_quantize.py``), as llama.cpp reports its quantizations: top-1 agreement,
   mean KL(float32 || int8) per token, largest logit difference; goal >= 95 % over the three;
3. greedy decoding, ms per new token after 128 tokens of context, 1 and 2 threads, float32
   and int8 interleaved round by round: CPU time (``time.process_time``, which a shared
   host's other jobs do not add to at one thread) and wall time, the minimum over rounds (a
   shared host only ever adds time); goal int8 <= 1.5x llama.cpp;
4. prefill of 512 tokens, CPU seconds, interleaved, the minimum; goal int8 <= float32;
5. the floor: bytes read per token (int8: the int8 weights and the exact columns; float32:
   the weights) over the bandwidth a float32 matrix-vector sweep over the float32 model's
   weights reaches in the same run, one thread;
6. llama.cpp on the same file: ``LLAMA_BENCH=/path/to/llama-bench`` measures it in this run
   (CPU time per generated token, from two run lengths, so that loading drops out; 1 and 2
   threads; after ``CONTEXT`` tokens already in its cache, ``-d``, as ours), in each round
   of 3., the minimum as for ours (a shared host's speed drifts over minutes: measured once,
   after ours, SmolLM2's was 10.8 and 14.8 ms within one hour); else
   the figures measured on this host for the issue (1 thread).

``bench_llm.py --int8 --decode-only [--threads 2]`` measures only the decoding rows (3. and
6.) again and keeps the section's other figures: for a quiet window.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QUICK, interleaved_runs  # noqa: E402
from handformer.models.quantized import Int8Linear  # noqa: E402
from handformer.pretrained import load_lm  # noqa: E402

MODELS = ("smollm2-135m-instruct",) if QUICK else ("smollm2-135m-instruct", "gemma3-270m")
THREADS = (1,) if QUICK else (1, 2)
CONTEXT = 32 if QUICK else 128
NEW = 8 if QUICK else 33
ROUNDS = 1 if QUICK else 3
PREFILL = 32 if QUICK else 512
# llama.cpp's ms of CPU per token on the same files, 1 thread, measured on this host for issue
# 37 (used when LLAMA_BENCH is not set)
LLAMA_CPP_MS = {"smollm2-135m-instruct": 14.2, "gemma3-270m": 19.4}
GOALS = {"decode_vs_llama_cpp": 1.5, "rss_vs_file": 2.0, "agreement": 0.95,
         "prefill_vs_float32": 1.0}
# The prompts of tests/test_quantize.py (English, Chinese, code).
PROMPTS = {
    "english": "The history of the printing press begins in the fifteenth century, when "
               "Johannes Gutenberg combined movable metal type, oil-based ink and a screw "
               "press. Within fifty years, presses across Europe had produced millions of "
               "books, and ideas travelled faster than ever before.",
    "chinese": "北京是中国的首都，有三千多年的历史。这座城市有许多著名的景点，比如故宫、天坛和"
               "长城。每年都有成千上万的游客来这里参观，品尝北京烤鸭。",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
            "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\n"
            "for i in range(10):\n    print(i, fibonacci(i))\n",
}

# VmHWM after the call less VmRSS before it, in a fresh process, after `import handformer`
LOAD_SCRIPT = """
import sys, time
import handformer
from handformer.pretrained import load_lm
def status(field):
    return int(open("/proc/self/status").read().split(field + ":")[1].split()[0]) * 1024
before = status("VmRSS")
start = time.perf_counter()
model, _ = load_lm(sys.argv[1], tokenizer=False, quantize=(sys.argv[2:] or [None])[0])
print(time.perf_counter() - start, status("VmHWM") - before)
"""


def load_memory(path: Path, kinds: tuple[str | None, ...]) -> dict[str, dict]:
    """``load_lm``'s seconds and peak RSS growth in a fresh process for each of ``kinds``
    (None: float32), one after another; side by side in the quick mode (the smoke test's
    time: the seconds then say little, the memory as much as before)."""
    src = os.environ.get("PYTHONPATH") or str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}

    def start(quantize: str | None) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", LOAD_SCRIPT, str(path),
                                 *([quantize] if quantize else [])], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def finish(process: subprocess.Popen) -> dict:
        out, err = process.communicate()
        if process.returncode:
            raise subprocess.CalledProcessError(process.returncode, process.args, out, err)
        seconds, growth = (float(x) for x in out.split()[-2:])
        return {"seconds": seconds, "peak_rss_growth_bytes": growth}

    if QUICK:
        running = {q or "float32": start(q) for q in kinds}
        return {label: finish(process) for label, process in running.items()}
    return {q or "float32": finish(start(q)) for q in kinds}


def agreement(fp: torch.nn.Module, q8: torch.nn.Module, tok: object) -> dict:
    """Top-1 agreement, mean KL and the largest logit difference per prompt and overall."""
    rows, same_all, total = {}, 0, 0
    for name, text in PROMPTS.items():
        ids = torch.tensor([tok.encode(text)])
        with torch.inference_mode():
            ref, out = fp(ids).logits[0], q8(ids).logits[0]  # (L, V)
        same = int((ref.argmax(-1) == out.argmax(-1)).sum())
        kl = F.kl_div(out.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                      reduction="none").sum(-1).mean()  # KL(float32 || int8) per token
        rows[name] = {"tokens": len(ref), "top1": same / len(ref), "mean_kl": float(kl),
                      "max_logit_diff": float((out - ref).abs().max())}
        same_all, total = same_all + same, total + len(ref)
    return {"prompts": rows, "top1": same_all / total, "tokens": total}


def decode_ms(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """Greedy decoding, ms per token from the first new token to the last: (CPU, wall)."""
    stamps: list[tuple[float, float]] = []

    def streamer(_: torch.Tensor) -> None:
        stamps.append((time.process_time(), time.perf_counter()))

    with torch.inference_mode():
        model.generate(ids, max_new_tokens=NEW, streamer=streamer)
    (c0, w0), (c1, w1) = stamps[0], stamps[-1]  # stamps[0]: after the prefill
    return (c1 - c0) / (len(stamps) - 1) * 1e3, (w1 - w0) / (len(stamps) - 1) * 1e3


def int8_bytes(model: torch.nn.Module) -> int:
    """What an int8 step reads: each Int8Linear's int8 weights and exact columns."""
    total, seen = 0, set()
    for m in model.modules():
        group = getattr(m, "_group", None)
        if type(m) is Int8Linear and group is None:  # (an Int8Linear of before the groups)
            total += m.in_features * m.out_features
        elif type(m) is Int8Linear and id(group) not in seen:  # a group's matrix once
            seen.add(id(group))
            total += m.in_features * sum(group.sizes)
            if group.exact_t is not None:
                total += group.exact_t.numel() * 4
    return total


def bandwidth(fp: torch.nn.Module) -> tuple[float, int]:
    """GB/s of float32 matrix-vector products over every weight of ``fp`` (1 thread), and
    those bytes."""
    weights = [m.weight for m in fp.modules() if isinstance(m, torch.nn.Linear)]
    xs = {n: torch.randn(1, n) for n in {w.shape[1] for w in weights}}

    def sweep() -> None:
        with torch.inference_mode():
            for w in weights:
                F.linear(xs[w.shape[1]], w)

    nbytes = sum(w.numel() * 4 for w in weights)
    runs = interleaved_runs({"sweep": sweep}, repeats=1 if QUICK else 5, warmup=1,
                            clock=time.process_time)
    return nbytes / min(runs["sweep"]) / 1e9, nbytes


def llama_cpp(path: Path, threads: int) -> dict | None:
    """llama.cpp's ms per generated token on ``path`` (``LLAMA_BENCH``), or None."""
    binary = os.environ.get("LLAMA_BENCH")
    if not binary:
        return None

    def run(n: int) -> tuple[float, float]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        # -d: the new tokens follow CONTEXT tokens already in the cache, as ours do (decode_ms
        # times the tokens after a CONTEXT-token prompt); llama.cpp's step costs more deeper
        # in (Gemma 3, 1 thread: 19.2 ms at depth 0 and 22.5 at 128, measured here)
        done = subprocess.run([binary, "-m", str(path), "-p", "0", "-n", str(n), "-r", "3",
                               "-d", str(CONTEXT), "-t", str(threads), "-o", "json"],
                              capture_output=True, text=True, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        speed = json.loads(done.stdout)[0]["avg_ts"]  # tokens per second (wall)
        return cpu, 1e3 / speed

    short, long = (4, 16) if QUICK else (16, 64)
    (cpu0, _), (cpu1, wall) = run(short), run(long)
    cpu = (cpu1 - cpu0) / (3 * (long - short)) * 1e3
    # (at two threads on a busy host, llama.cpp's threads spin while they wait for each
    # other: CPU time then says little, and the difference of two runs can even be < 0)
    return {"cpu_ms": cpu if cpu > 0 else None, "wall_ms": wall}


def _context_ids(tok: object, n: int) -> torch.Tensor:
    """``(1, n)``: the English prompt repeated to ``n`` tokens."""
    text = tok.encode(PROMPTS["english"])
    return torch.tensor([(text * (n // len(text) + 1))[:n]])


def decode_row(name: str, models: dict[str, torch.nn.Module], ids: torch.Tensor,
               threads: int) -> dict:
    """Greedy decoding at ``threads`` threads, ``models`` (label -> model: float32, int8,
    int4) interleaved round by round (the minimum over rounds), and llama.cpp on the same
    file."""
    from handformer.pretrained.gguf.shipped import shipped_path

    runs: dict[str, list[tuple[float, float]]] = {label: [] for label in models}
    llama = []
    for _ in range(ROUNDS):  # llama.cpp in every round too: the host drifts over minutes
        torch.set_num_threads(threads)
        for label, model in models.items():
            runs[label].append(decode_ms(model, ids))
        torch.set_num_threads(1)
        llama.append(llama_cpp(shipped_path(name), threads))
    cpu = [r["cpu_ms"] for r in llama if r is not None and r["cpu_ms"] is not None]
    wall = [r["wall_ms"] for r in llama if r is not None]
    return {"threads": threads,
            "decode_cpu_ms": {k: min(c for c, _ in v) for k, v in runs.items()},
            "decode_wall_ms": {k: min(w for _, w in v) for k, v in runs.items()},
            "llama_cpp": {"cpu_ms": min(cpu) if cpu else None, "wall_ms": min(wall)}
            if wall else None}


def bench_model(name: str) -> dict:
    from handformer.pretrained.gguf.shipped import shipped_path

    path = shipped_path(name)
    memory = load_memory(path, (None, "int8", "int4"))
    torch.set_num_threads(1)
    fp, tok = load_lm(path)
    q8, _ = load_lm(path, tokenizer=False, quantize="int8")
    q4, _ = load_lm(path, tokenizer=False, quantize="int4")
    models = {"float32": fp, "int8": q8, "int4": q4}
    agree, agree4 = agreement(fp, q8, tok), agreement(fp, q4, tok)
    gbps, fp_bytes = bandwidth(fp)
    q8_bytes = int8_bytes(q8)
    ids, prefill_ids = _context_ids(tok, CONTEXT), _context_ids(tok, PREFILL)
    rows = []
    for threads in THREADS:
        row = decode_row(name, models, ids, threads)
        torch.set_num_threads(threads)

        def prefill(m: torch.nn.Module) -> None:
            with torch.inference_mode():
                m(prefill_ids)

        prefills = interleaved_runs({label: functools.partial(prefill, m)
                                     for label, m in models.items()},
                                    repeats=ROUNDS, clock=time.process_time)
        torch.set_num_threads(1)
        row["prefill_cpu_s"] = {k: min(v) for k, v in prefills.items()}
        rows.append(row)
        print(f"{name}, {threads} thread(s): decode int8 {row['decode_cpu_ms']['int8']:.1f} "
              f"ms/token CPU ({row['decode_wall_ms']['int8']:.1f} wall), float32 "
              f"{row['decode_cpu_ms']['float32']:.1f} ({row['decode_wall_ms']['float32']:.1f})"
              f"; prefill {PREFILL} tokens int8 {row['prefill_cpu_s']['int8']:.2f} s, float32 "
              f"{row['prefill_cpu_s']['float32']:.2f} s; int4 decode "
              f"{row['decode_cpu_ms']['int4']:.1f} ({row['decode_wall_ms']['int4']:.1f}), "
              f"prefill {row['prefill_cpu_s']['int4']:.2f} s; llama.cpp {row['llama_cpp']}",
              flush=True)
    return {"model": name, "gguf_bytes": path.stat().st_size, "load": memory,
            "agreement": agree, "agreement_int4": agree4,
            "threads": rows, "bandwidth_gb_per_s": gbps,
            "bytes_per_token": {"float32": fp_bytes, "int8": q8_bytes},
            "floor_ms": {"float32": fp_bytes / gbps / 1e6, "int8": q8_bytes / gbps / 1e6},
            "context": CONTEXT, "new_tokens": NEW}


def bench_int8() -> tuple[dict, list[str]]:
    """Section 6 for every model: ``(data, markdown lines)``."""
    start = os.getloadavg()
    models = [bench_model(name) for name in MODELS]
    end = os.getloadavg()
    data = {"models": models, "goals": GOALS, "llama_cpp_issue_ms": LLAMA_CPP_MS,
            "llama_cpp_depth": CONTEXT,
            "load_average_start": list(start), "load_average_end": list(end)}
    return data, markdown(data)


def bench_int8_decode(previous: dict, threads: tuple[int, ...]) -> tuple[dict, list[str]]:
    """Only the decoding rows (float32, int8 and llama.cpp) at ``threads``, measured again
    and put into ``previous`` (a complete section 6, whose other figures stay): what a quiet
    window re-measures (``bench_llm.py --int8 --decode-only [--threads 2]``).

    Raises:
        ValueError: for a model or thread count ``previous`` has no row of.
    """
    from handformer.pretrained.gguf.shipped import shipped_path

    data = json.loads(json.dumps(previous))  # a copy
    start = os.getloadavg()
    for m in data["models"]:
        have = {r["threads"]: r for r in m["threads"]}
        if m["model"] not in MODELS or any(t not in have for t in threads):
            raise ValueError(f"--decode-only re-measures rows of a complete run: "
                             f"{m['model']} has threads {sorted(have)}, asked {threads}")
        torch.set_num_threads(1)
        path = shipped_path(m["model"])
        fp, tok = load_lm(path)
        q8, _ = load_lm(path, tokenizer=False, quantize="int8")
        q4, _ = load_lm(path, tokenizer=False, quantize="int4")
        ids = _context_ids(tok, m["context"])
        for t in threads:
            row = decode_row(m["model"], {"float32": fp, "int8": q8, "int4": q4}, ids, t)
            have[t].update(row)
            print(f"{m['model']}, {t} thread(s): decode int8 {row['decode_cpu_ms']['int8']:.1f}"
                  f" ms/token CPU ({row['decode_wall_ms']['int8']:.1f} wall), float32 "
                  f"{row['decode_cpu_ms']['float32']:.1f} "
                  f"({row['decode_wall_ms']['float32']:.1f}); llama.cpp {row['llama_cpp']}",
                  flush=True)
        del fp, q8, q4
    end = os.getloadavg()
    data.setdefault("decode_reruns", []).append(
        {"threads": list(threads), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
         "load_average_start": list(start), "load_average_end": list(end)})
    return data, markdown(data)


def markdown(data: dict) -> list[str]:
    ok = lambda c: "yes" if c else "NO"  # noqa: E731
    start, end = data["load_average_start"][0], data["load_average_end"][0]
    lines = ["## int8 (`quantize=\"int8\"`) on the shipped GGUF models", "",
             f"Load average {start:.1f} at the start, {end:.1f} at the end. Decode: ms per "
             f"new token after {CONTEXT} tokens, the minimum of {ROUNDS} rounds, CPU time "
             "(wall time in brackets); llama.cpp: measured in this run "
             + (f"after the same {data['llama_cpp_depth']} tokens (`llama-bench -d "
                f"{data['llama_cpp_depth']}`) " if data.get("llama_cpp_depth") else "")
             + "(in each round, the "
             "minimum) where a figure has (run), else the issue's figure on this host (1 "
             "thread), CPU time at 1 thread and wall time at 2 (its threads spin while they "
             "wait, so its CPU time at 2 says little), compared with ours of the same kind. "
             "The floor: bytes per token over the bandwidth of a float32 matrix-vector sweep "
             "in this run."
             + "".join(f" Decode rows at {', '.join(map(str, r['threads']))} thread(s) "
                       f"measured again alone on {r['date']} (load average "
                       f"{r['load_average_start'][0]:.1f} at the start, "
                       f"{r['load_average_end'][0]:.1f} at the end)."
                       for r in data.get("decode_reruns", [])), "",
             "| model | threads | int8 | float32 | int8 floor | llama.cpp | int8 / llama.cpp "
             "(goal ≤ 1.5) | prefill int8 / float32 (goal ≤ 1) |",
             "|---|---|---|---|---|---|---|---|"]
    for m in data["models"]:
        for r in m["threads"]:
            d, w, p = r["decode_cpu_ms"], r["decode_wall_ms"], r["prefill_cpu_s"]
            ref, issue = r["llama_cpp"], data["llama_cpp_issue_ms"][m["model"]]
            one = r["threads"] == 1  # CPU time at one thread; wall time at two (see llama_cpp)
            ours = d["int8"] if one else w["int8"]
            llama, where = ((ref["cpu_ms" if one else "wall_ms"], " (run)") if ref else
                            (issue, "") if one else (None, ""))
            goal = GOALS["decode_vs_llama_cpp"]
            ratio = "" if llama is None else (
                f"{ours / llama:.2f} {ok(ours / llama <= goal)}")
            lines.append(
                f"| {m['model']} | {r['threads']} | {d['int8']:.1f} ({w['int8']:.1f}) | "
                f"{d['float32']:.1f} ({w['float32']:.1f}) | {m['floor_ms']['int8']:.1f} | "
                f"{'' if llama is None else f'{llama:.1f}{where}'} | {ratio} | "
                f"{p['int8'] / p['float32']:.2f} {ok(p['int8'] <= p['float32'])} |")
    lines += ["", "| model | GGUF file | peak RSS growth, int8 (goal ≤ 2x file) | float32 | "
              "top-1 agreement (goal ≥ 95 %) | mean KL per prompt | max logit diff |",
              "|---|---|---|---|---|---|---|"]
    for m in data["models"]:
        size, a = m["gguf_bytes"], m["agreement"]
        rss = {k: v["peak_rss_growth_bytes"] for k, v in m["load"].items()}
        kls = ", ".join(f"{k} {v['mean_kl']:.4f}" for k, v in a["prompts"].items())
        top = ", ".join(f"{v['top1']:.0%}" for v in a["prompts"].values())
        lines.append(
            f"| {m['model']} | {size / 1e6:.0f} MB | {rss['int8'] / 1e6:.0f} MB "
            f"({rss['int8'] / size:.2f}x) {ok(rss['int8'] <= GOALS['rss_vs_file'] * size)} | "
            f"{rss['float32'] / 1e6:.0f} MB | {a['top1']:.1%} ({top}; {a['tokens']} tokens) "
            f"{ok(a['top1'] >= GOALS['agreement'])} | {kls} | "
            f"{max(v['max_logit_diff'] for v in a['prompts'].values()):.2f} |")
    lines += _int4_lines(data, ok)
    lines += ["", "Bytes per token and bandwidth: " + "; ".join(
        f"{m['model']} int8 {m['bytes_per_token']['int8'] / 1e6:.0f} MB, float32 "
        f"{m['bytes_per_token']['float32'] / 1e6:.0f} MB at {m['bandwidth_gb_per_s']:.1f} GB/s"
        for m in data["models"]) + ".", ""]
    return lines


def _int4_lines(data: dict, ok: Callable[[bool], str]) -> list[str]:
    """The ``quantize="int4"`` rows (4-bit layers where the file has 4-bit blocks, int8
    elsewhere: :mod:`handformer.models.int4`), measured in the same rounds."""
    models = [m for m in data["models"] if "agreement_int4" in m]
    if not models:
        return []
    goal = GOALS["decode_vs_llama_cpp"]
    lines = ["", "`quantize=\"int4\"` in the same rounds (4-bit layers where the file holds "
             "4-bit blocks, int8 elsewhere):", "",
             "| model | threads | int4 | int4 / llama.cpp (goal ≤ 1.5) | prefill int4 / "
             "float32 (goal ≤ 1) | peak RSS growth (goal ≤ 2x file) | top-1 agreement "
             "(goal ≥ 95 %) | mean KL per prompt |", "|---|---|---|---|---|---|---|---|"]
    for m in models:
        a, size = m["agreement_int4"], m["gguf_bytes"]
        rss = m["load"]["int4"]["peak_rss_growth_bytes"]
        kls = ", ".join(f"{k} {v['mean_kl']:.4f}" for k, v in a["prompts"].items())
        for r in m["threads"]:
            one = r["threads"] == 1
            ours = r["decode_cpu_ms" if one else "decode_wall_ms"]["int4"]
            ref = (r["llama_cpp"] or {}).get("cpu_ms" if one else "wall_ms")
            ratio = "" if not ref else f"{ours / ref:.2f} {ok(ours / ref <= goal)}"
            p = r["prefill_cpu_s"]
            lines.append(
                f"| {m['model']} | {r['threads']} | {r['decode_cpu_ms']['int4']:.1f} "
                f"({r['decode_wall_ms']['int4']:.1f}) | {ratio} | "
                f"{p['int4'] / p['float32']:.2f} {ok(p['int4'] <= p['float32'])} | "
                f"{rss / 1e6:.0f} MB ({rss / size:.2f}x) "
                f"{ok(rss <= GOALS['rss_vs_file'] * size)} | {a['top1']:.1%} "
                f"{ok(a['top1'] >= GOALS['agreement'])} | {kls} |")
    return lines


if __name__ == "__main__":
    print("\n".join(bench_int8()[1]))
