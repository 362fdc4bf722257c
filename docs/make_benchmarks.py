"""Write docs/benchmarks.md and its plots (docs/img/bench_*.png) from benchmarks/results/*.json.

    .venv/bin/python docs/make_benchmarks.py            # run by `make docs`, after `make bench`
    .venv/bin/python docs/make_benchmarks.py DIR        # read DIR/*.json instead

It only reads the recorded results; it measures nothing. A results file that is missing (or
written by an older version of its benchmark) gets a line saying so instead of a section, so the
report can always be regenerated.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_report import (  # noqa: E402
    RESULTS,
    ROOT,
    fmt_s,
    load,
    log_axes,
    machine_line,
    own_reports,
    reproduce,
)

DOCS = ROOT / "docs"
IMG = DOCS / "img"
STYLE = {  # colour, marker, label of each attention kind in the plots
    "full": ("#444444", "o", "torch fused attention (full)"),
    "local": ("#1f77b4", "s", "handformer local"),
    "strided": ("#2ca02c", "^", "handformer strided"),
    "linear": ("#d62728", "D", "handformer linear"),
    "linear_causal": ("#ff7f0e", "v", "handformer linear, causal"),
}


def new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, name: str) -> str:
    """Write ``docs/img/<name>`` atomically; return its link from docs/."""
    IMG.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=IMG, suffix=".png")
    os.close(fd)
    fig.savefig(tmp, format="png")
    os.replace(tmp, IMG / name)
    return f"img/{name}"


# ---- sections ------------------------------------------------------------------------------

def section_variants(data: dict) -> list[str]:
    head = data["headline"]
    L_main, t = head["L"], head["times_s"]
    times, memory = data["time_s"], data.get("peak_mib", {})
    lengths = sorted({int(L) for row in times.values() for L in row})
    out = [
        "## Attention variants: time and memory against sequence length", "",
        machine_line(data), "",
        f"One call, forward only, float32, B={data['B']}, H={data['H']}, D={data['D']}; local "
        f"window {data['window']}, stride {data['stride']}. Median of interleaved runs in one "
        "process. `full` is PyTorch's fused `F.scaled_dot_product_attention` with no mask.", "",
    ]
    fig = new_figure(7.5, 4.8)
    ax = fig.add_subplot(1, 1, 1)
    for kind, row in times.items():
        colour, marker, label = STYLE.get(kind, ("#888888", "x", kind))
        xs = sorted(int(L) for L in row)
        ax.plot(xs, [row[str(L)] for L in xs], marker=marker, color=colour, label=label)
    refs = [("fused_band", "fused attention, window as a bool mask", "#9467bd", "P"),
            ("fused_strided_mask", "fused attention, strided pattern as a mask", "#8c564b", "X"),
            ("flex", "FlexAttention, sliding window (compiled)", "#e377c2", "*")]
    for key, label, colour, marker in refs:
        if key in t:
            ax.plot([L_main], [t[key]], marker=marker, ms=11, ls="none", color=colour,
                    label=f"{label} (L={L_main})")
    log_axes(ax, lengths)
    ax.set_xlabel("sequence length L")
    ax.set_ylabel("seconds per call")
    ax.legend(fontsize=8)
    ax.set_title("Time per attention call against L")
    out += [f"![time against L]({save(fig, 'bench_variants_time.png')})", ""]
    if memory:
        fig = new_figure(7.5, 4.4)
        ax = fig.add_subplot(1, 1, 1)
        for kind, row in memory.items():
            colour, marker, label = STYLE.get(kind, ("#888888", "x", kind))
            xs = sorted(int(L) for L in row)
            ax.plot(xs, [row[str(L)] for L in xs], marker=marker, color=colour, label=label)
        log_axes(ax, lengths)
        ax.set_xlabel("sequence length L")
        ax.set_ylabel("MiB added by one call")
        ax.legend(fontsize=8)
        ax.set_title("Peak memory of one attention call against L")
        out += [f"![memory against L]({save(fig, 'bench_variants_memory.png')})", "",
                f"Memory: {data.get('memory_method', '')}, a fresh process per point. PyTorch's "
                "fused CPU kernel is flash-style, so its memory is linear in L too; its time "
                "is not.", ""]
    out += ["| seconds per call | " + " | ".join(str(L) for L in lengths) + " |",
            "|---|" + "---|" * len(lengths)]
    for kind, row in times.items():
        out.append(f"| {STYLE.get(kind, (0, 0, kind))[2]} | "
                   + " | ".join(f"{row[str(L)]:.4f}" if str(L) in row else "-"
                                for L in lengths) + " |")
    if memory:
        out += ["", "| MiB added by one call | " + " | ".join(str(L) for L in lengths) + " |",
                "|---|" + "---|" * len(lengths)]
        for kind, row in memory.items():
            out.append(f"| {STYLE.get(kind, (0, 0, kind))[2]} | "
                       + " | ".join(f"{row[str(L)]:.1f}" if str(L) in row else "-"
                                    for L in lengths) + " |")
    names = {
        "local_vs_fused_band": ("local", "fused attention with the window as a bool mask"),
        "local_vs_flex": ("local", "compiled FlexAttention, sliding-window block mask"),
        "strided_vs_fused_mask": ("strided", "fused attention with the strided pattern as a mask"),
        "linear_vs_fused": ("linear", "fused attention (no mask)"),
        "linear_causal_vs_fused_causal": ("linear, causal", "fused attention, `is_causal=True`"),
    }
    fastest = head.get("ratios_of_fastest")
    out += ["", f"Speed-ups at L={L_main} (reference time / handformer time, same process; "
            "medians" + (", and the same with each one's fastest run" if fastest else "") + "):",
            "", "| handformer | against | speed-up | target | met |"
            + (" speed-up, fastest runs |" if fastest else ""),
            "|---|---|---|---|---|" + ("---|" if fastest else "")]
    targets, verdicts = data.get("targets", {}), data.get("verdicts", {})
    for key, (ours, ref) in names.items():
        r = head["ratios"].get(key)
        row = (f"| {ours} | {ref} | {'-' if r is None else f'{r:.1f}x'} | "
               f">= {targets.get(key, '-')}x | {verdicts.get(key, '-')} |")
        if fastest:
            f = fastest.get(key)
            row += f" {'-' if f is None else f'{f:.1f}x'} |"
        out.append(row)
    if head.get("flex_compile_s") is not None:
        out += ["", f"FlexAttention's first call (compilation, block mask included) took "
                f"{head['flex_compile_s']:.1f} s; it is not part of its time above."]
    elif head.get("flex_error"):
        out += ["", f"FlexAttention was not measured: {head['flex_error']}"]
    if "memory_ratio" in verdicts:
        out += ["", f"Local attention, peak memory at 16384 / at 4096: {verdicts['memory_ratio']}."]
    diffs = head.get("max_abs_diff", {})
    if diffs:
        out += ["", "Largest difference between the outputs of a variant and its reference: "
                + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()) + "."]
    return out + ["", reproduce("bench_variants.py"), ""]


def section_core(data: dict) -> list[str]:
    c, res = data.get("config", {}), data["results"]
    out = ["## MultiHeadAttention and EncoderLayer against torch.nn", "", machine_line(data), "",
           f"B={c.get('B')}, L={c.get('L')}, d_model={c.get('E')}, heads={c.get('H')}, "
           f"d_ff={c.get('FF')}, float32; same weights (converted with `handformer.interop`). "
           "Ratio = handformer time / torch time (below 1: handformer is faster).", "",
           "| what | handformer | torch.nn | ratio | target |", "|---|---|---|---|---|"]
    for name, r in res.items():
        out.append(f"| {name} | {fmt_s(r['handformer'])} | {fmt_s(r['torch'])} | "
                   f"{r['ratio']:.2f} | <= {r.get('target', '-')} |")
    fig = new_figure(6.5, 2.6)
    ax = fig.add_subplot(1, 1, 1)
    names = list(res)
    ax.barh(names, [res[n]["ratio"] for n in names], color="#1f77b4")
    ax.axvline(1.0, color="#444444", lw=1, ls="--")
    ax.set_xlabel("handformer time / torch.nn time (lower is faster)")
    ax.set_title("handformer vs torch.nn (same weights)")
    for i, n in enumerate(names):
        ax.text(res[n]["ratio"], i, f" {res[n]['ratio']:.2f}", va="center", fontsize=9)
    ax.set_xlim(0, max(1.3, max(res[n]["ratio"] for n in names) * 1.2))
    out += ["", f"![ratios vs torch.nn]({save(fig, 'bench_core.png')})", ""]
    return out + [reproduce("bench_core.py"), ""]


def section_embed(data: dict) -> list[str]:
    s = data["throughput"]
    e2e, fwd = s["end_to_end_s"], s.get("forward_s", {})
    n = s["sentences"]
    out = ["## Sentence embeddings against transformers", "", machine_line(data), "",
           f"The bundled all-MiniLM-L6-v2 on {n} sentences ({s.get('tokens', '?')} tokens), "
           f"batches of {s.get('batch', '?')}; outputs agree within "
           f"{s.get('max_abs_diff', float('nan')):.1e}. Throughput ratio = handformer "
           "sentences/s over transformers sentences/s (above 1: handformer is faster).", "",
           "| what | handformer | transformers | throughput ratio |", "|---|---|---|---|"]
    rows = [("`embed()` end to end (tokenise, run, pool)", e2e.get("handformer"),
             e2e.get("transformers"), s.get("ratio_end_to_end"))]
    if "transformers_sorted" in e2e:
        rows.append(("... transformers given the inputs sorted by length", e2e.get("handformer"),
                     e2e["transformers_sorted"], s.get("ratio_end_to_end_sorted")))
    if fwd:
        rows.append(("model forward only", fwd.get("handformer"), fwd.get("transformers"),
                     s.get("ratio_forward")))
    for name, a, b, r in rows:
        out.append(f"| {name} | {n / a:.1f} sentences/s | {n / b:.1f} sentences/s | {r:.2f} |")
    fig = new_figure(7.5, 2.8)
    ax = fig.add_subplot(1, 1, 1)
    labels = [r[0].replace("`", "").replace("... transformers", "end to end, transformers")
              for r in rows]
    ys = range(len(rows))
    ax.barh([y + 0.2 for y in ys], [n / r[1] for r in rows], height=0.4, label="handformer",
            color="#1f77b4")
    ax.barh([y - 0.2 for y in ys], [n / r[2] for r in rows], height=0.4, label="transformers",
            color="#aaaaaa")
    ax.set_yticks(list(ys))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("sentences per second (higher is faster)")
    ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(1.01, 0.0))
    ax.set_title("all-MiniLM-L6-v2 embeddings")
    out += ["", f"![embedding throughput]({save(fig, 'bench_embed.png')})", ""]
    padded = data.get("padded_forward")
    if padded:
        faults = padded.get("minor_page_faults_per_forward", {})
        out += [f"`BertModel` forward under `torch.no_grad()` on {padded['batches']} padded "
                f"batches of {padded['batch']} sentences of 15-50 words: throughput ratio "
                f"{padded['ratio_median']:.2f} (median of {padded['rounds']} rounds; from "
                f"{padded['ratio_min']:.2f} to {padded['ratio_max']:.2f} on this shared "
                "machine). Minor page faults per forward: handformer "
                f"{faults.get('handformer', float('nan')):.0f}, transformers "
                f"{faults.get('transformers', float('nan')):.0f}."
                + (f" With the feed-forward activation out of place (as before the fix): "
                   f"{padded['ratio_out_of_place_median']:.2f}."
                   if "ratio_out_of_place_median" in padded else ""), ""]
    load_ = data.get("loading", {})
    if "handformer" in load_:
        h = load_["handformer"]
        mib = 1024 * 1024
        out += [f"Loading the bundled model: {h['seconds']:.2f} s, peak memory growth "
                f"{h['peak_growth_bytes'] / mib:.0f} MiB for a {load_['weights_bytes'] / mib:.0f} "
                f"MiB weights file ({h['growth_over_weights']:.2f}x)."
                + (f" transformers: {load_['transformers']['seconds']:.2f} s, "
                   f"{load_['transformers']['peak_growth_bytes'] / mib:.0f} MiB."
                   if "transformers" in load_ else ""), ""]
    return out + [reproduce("bench_embed.py"), ""]


def section_train(data: dict) -> list[str]:
    speed = data["throughput_tokens_per_s"]
    out = ["## Training", "", machine_line(data), ""]
    runs = data.get("time_to_99", [])
    if runs:
        out += ["Time to 99% exact match on 1000 held-out `reverse` strings (seconds of "
                "training, from the run's `metrics.jsonl`):", "",
                "| command | seconds to 99% | at step | final accuracy |", "|---|---|---|---|"]
        for r in runs:
            s99 = r.get("seconds_to_99")
            out.append(f"| `{r['command']}` | {'not reached' if s99 is None else f'{s99:.1f}'}"
                       f" | {r.get('step_at_99') or '-'} | {r.get('final_accuracy', 0):.1%} |")
        out.append("")
    ratio = data.get("throughput_ratio")
    out += ["Training throughput of a causal language model, handformer `CausalLM` against "
            "`torch.nn.TransformerEncoder` with a causal mask (AdamW and clipping included):", "",
            "| model | tokens/s |", "|---|---|",
            f"| handformer CausalLM | {speed['handformer']:,.0f} |",
            f"| torch.nn.TransformerEncoder | {speed['torch']:,.0f} |",
            f"| ratio | {ratio:.2f} |" if ratio is not None else "", ""]
    fig = new_figure(6.0, 2.2)
    ax = fig.add_subplot(1, 1, 1)
    ax.barh(["torch.nn", "handformer"], [speed["torch"], speed["handformer"]],
            color=["#aaaaaa", "#1f77b4"])
    ax.set_xlabel("training tokens per second (higher is faster)")
    ax.set_title("Causal LM training throughput")
    out += [f"![training throughput]({save(fig, 'bench_train.png')})", ""]
    return out + [reproduce("bench_train.py"), ""]


def section_decode(data: dict) -> list[str]:
    c, lat, gen = data.get("config", {}), data["latency"], data["generate"]
    out = ["## Decoding with a cache", "", machine_line(data), "",
           f"CausalLM with d_model={c.get('d_model')}, {c.get('num_heads')} heads, "
           f"{c.get('num_layers')} layers, vocabulary {c.get('vocab_size')}.", "",
           f"- Generating {gen['tokens']} tokens: {gen['cached']:.2f} s with the cache, "
           f"{gen['uncached']:.2f} s without ({gen['speedup']:.1f}x faster; target "
           f">= {gen.get('target', '-')}x).",
           "- Per-token latency with the cache, long context / short context: "
           f"{lat['ratio']:.2f} (target <= {lat.get('target', '-')}): "
           + ", ".join(f"{k} {fmt_s(v)}" for k, v in lat.items()
                       if k not in ("ratio", "target")) + ".", ""]
    rows = data.get("long_contexts", [])
    if rows:
        ctx = [r["context"] for r in rows]
        fig = new_figure(10, 3.8)
        a1, a2 = fig.subplots(1, 2)
        a1.plot(ctx, [r["full_ms"] for r in rows], "o-", color=STYLE["full"][0],
                label="full attention, KV cache")
        a1.plot(ctx, [r["linear_ms"] for r in rows], "D-", color=STYLE["linear"][0],
                label="linear attention, (S, z) state")
        a1.set_ylabel("ms per new token")
        a2.plot(ctx, [r["full_cache_kib"] for r in rows], "o-", color=STYLE["full"][0],
                label="full attention, KV cache")
        a2.plot(ctx, [r["linear_cache_kib"] for r in rows], "D-", color=STYLE["linear"][0],
                label="linear attention, (S, z) state")
        a2.set_ylabel("cache KiB")
        for ax in (a1, a2):
            log_axes(ax, ctx)
            ax.set_xlabel("tokens already in the context")
            ax.legend(fontsize=8)
        fig.suptitle("Decoding one token after a long context")
        out += [f"![decoding against context length]({save(fig, 'bench_decode.png')})", "",
                "| context | linear ms/token | linear cache KiB | full ms/token | full cache KiB |",
                "|---|---|---|---|---|"]
        out += [f"| {r['context']} | {r['linear_ms']:.2f} | {r['linear_cache_kib']:.0f} | "
                f"{r['full_ms']:.2f} | {r['full_cache_kib']:.0f} |" for r in rows]
        out.append("")
    out += _decode_vs_transformers(data.get("vs_transformers"))
    out += _memory_regime(data.get("memory_regime"))
    return out + [reproduce("bench_decode.py"), ""]


def _decode_vs_transformers(peer: dict | None) -> list[str]:
    """The comparison with transformers' GPT2LMHeadModel.generate (absent in old results)."""
    if not peer or not peer.get("rows"):
        return []
    compiled = "handformer_compiled_ms_per_token" in peer["rows"][0]
    modules = "handformer_modules_ms_per_token" in peer["rows"][0]  # plain_step=False

    def cell(r: dict, key: str) -> str:  # "wall (CPU)"
        cpu = r.get(key.replace("_ms", "_cpu_ms").replace("_ratio", "_cpu_ratio"))
        return f"{r[key]:.2f}" + (f" ({cpu:.2f})" if cpu is not None else "")

    out = ["### Against transformers' `GPT2LMHeadModel.generate`", "",
           f"The same random GPT-2 folder loaded by handformer and by transformers "
           f"{peer.get('transformers', '')}, greedy decoding with each one's KV cache, "
           "identical tokens asserted; ms per new token (prefill subtracted), wall-clock "
           "median with this process's CPU time in brackets. Target: handformer / "
           f"transformers ≤ {peer.get('target', 0.5)}.", "",
           "handformer is `generate`'s default (each new token through the plain-function "
           "step); `plain_step=False` runs every step through the modules.", "",
           "| context | handformer | " + ("`plain_step=False` | " if modules else "")
           + ("handformer `compile=True` | " if compiled else "")
           + "transformers | weights' matrix-vector products alone | handformer / transformers"
           + (" | compiled / transformers" if compiled else "") + " |",
           "|---|---|---|---|---|" + ("---|" if modules else "")
           + ("---|---|" if compiled else "")]
    for r in peer["rows"]:
        out.append(f"| {r['context']} | {cell(r, 'handformer_ms_per_token')} | "
                   + (f"{cell(r, 'handformer_modules_ms_per_token')} | " if modules else "")
                   + (f"{cell(r, 'handformer_compiled_ms_per_token')} | " if compiled else "")
                   + f"{cell(r, 'transformers_ms_per_token')} | "
                   + (f"{cell(r, 'matmuls_only_ms_per_token')} | "
                      if "matmuls_only_ms_per_token" in r else "– | ")
                   + cell(r, "handformer_ratio")
                   + (f" | {cell(r, 'handformer_compiled_ratio')}" if compiled else "") + " |")
    first = peer.get("compile_s")
    if isinstance(first, dict) and first:
        out += ["", "`compile=True`: the first call, which compiles (Inductor, cold cache), took "
                + ", ".join(f"{v:.0f} s (context {k})" for k, v in first.items()) + "."]
    return out + [""]


def _memory_regime(rows: list[dict] | None) -> list[str]:
    """How fast the machine streamed weights by working-set size (absent in old results)."""
    if not rows:
        return []
    return ["How fast this machine streamed float32 weights through matrix-vector products "
            "(one thread), by working-set size: "
            + ", ".join(f"{r['megabytes']} MB at {r['gb_per_s']:.1f} GB/s" for r in rows)
            + ". Weights that do not fit in the caches stream at memory speed, which sets "
            "the floor of a decoding step for every library.", ""]


def section_viz(data: dict) -> list[str]:
    cold, html = data.get("cold_start", {}), data.get("viewer_512", {})
    out = ["## Visualisation", "", machine_line(data), ""]
    if cold:
        out.append(f"- `handformer viz` on the seed's sentence from a cold start (new process: "
                   f"import, load the bundled model, run it, two PNGs and the HTML viewer): "
                   f"{cold['viz_s']:.1f} s wall, {cold.get('viz_cpu_s', float('nan')):.1f} s "
                   f"CPU; a process that only runs `import torch, handformer` takes "
                   f"{cold['import_s']:.1f} s wall, {cold.get('import_cpu_s', float('nan')):.1f}"
                   " s CPU.")
        if "within_target" in cold:
            out[-1] += f" Target: at most 5 s ({'met' if cold['within_target'] else 'missed'})."
    if html.get("tokens"):
        out.append(f"- The HTML viewer for {html['tokens']} tokens: {html['html_mb']:.1f} MB, "
                   f"written in {html['write_s']:.2f} s.")
    return out + ["", reproduce("bench_viz.py"), ""]


def section_serve(data: dict) -> list[str]:
    short, long, rps = data["run_15"], data["run_512"], data["requests_per_s"]
    met = {True: "met", False: "missed"}
    return ["## Live web app (`handformer serve`)", "", machine_line(data), "",
            f"- `/api/run` on 15 tokens (server in its own process, httpx over 127.0.0.1): "
            f"p50 {short['http_p50_ms']:.1f} ms, p95 {short['http_p95_ms']:.1f} ms; the direct "
            f"call `model(**tokenizer([text]), need_weights=True)` p50 "
            f"{short['direct_p50_ms']:.1f} ms. Target p50 <= 1.5 x direct + 10 ms = "
            f"{short['budget_ms']:.1f} ms ({met[short['within_target']]}).",
            f"- {rps['clients_8']:.1f} requests/s with 8 concurrent clients "
            f"({rps['clients_1']:.1f} with one).",
            f"- 512 tokens: {long['http_s']:.2f} s against {long['direct_s']:.2f} s direct, "
            f"{long['ratio']:.2f}x (target <= 2x, {met[long['within_target']]})"
            + (f", with `?weights=binary` (the page's request: the 18.9 MB of 8-bit weights as "
               f"raw bytes after a JSON header); the default JSON answer (weights as base64) "
               f"takes {long['json_http_s']:.2f} s, {long['json_ratio']:.2f}x."
               if long.get("format") == "binary" else "."),
            *_serve_llm(data.get("run_512_llm"), met),
            "", reproduce("bench_serve.py"), ""]


def _serve_llm(llm: dict | None, met: dict) -> list[str]:
    """The LLM line of the serve section (absent in results recorded before it existed)."""
    if not llm:
        return []
    if "skipped" in llm:
        return [f"- A language model: skipped ({llm['skipped']})."]
    return [f"- {llm['model']} ({llm['layers']} layers x {llm['heads']} heads), 512 tokens: "
            f"{llm['http_s']:.2f} s against {llm['direct_s']:.2f} s for the direct forward "
            f"with weights plus the viewer's export, {llm['ratio']:.2f}x (target <= 1.5x, "
            f"{met[llm['within_target']]}). Switching the page to "
            f"{llm['switch'].get('model', 'a second model')}: the first request loads it "
            f"({llm['switch']['first_s']:.2f} s), the next takes "
            f"{llm['switch']['again_s']:.3f} s (no reload)."]


def section_inspect(data: dict) -> list[str]:
    """``bench_inspect.py`` writes one entry per part, each with its own markdown lines."""
    out = ["## Looking inside (`handformer.inspect`)", ""]
    for part in data["parts"].values():
        out += [machine_line(part), "", *part["markdown"]]
    return out + [reproduce("bench_inspect.py"), ""]


def section_gguf(data: dict) -> list[str]:
    out = ["## Loading GGUF files (the shipped models)", "", machine_line(data), "",
           "Each load in a fresh process: the call's time and its peak RSS growth over the RSS "
           "before it. Targets: at least 3x faster than transformers' "
           "`AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)`, growth at most "
           "1.5x the float32 model's bytes.", "",
           "| model | handformer call | handformer s | transformers s | speed-up | growth / "
           "float32 (handformer) | growth / float32 (transformers) | header (`read_gguf`) s |",
           "|---|---|---|---|---|---|---|---|"]
    for name, r in data["models"].items():
        ours, theirs = r["handformer"], r.get("transformers")
        out.append(f"| {name} | `{ours['api']}` | {ours['seconds']:.2f} | "
                   + (f"{theirs['seconds']:.1f} | {r['speedup']:.1f}x | " if theirs
                      else "- | - | ")
                   + f"{ours['growth_over_float32']:.2f} | "
                   + (f"{theirs['growth_over_float32']:.2f}" if theirs else "-")
                   + f" | {r['read_gguf_s']:.3f} |")
    return out + ["", reproduce("bench_gguf.py"), ""]


def section_llm_inspect(data: dict) -> list[str]:
    """``bench_llm_inspect.py``: attribution, attribution patching, idle hook points."""
    r, t, med = data["ratios"], data["targets"], data["median_s"]
    ok = {k: "met" if r[k] <= t[k] else "missed" for k in r}
    heads = data["layers"] * data["heads"]
    out = ["## Inside a causal LM (attribution, attribution patching)", "", machine_line(data),
           "", f"{data['model']}, {data['tokens']} tokens.", "",
           f"- Direct logit attribution of every head and component at every position: "
           f"{r['attribution_vs_cache']:.2f}x one `run_with_cache` forward "
           f"(target <= {t['attribution_vs_cache']}x, {ok['attribution_vs_cache']}).",
           f"- `attribution_patching` over all {heads} heads: "
           f"{r['attr_patching_vs_forward']:.2f}x one forward (target <= "
           f"{t['attr_patching_vs_forward']}x, {ok['attr_patching_vs_forward']}); exact "
           f"`patching_sweep` of the same heads {data['patching_sweep_s']:.1f} s against "
           f"{fmt_s(med['attr_patching'])}; Pearson r between them "
           f"{data['attr_vs_exact_pearson_r']:.3f} (one random token changed).",
           f"- Forward with idle hook points (`hook_result`, `hook_scale`): "
           f"{r['no_hooks_vs_stripped']:.3f}x the forward with them stripped (target <= "
           f"{t['no_hooks_vs_stripped']}x, {ok['no_hooks_vs_stripped']})."]
    ioi = data.get("ioi") or {}
    if "pearson_r" in ioi:
        out.append(f"- IOI pair: clean logit difference {ioi['clean_logit_diff']:.2f}; "
                   f"attribution patching vs exact per-head patching r = "
                   f"{ioi['pearson_r']:.3f}.")
    return out + ["", reproduce("bench_llm_inspect.py"), ""]


def section_sinks(data: dict) -> list[str]:
    """``bench_sinks.py``: perplexity with full attention, a window, the window + sinks."""
    ppl, past = data["perplexity"], data["perplexity_past_window"]
    rows = [f"| {k} | {ppl[k]:.2f} | {past[k]:.2f} |" for k in ppl]
    fig = new_figure(6.0, 3.0)
    ax = fig.add_subplot()
    for label, values in data["curves"].items():
        ax.plot(data["curve_positions"], values, label=label, lw=1.2)
    ax.axvline(data["window"] // 2 + 1, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("position in the text")
    ax.set_ylabel("next-token loss (rolling mean of 64)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    link = save(fig, "bench_sinks.png")
    return ["## Attention sinks (StreamingLLM)", "", machine_line(data), "",
            f"{data['model']}, {data['tokens']} tokens of the English tutorial; every layer's "
            f"attention swapped for the kind in the row.", "",
            f"| attention | perplexity | perplexity after token {data['window']} |",
            "|---|---|---|", *rows, "", f"![next-token loss by position]({link})", "",
            reproduce("bench_sinks.py"), ""]


def section_llm(data: dict) -> list[str]:
    """``bench_llm.py``: a SmolLM2-135M-shaped Llama against transformers."""
    ok = {True: "met", False: "missed"}
    load = data.get("load_average_start", [float("nan")])[0]
    out = ["## A SmolLM2-135M-shaped Llama against transformers", "", machine_line(data), "",
           f"Random weights in SmolLM2-135M's shape saved as a Llama folder, loaded by "
           f"`load_lm` and by transformers {data['transformers']} (sdpa); float32, batch 1. "
           f"The floor is one step's matrix-vector products plus one fused attention per "
           f"layer over the cache, measured in the same run. Decoding is timed by a streamer "
           f"from the first new token to the last (the prefill excluded), medians of "
           f"interleaved rounds. Load average at the start: {load:.1f}.", "",
           "| threads | measurement | handformer | transformers | floor | ratio | target |",
           "|---|---|---|---|---|---|---|"]
    for r in data["threads"]:
        f = r["forward_ms"]
        out.append(f"| {r['threads']} | forward {r['forward_tokens']} tokens, ms | "
                   f"{f['handformer']:.0f} | {f['transformers']:.0f} | | "
                   f"{r['forward_ratio']:.2f} | ≤ 1.0 ({ok[r['forward_ratio'] <= 1.0]}) |")
        for d in r["decode"]:
            ms = d["ms_per_token"]
            out.append(f"| {r['threads']} | decode after {d['context']}, ms/token | "
                       f"{ms['handformer']:.1f} | {ms['transformers']:.1f} | {ms['floor']:.1f} "
                       f"| {d['ratio_vs_transformers']:.2f} (floor {d['ratio_vs_floor']:.2f}) "
                       f"| ≤ 0.9 ({ok[d['ratio_vs_transformers'] <= 0.9]}), floor ≤ 1.3 "
                       f"({ok[d['ratio_vs_floor'] <= 1.3]}) |")
    kv, mem = data["kv_cache"], data.get("load_memory")
    out += ["", f"- KV cache at {kv['context']} tokens: {kv['ratio_vs_mha']:.3f} of a "
                f"multi-head cache (num_kv_heads / num_heads = {kv['expected_ratio']:.3f}); a "
                f"sliding layer (window {kv['sliding_window']}) holds "
                f"{kv['sliding_layer_tokens']} tokens.",
            f"- Weights streamed in the floor: {data['streaming']['floor_gb_per_s']:.1f} GB/s."]
    if mem:
        out.append(f"- `load_lm` in a fresh process: {mem['seconds']:.1f} s, peak RSS growth "
                   f"{mem['growth_over_model']:.2f}x the model's "
                   f"{mem['model_bytes'] / 1e6:.0f} MB.")
    out += _int8_lines(data.get("int8"), ok)
    return out + ["", reproduce("bench_llm.py"), ""]


def _int8_lines(int8: dict | None, ok: dict) -> list[str]:
    """Section 6 of ``bench_llm.py`` (``llm_int8.py``): int8 decoding against llama.cpp."""
    if not int8:
        return []
    goal = int8["goals"]["decode_vs_llama_cpp"]
    out = []
    for m in int8["models"]:
        for r in m["threads"]:
            one = r["threads"] == 1  # CPU time at one thread, wall time at two (llm_int8.py)
            ours = r["decode_cpu_ms" if one else "decode_wall_ms"]["int8"]
            ref = (r["llama_cpp"] or {}).get("cpu_ms" if one else "wall_ms")
            vs = (f" against llama.cpp's {ref:.1f}, {ours / ref:.2f}x (goal ≤ {goal}, "
                  f"{ok[ours / ref <= goal]})" if ref else "")
            out.append(f"- int8 (`quantize=\"int8\"`), {m['model']}, {r['threads']} "
                       f"thread(s): {ours:.1f} ms/token {'CPU' if one else 'wall'}{vs}; "
                       f"float32 {r['decode_cpu_ms' if one else 'decode_wall_ms']['float32']:.1f}.")
            four = r["decode_cpu_ms" if one else "decode_wall_ms"].get("int4")
            if four is not None:
                vs4 = (f" against llama.cpp's {ref:.1f}, {four / ref:.2f}x (goal ≤ {goal}, "
                       f"{ok[four / ref <= goal]})" if ref else "")
                out.append(f"- int4 (`quantize=\"int4\"`), {m['model']}, {r['threads']} "
                           f"thread(s): {four:.1f} ms/token {'CPU' if one else 'wall'}{vs4}.")
    return out + ["  (`results/llm.md`, section int8, has the load averages, prefill, memory "
                  "and agreement of both.)"]


SECTIONS: list[tuple[str, str, Callable[[dict], list[str]]]] = [
    ("variants", "bench_variants.py", section_variants),
    ("core", "bench_core.py", section_core),
    ("embed", "bench_embed.py", section_embed),
    ("train", "bench_train.py", section_train),
    ("decode", "bench_decode.py", section_decode),
    ("llm", "bench_llm.py", section_llm),
    ("viz", "bench_viz.py", section_viz),
    ("serve", "bench_serve.py", section_serve),
    ("inspect", "bench_inspect.py", section_inspect),
    ("gguf", "bench_gguf.py", section_gguf),
    ("llm_inspect", "bench_llm_inspect.py", section_llm_inspect),
    ("sinks", "bench_sinks.py", section_sinks),
]


def main(args: list[str]) -> int:
    results = Path(args[0]) if args else RESULTS
    lines = ["# handformer benchmarks", "",
             "Generated by `docs/make_benchmarks.py` (`make docs`) from the results that "
             "`make bench` records in [benchmarks/results/](../benchmarks/results/). Every "
             "ratio compares handformer with its reference measured in the same process, calls "
             "interleaved round by round, median of the rounds. Each section names its machine "
             "and date; on a small CPU machine shared with other jobs, absolute times are noisy "
             "and the ratios, measured side by side, much less so. The tutorial explains what "
             "is measured: "
             "[English](tutorial.en.md#7-local-strided-and-linear-attention), "
             "[中文](tutorial.zh.md#7-局部注意力跨步注意力与线性注意力).", ""]
    missing = []
    for name, script, section in SECTIONS:
        data = load(name, results)
        if data is None:
            missing.append(f"- `{name}`: no `benchmarks/results/{name}.json` yet "
                           f"(`.venv/bin/python benchmarks/{script}`).")
            continue
        try:
            lines += section(data)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            missing.append(f"- `{name}`: `benchmarks/results/{name}.json` has an unexpected "
                           f"layout ({type(exc).__name__}: {exc}); rerun "
                           f"`.venv/bin/python benchmarks/{script}`.")
    lines += own_reports(results, {name for name, _, _ in SECTIONS})
    if missing:
        lines += ["## Not in this report", "", *missing, ""]
    text = "\n".join(lines)
    fd, tmp = tempfile.mkstemp(dir=DOCS, suffix=".md")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, DOCS / "benchmarks.md")
    print(f"wrote {DOCS / 'benchmarks.md'}" + (f" ({len(missing)} missing)" if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
