"""Draw the tutorial's pictures from the library itself into docs/img/ (run by `make docs`).

    .venv/bin/python docs/make_figures.py            # every picture (about a minute on 2 cores)
    .venv/bin/python docs/make_figures.py patterns   # only the ones whose name contains it

Every picture the two tutorials share is drawn twice from the same data: ``<name>.png`` with the
English titles of ``TEXT["en"]`` and ``<name>_zh.png`` with the Chinese ones of ``TEXT["zh"]``
(the Chinese tutorial embeds those). Only the titles and labels written here change; the
library's own axis labels (``plot_attention``'s "Key (attended to)", ...) stay English.

Nothing here is drawn by hand: the attention maps come from the bundled all-MiniLM-L6-v2, from
the shipped Gemma 3 270M (the Chinese tutorial's chapter 5, Chinese titles) and from a model
trained here on ``reverse``; chapter 13's attribution graph from the tutorial's own code (its
blocks run here); the patterns come from the attention kinds; the
"seed, as written" panels run the arithmetic of the seed tutorial's section 7 masks. The cost
curves of chapter 7 are drawn by docs/make_benchmarks.py from benchmarks/results/.

Shape letters: ``L`` length, ``D`` head dim, ``H`` heads.
"""

from __future__ import annotations

import math
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import matplotlib
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

import handformer as hf
from handformer.viz import plot_attention, plot_heads, save_figure
from handformer.viz.fonts import font_families

IMG = Path(__file__).resolve().parent / "img"
SENTENCE = "The animal didn't cross the street because it was too tired"
ZH_SENTENCE = "动物没有过马路，因为它太累了"  # the Chinese tutorial's, on Gemma 3
PATTERN_CMAP = ListedColormap(["#eeeeee", "#3b4a6b"])  # blocked, allowed

# The text this script writes into the shared pictures, per language; ``{...}`` fields are
# filled by :func:`say`. The Chinese follows the words of tutorial.zh.md.
TEXT = {
    "en": {
        "seed_attention": "all-MiniLM-L6-v2, layer 3, head 1: 'it' -> 'animal'",
        "seed_heads": "all-MiniLM-L6-v2 on the seed's sentence: 6 layers x 12 heads",
        "key": "key",
        "query": "query",
        "seed_variant": "seed {name}",
        "weight_range": "weights in [{low:.2f}, {high:.2f}]",
        "negative": ", {share:.0%} negative\n(colours clipped to [-1, 1])",
        "seed_variants": "Top: the seed's section 7 code as written (16 random queries and "
                         "keys). Bottom: handformer on the same inputs.",
        "pattern_share": "{name}\n{share:.0%} of the {L}x{L} pairs",
        "pattern_weights": "weights (need_weights=True)",
        "patterns": "Attention patterns at L={L}: allowed keys (dark) and the weights each "
                    "kind returns on random inputs",
        "reverse_step": "step {step}: {share:.0%} on the mirror",
        "reverse_training": "Training on reverse: head {head} of the 1-layer model on {text!r} "
                            "(queries are rows)",
        "to_animal": "attention weight",
        "to_animal_title": 'attention from "it" to "animal" (read from the cache)',
        "restored": "change of leans_to_animal",
        "restored_title": 'patching each head of the "tired" run into the "wide" run',
        "inside_rollout": "all-MiniLM-L6-v2: where the final 'it' comes from "
                          "(raw = layer 5, head 11)",
        "paris_graph": "SmolLM2, 'The capital of France is': {nodes} nodes and {edges} edges "
                       "kept\n(replacement score {replacement:.2f}, completeness {complete:.2f})",
    },
    "zh": {
        "seed_attention": "all-MiniLM-L6-v2 第 3 层第 1 个头：“it” 看向 “animal”",
        "seed_heads": "all-MiniLM-L6-v2 在原教程的句子上：6 层 × 12 个头",
        "key": "键",
        "query": "查询",
        "seed_variant": "原教程的 {name}",
        "weight_range": "权重范围 [{low:.2f}, {high:.2f}]",
        "negative": "，{share:.0%} 为负\n（颜色截断到 [-1, 1]）",
        "seed_variants": "上排：原教程第 7 节的代码原样运行（16 个随机的查询和键）。"
                         "下排：handformer 在同样输入上的结果。",
        "pattern_share": "{name}\n{L}×{L} 个位置对中能看到 {share:.0%}",
        "pattern_weights": "权重（need_weights=True）",
        "patterns": "L={L} 时的注意力模式：能看到的键（深色），以及每种注意力在随机输入上"
                    "返回的权重",
        "reverse_step": "第 {step} 步：{share:.0%} 落在镜像上",
        "reverse_training": "在 reverse 任务上训练：单层模型的第 {head} 个头，输入 {text!r}"
                            "（每一行是一个查询）",
        "to_animal": "注意力权重",
        "to_animal_title": "“it” 对 “animal” 的注意力（从缓存中读出）",
        "restored": "leans_to_animal 的变化",
        "restored_title": "把 tired 运行的每个头逐一修补进 wide 运行",
        "inside_rollout": "all-MiniLM-L6-v2：最终的 “it” 从哪里来（raw = 第 5 层第 11 个头）",
        "paris_graph": "SmolLM2 上的 “The capital of France is”：剪枝后留下 {nodes} 个节点、"
                       "{edges} 条边\n（替换分数 {replacement:.2f}，完整性分数 {complete:.2f}）",
    },
}


# What handformer's own plot functions write (axis labels, panel titles, colour bars, legends),
# in the Chinese pictures: :func:`save` puts these in place of the English after drawing.
LIBRARY_ZH = {
    "Key (attended to)": "键（被关注的词元）",
    "Query (attending)": "查询（发出关注的词元）",
    "head": "头",
    "layer": "层",
    "attention weight": "注意力权重",
    "input token": "输入词元",
    "output position (after the last layer)": "输出位置（最后一层之后）",
    "Attention rollout": "注意力展开",
    "share of the input token": "取自该输入词元的份额",
    "score, each method scaled to its maximum": "得分（每种方法按各自的最大值缩放）",
    "raw attention": "原始注意力",
    "rollout": "注意力展开",
    "flow": "注意力流",
}
LIBRARY_ZH_PATTERNS = [  # texts with a value in them
    (re.compile(r"Output position (\d+) \((.*)\): where it comes from"),
     r"输出位置 \1（\2）从哪里来"),
    (re.compile(r"Keys each query may reach: (\d+) of (\d+) pairs(.*)"),
     r"每个查询能看到的键：\2 对中的 \1 对\3"),
]


def _in_chinese(text: str) -> str:
    """``text`` as the Chinese pictures show it: translated if it is one of handformer's."""
    if text in LIBRARY_ZH:
        return LIBRARY_ZH[text]
    for pattern, replacement in LIBRARY_ZH_PATTERNS:
        if pattern.fullmatch(text):
            return pattern.sub(replacement, text)
    return text


def in_chinese(fig: Figure, name: str) -> Figure:
    """Put Chinese in place of the English that handformer's plot functions wrote into ``fig``
    (every axis's labels and title, the legends); return ``fig``.

    Raises:
        ValueError: if a label or title is left without a Chinese character (``name`` says
            which picture).
    """
    for ax in fig.axes:
        for get, put in ((ax.get_xlabel, ax.set_xlabel), (ax.get_ylabel, ax.set_ylabel),
                         (ax.get_title, ax.set_title)):
            put(_in_chinese(get()))
        legend = ax.get_legend()
        legend_texts = legend.get_texts() if legend is not None else []
        for text in legend_texts:
            text.set_text(_in_chinese(text.get_text()))
        texts = [ax.get_xlabel(), ax.get_ylabel(), ax.get_title()]
        english = [t for t in texts + [t.get_text() for t in legend_texts]
                   if t and not re.search(r"[\u4e00-\u9fff]", t)]
        if english:
            raise ValueError(f"{name}: no Chinese for {english}; add them to LIBRARY_ZH")
    return fig


def save(fig: Figure, name: str, lang: str) -> None:
    """Save ``fig`` as the picture ``name`` in ``lang`` (:func:`in_chinese` first for "zh")."""
    save_figure(in_chinese(fig, name) if lang == "zh" else fig, image(name, lang))


def say(lang: str, key: str, **fields: object) -> str:
    """The text ``key`` in ``lang`` ("en" or "zh"), its fields filled in."""
    return TEXT[lang][key].format(**fields)


def image(name: str, lang: str) -> Path:
    """Where the picture ``name`` in ``lang`` goes: ``<name>.png`` in English,
    ``<name>_<lang>.png`` otherwise."""
    return IMG / (f"{name}.png" if lang == "en" else f"{name}_{lang}.png")


def new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def bert_attention() -> tuple[tuple[torch.Tensor, ...], list[str]]:
    from handformer.pretrained import load_bert

    model, tokenizer = load_bert()
    with torch.no_grad():
        out = model(**tokenizer([SENTENCE]), need_weights=True)
    return out.attentions, tokenizer.tokens(SENTENCE)


def seed_attention() -> None:
    """Chapter 5: one head of the pretrained model on the seed's sentence, and every head."""
    attentions, tokens = bert_attention()
    for lang in TEXT:
        fig = plot_attention(attentions[3][0, 1], tokens, title=say(lang, "seed_attention"))
        save(fig, "seed_attention", lang)
        fig = plot_heads(attentions, tokens, title=say(lang, "seed_heads"))
        save(fig, "seed_heads", lang)


def zh_gemma() -> None:
    """Chapter 5 of the Chinese tutorial: Gemma 3 270M on the Chinese sentence, one head and
    every head, with the tutorial's (Chinese) titles."""
    from handformer import inspect as hi
    from handformer.pretrained import load_lm

    gemma, tokenizer = load_lm("gemma3-270m")
    tokens = hi.to_str_tokens(tokenizer, ZH_SENTENCE)
    with torch.no_grad():
        attentions = gemma(hi.to_tokens(tokenizer, ZH_SENTENCE), need_weights=True).attentions
    fig = plot_attention(attentions[9][0, 2], tokens,
                         title="Gemma 3 270M 第 9 层第 2 个头：“因为它”看向“动物”")
    save_figure(in_chinese(fig, "zh_gemma_head"), IMG / "zh_gemma_head.png")
    fig = plot_heads(attentions, tokens, title="Gemma 3 270M：18 层 × 4 个头")
    save_figure(in_chinese(fig, "zh_gemma_heads"), IMG / "zh_gemma_heads.png")


# ---- chapter 7: what the seed's variants compute, and handformer's patterns ----------------

def _softmax_with_bias(scores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores + bias, dim=-1)


def seed_local_bias(L: int, window_size: int) -> torch.Tensor:
    """The bias the seed's local_attention ends up adding: its mask (1 inside the window,
    -1e9 outside), multiplied by -1e9 inside its scaled_dot_product_attention."""
    mask = torch.ones(L, L, dtype=torch.float64)
    for i in range(L):
        mask[i, :max(0, i - window_size // 2)] = -1e9
        mask[i, min(L, i + window_size // 2 + 1):] = -1e9
    return mask * -1e9


def seed_sparse_bias(L: int, stride: int) -> torch.Tensor:
    """The bias of the seed's sparse_attention: rows 0, stride, ... marked 1, turned into
    (1 - mask) * -1e9, then multiplied by -1e9 again."""
    mask = torch.zeros(L, L, dtype=torch.float64)
    mask[::stride, :] = 1
    return ((1.0 - mask) * -1e9) * -1e9


def seed_variants() -> None:
    """Top: the weights the seed's three variants produce. Bottom: handformer's."""
    L, D = 16, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(L, D, generator=g, dtype=torch.float64) for _ in range(3))
    scores = q @ k.T / math.sqrt(D)  # (L, L)
    seed_linear = (q @ k.T) / ((q @ k.sum(0))[:, None] + 1e-6)  # (L, L) raw features
    top = [
        ("local_attention(w=3)", _softmax_with_bias(scores, seed_local_bias(L, 3))),
        ("sparse_attention(stride=2)", _softmax_with_bias(scores, seed_sparse_bias(L, 2))),
        ("linear_attention", seed_linear),
    ]
    bottom = [
        ("hf.local_attention(w=3)",
         hf.local_attention(q, k, v, window_size=3, need_weights=True)[1]),
        ("hf.strided_attention(stride=4)",
         hf.strided_attention(q, k, v, stride=4, need_weights=True)[1]),
        ("hf.linear_attention", hf.linear_attention(q, k, v, need_weights=True)[1]),
    ]
    for lang in TEXT:
        fig = new_figure(11.5, 7.6)
        axes = fig.subplots(2, 3)
        for ax, (name, w) in zip(axes[0], top, strict=True):
            w = w.numpy()
            signed = w.min() < 0
            note = say(lang, "weight_range", low=w.min(), high=w.max())
            if signed:  # a distribution stays in [0, 1]: clip the colours there, say the range
                note += say(lang, "negative", share=(w < 0).mean())
            im = ax.imshow(w, cmap="RdBu_r" if signed else "viridis", vmin=-1 if signed else 0,
                           vmax=1 if signed else float(w.max()), interpolation="nearest")
            ax.set_title(f"{say(lang, 'seed_variant', name=name)}\n{note}", fontsize=10)
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
        for ax, (name, w) in zip(axes[1], bottom, strict=True):
            im = ax.imshow(w.numpy(), cmap="viridis", vmin=0, interpolation="nearest")
            note = say(lang, "weight_range", low=float(w.min()), high=float(w.max()))
            ax.set_title(f"{name}\n{note}", fontsize=10)
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
        for ax in axes.flat:
            ax.set_xlabel(say(lang, "key"), fontsize=9)
            ax.set_ylabel(say(lang, "query"), fontsize=9)
            ax.tick_params(labelsize=7)
        fig.suptitle(say(lang, "seed_variants"), fontsize=11)
        save(fig, "seed_variants", lang)


def patterns() -> None:
    """The keys each query may reach (top) and the weights on random inputs (bottom)."""
    L, D = 32, 16
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, L, D, generator=g) for _ in range(3))
    kinds = [
        ("LocalAttention(9)", hf.LocalAttention(9), False),
        ("LocalAttention(9), causal", hf.LocalAttention(9), True),
        ("StridedAttention(6, global_tokens=1)", hf.StridedAttention(6, global_tokens=1), False),
        ("StridedAttention(6), causal", hf.StridedAttention(6), True),
        ("LinearAttention(), causal", hf.LinearAttention(), True),
    ]
    panels = []  # (name, allowed (L, L), weights (L, L)) per kind
    for name, kind, causal in kinds:
        allowed = kind.pattern(L, L, causal=causal)
        allowed = torch.ones(L, L, dtype=torch.bool) if allowed is None else allowed
        _, w = kind(q, k, v, causal=causal, need_weights=True)
        panels.append((name, allowed, w[0]))
    for lang in TEXT:
        fig = new_figure(16, 7.2)
        axes = fig.subplots(2, len(kinds))
        for col, (name, allowed, w) in enumerate(panels):
            axes[0, col].imshow(allowed.numpy(), cmap=PATTERN_CMAP, vmin=0, vmax=1,
                                interpolation="nearest")
            share = allowed.float().mean().item()
            axes[0, col].set_title(say(lang, "pattern_share", name=name, share=share, L=L),
                                   fontsize=10)
            axes[1, col].imshow(w.numpy(), cmap="viridis", vmin=0, interpolation="nearest")
            axes[1, col].set_title(say(lang, "pattern_weights"), fontsize=10)
            for row in range(2):
                axes[row, col].tick_params(labelsize=7)
                axes[row, col].set_xlabel(say(lang, "key"), fontsize=9)
            axes[0, col].set_ylabel(say(lang, "query"), fontsize=9)
        fig.suptitle(say(lang, "patterns", L=L), fontsize=12)
        save(fig, "patterns", lang)


# ---- chapter 8: the reverse task -----------------------------------------------------------

def reverse_config():  # noqa: ANN201 - TrainConfig, imported lazily
    """The tutorial's tiny run (chapter 8 trains exactly this)."""
    from handformer.train import TrainConfig

    return TrainConfig(task="reverse", length=6, num_symbols=8, num_layers=1, d_model=32,
                       num_heads=2, d_ff=64, steps=100, batch_size=32, lr=1e-2, warmup=20,
                       eval_every=50, eval_size=200, log_every=10, ckpt_every=50, threads=1,
                       progress=False)


def mirror_share(model: hf.CausalLM, task) -> torch.Tensor:  # noqa: ANN001
    """Per head ``(H,)``: the mean weight the target queries put on the mirrored key."""
    x = torch.cat([b.input_ids for b in task.eval_batches(200)])[:200]  # (B, L)
    keys = task.mirrored_keys()  # (L,), -1 = no mirrored key
    rows = (keys >= 0).nonzero().squeeze(1)  # the target positions
    with torch.no_grad():
        w = model(x, need_weights=True).attentions[0]  # (B, H, L, L)
    return w[:, :, rows, keys[rows]].mean(dim=(0, 2))  # (H,)


def reverse_training() -> None:
    from handformer.train import train
    from handformer.train.trainer import build_task

    config = reverse_config()
    task = build_task(config)
    text = task.example()
    ids = torch.tensor([task.vocab.encode(text)])  # (1, L)
    torch.manual_seed(config.seed)  # the trainer's initial weights: same seed, same model
    model = hf.CausalLM(config.model_config(vocab_size=len(task.vocab), max_len=task.max_len))
    snapshots = []
    with tempfile.TemporaryDirectory() as tmp:
        run, done = Path(tmp) / "reverse", 0
        for stop in (0, 20, 35, 50, 100):
            if stop:
                train(replace(config, stop_after=stop - done), run, resume=done > 0)
                model, done = hf.CausalLM.from_pretrained(run), stop
            model.eval()
            with torch.no_grad():
                w = model(ids, need_weights=True).attentions[0][0]  # (H, L, L)
            snapshots.append((stop, w, mirror_share(model, task)))
    best = int(snapshots[-1][2].argmax())
    for lang in TEXT:
        fig = new_figure(3.3 * len(snapshots), 3.9)
        axes = fig.subplots(1, len(snapshots))
        for ax, (step, w, share) in zip(axes, snapshots, strict=True):
            plot_attention(w[best], list(text), ax=ax,
                           title=say(lang, "reverse_step", step=step, share=share[best]))
        fig.suptitle(say(lang, "reverse_training", head=best, text=text), fontsize=12)
        save(fig, "reverse_training", lang)


# ---- chapter 10: looking inside -------------------------------------------------------------

def leans_to_animal_metric(it: int, animal: int, street: int):  # noqa: ANN201 - a metric
    """Chapter 10's metric: cos(final "it", final "animal") - cos(final "it", final "street")."""
    def metric(out) -> torch.Tensor:  # noqa: ANN001 - a BertModel output
        h = out.last_hidden_state[0]  # (L, E)
        return (torch.cosine_similarity(h[it], h[animal], dim=0)
                - torch.cosine_similarity(h[it], h[street], dim=0))
    return metric


def inside_heads() -> None:
    """Chapter 10: the weight from "it" to "animal" in every head, and how much of the clean
    answer each head restores when patched from the "tired" run into the "wide" run."""
    from handformer.inspect import patching_sweep, run_with_cache
    from handformer.pretrained import load_bert
    from handformer.viz.head_effects import plot_head_effects

    model, tokenizer = load_bert()
    tokens = tokenizer.tokens(SENTENCE)
    it, animal, street = (tokens.index(w) for w in ("it", "animal", "street"))
    clean = tokenizer([SENTENCE])
    wide = tokenizer([SENTENCE.replace("tired", "wide")])
    with torch.no_grad():
        _, cache = run_with_cache(model, clean, names="blocks.*.attn.hook_pattern")
    to_animal = cache.stack("pattern")[:, 0, :, it, animal]  # (layers, heads)
    restored = patching_sweep(model, clean, wide, leans_to_animal_metric(it, animal, street))
    for lang in TEXT:
        fig = new_figure(15.5, 4.4)
        left, right = fig.subplots(1, 2)
        plot_head_effects(to_animal, ax=left, top=2, label=say(lang, "to_animal"),
                          title=say(lang, "to_animal_title"))
        plot_head_effects(restored, ax=right, top=4, label=say(lang, "restored"),
                          title=say(lang, "restored_title"))
        save(fig, "inside_heads", lang)


def inside_rollout() -> None:
    """Chapter 10: the rollout through all layers, and the row of "it" by head (5, 11), by
    rollout and by attention flow."""
    from handformer.inspect import attention_flow, attention_rollout
    from handformer.viz import plot_rollout

    attentions, tokens = bert_attention()
    it = tokens.index("it")
    rollout = attention_rollout(attentions)[0]  # (L, L)
    flow = attention_flow(attentions, rows=it)[0, 0]  # (L,)
    for lang in TEXT:
        fig = plot_rollout(rollout, tokens, row=it, raw=attentions[5][0, 11, it], flow=flow,
                           title=say(lang, "inside_rollout"))
        save(fig, "inside_rollout", lang)


# ---- chapter 13: the attribution graph of "The capital of France is" ------------------------

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)


def tutorial_code(start: str, stop: str) -> list[str]:
    """The shared python blocks of tutorial.en.md between the headings ``start`` and ``stop``
    (the two tutorials hold the same code: tests/test_tutorials.py)."""
    text = (IMG.parent / "tutorial.en.md").read_text(encoding="utf-8")
    part = text[text.index(f"\n{start}"):text.index(f"\n{stop}")]
    return [m.group(2) for m in FENCE.finditer(part) if m.group(1).strip() == "python"]


def paris_graph() -> None:
    """Chapter 13: the pruned graph, made by the tutorial's own blocks of 13.2 to 13.4 (run
    here after what they read from chapter 11: the model, its tokenizer, the id of " Paris"),
    drawn at 72 dpi with each language's title."""
    import contextlib
    import io

    from PIL import Image

    from handformer import inspect as hi
    from handformer.features import draw_graph
    from handformer.pretrained import load_lm

    smol, tokenizer = load_lm("smollm2-135m-instruct")
    names = {"torch": torch, "hi": hi, "smol": smol, "smol_tok": tokenizer,
             "paris": hi.to_single_token(tokenizer, " Paris"), "__name__": "tutorial"}
    with contextlib.redirect_stdout(io.StringIO()):
        for block in tutorial_code("## 13.", "### 13.5"):
            exec(compile(block, "tutorial.en.md, chapter 13", "exec"), names)  # noqa: S102
    graph, kept = names["graph"], names["kept"]
    numbers = dict(nodes=int(kept.node_mask.sum()), edges=int(kept.edge_mask.sum()),
                   replacement=graph.replacement_score, complete=graph.completeness_score)
    words = hi.to_str_tokens(tokenizer, "The capital of France is")
    with matplotlib.rc_context({"savefig.dpi": 72}):
        for lang in TEXT:
            path = draw_graph(graph, image("paris_graph", lang), pruned=kept,
                              prompt_tokens=words, title=say(lang, "paris_graph", **numbers))
            # 256 colours (octree keeps the few node colours): a sixth of the bytes
            small = Image.open(path).convert("RGBA").quantize(256, Image.Quantize.FASTOCTREE)
            small.save(path, optimize=True)


FIGURES = {"seed_attention": seed_attention, "zh_gemma": zh_gemma,
           "seed_variants": seed_variants,
           "patterns": patterns, "reverse_training": reverse_training,
           "inside_heads": inside_heads, "inside_rollout": inside_rollout,
           "paris_graph": paris_graph}


def main(names: list[str]) -> int:
    IMG.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    # the titles written here need the CJK font too, not only the library's plots
    with matplotlib.rc_context({"font.family": list(font_families())}):
        for name, draw in FIGURES.items():
            if names and not any(n in name for n in names):
                continue
            print(f"drawing {name}", flush=True)
            draw()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
