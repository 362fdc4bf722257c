"""``handformer viz TEXT``: a real model's attention as PNG heat maps and an HTML viewer.

Writes into ``--out`` (default ``./attention/``):

* ``head.png``  - one head's heat map (tokens on both axes, colour bar, layer/head in the
  title; with ``--attention local|strided`` the pattern of reachable keys beside it);
* ``model.png`` - every layer x head as thumbnails;
* ``index.html`` - the self-contained interactive viewer (no network);
* with ``--rollout``: ``rollout.png`` - attention rollout, and the [CLS] row (a causal LM's
  last token) scored by raw attention, rollout and attention flow; index.html gets a
  rollout view;
* with ``--attribution`` (causal LMs): ``attribution.png`` and ``attribution_heads.png`` - the
  top next token's logit split by component and by head.

and prints the paths and one line per layer: the token that gets the most attention and the
strongest link between two ordinary tokens. Notes (text cut to the model's limit, glyphs the
font lacks) go to stderr as one ``note:`` line each. ``--window-size`` belongs to
``--attention local``, ``--stride`` and ``--global-tokens`` to ``--attention strided``: given
with another kind they are refused, not ignored. ``--device`` picks where the model runs.

``--model`` takes a BERT-family folder (``--attention`` swaps every layer's attention kind,
keeping the weights) or a causal language model -- a folder :func:`handformer.pretrained.load_lm`
reads (GPT-2, Llama, Mistral, Qwen2/3, Gemma 2/3, a ``handformer train`` run), a ``.gguf``
file or a shipped model's name -- shown with the attention it was trained with and its causal
pattern beside it. A folder of another ``model_type`` is refused, naming what is accepted.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from handformer.commands.common import (
    UsageError,
    add_device_argument,
    check_attention_flags,
    flag_error,
    note,
    resolve_device,
)

NAME = "viz"
HELP = "Show a model's attention on TEXT: head.png, model.png and index.html."

KINDS = ("full", "local", "strided", "linear")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", metavar="TEXT", help="the text to run the model on")
    parser.add_argument("--model", metavar="MODEL", default=None,
                        help="BERT-family checkpoint folder (default: the bundled "
                             "all-MiniLM-L6-v2), or a causal LM: a GPT-2 / Llama / Mistral / "
                             "Qwen / Gemma / handformer train folder, a .gguf file or a "
                             "shipped model name")
    parser.add_argument("--layer", type=int, default=None,
                        help="layer of head.png, from 0 (default: the layer of the strongest "
                             "link between two words)")
    parser.add_argument("--head", type=int, default=None,
                        help="head of head.png, from 0 (default: the head of that link)")
    parser.add_argument("--out", metavar="DIR", default="attention",
                        help="output folder, created if missing (default ./attention/)")
    parser.add_argument("--attention", choices=KINDS, default="full",
                        help="attention kind used in every layer (default full)")
    parser.add_argument("--window-size", type=int, default=None,
                        help="window of --attention local (default 5: two keys each side)")
    parser.add_argument("--stride", type=int, default=None,
                        help="stride of --attention strided (default 3)")
    parser.add_argument("--global-tokens", type=int, default=None,
                        help="leading tokens every query sees with --attention strided "
                             "(default 1: [CLS])")
    parser.add_argument("--rollout", action="store_true",
                        help="also write rollout.png (attention rollout and flow) and add a "
                             "rollout view to index.html")
    parser.add_argument("--attribution", action="store_true",
                        help="causal language models: also write attribution.png and "
                             "attribution_heads.png, the top next token's logit split by "
                             "component and by head (direct logit attribution)")
    parser.add_argument("--max-tokens", type=int, default=None, metavar="N",
                        help="show at most the first N tokens of TEXT (default: as many as "
                             "the model takes, within the attention budget viz and serve "
                             "share: layers x heads x tokens² up to 80 M values)")
    parser.add_argument("--include-sink", action="store_true",
                        help="count the first token in the links and the head choice (left "
                             "out by default: most heads park their attention there, an "
                             "attention sink)")
    add_device_argument(parser)


# Options of one attention kind: flag -> (kind it belongs to, default).
_PATTERN_FLAGS = {"window_size": ("local", 5), "stride": ("strided", 3),
                  "global_tokens": ("strided", 1)}


def _check_pattern_flags(args: argparse.Namespace) -> None:
    """Refuse an option of one attention kind given with another (it would be ignored; the
    server refuses the same), and fill in the defaults of the chosen kind."""
    check_attention_flags(args.attention, **{name: getattr(args, name)
                                              for name in _PATTERN_FLAGS})
    for name, (_, default) in _PATTERN_FLAGS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def _kind(args: argparse.Namespace) -> tuple[object | None, str]:
    """The attention kind for ``--attention`` and a short description of it."""
    from handformer.attention.registry import attention_kind
    from handformer.checks import OptionError

    if args.attention == "full":
        return None, "full attention"
    options = {name: getattr(args, name) for name, (kind, _) in _PATTERN_FLAGS.items()
               if kind == args.attention}
    try:
        made = attention_kind(args.attention, **options)
    except OptionError as exc:
        raise flag_error(exc) from None
    if args.attention == "local":
        return made, f"local attention, window {args.window_size}"
    if args.attention == "strided":
        return made, (f"strided attention, stride {args.stride}, {args.global_tokens} global "
                      "token(s)")
    return made, "linear attention (elu+1 features; the matrix is never formed)"


def _check_out(out: str) -> Path:
    """Create ``out`` if needed and prove it is writable, before any slow work."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UsageError(f"cannot write to --out {out}: {reason}") from None
    return path


def _check_index(name: str, value: int | None, count: int, unit: str) -> None:
    if value is not None and not 0 <= value < count:
        raise UsageError(f"--{name} {value} is out of range: the model has {count} {unit}, "
                         f"valid values are 0..{count - 1}")


@dataclass
class _Run:
    """What the drawing needs from a model run on the text."""

    name: str  # model name for titles
    kind_text: str  # the attention kind, in words
    tokens: list[str]
    attentions: list  # N x (1, H, L, L) float32 tensors
    pattern: object  # a bool (L, L) tensor, an attention kind with .pattern, or None
    pattern_label: str
    special: list[int] | None  # 1 for special tokens ([CLS], ...)
    words: list[int] | None  # word index per token
    unknown: list[bool]  # the model's unknown token ([UNK]) per position


def _causal_folder(model: str | None) -> bool:
    """True for a causal LM (``load_lm``'s folders, ``.gguf`` files and shipped names); a
    folder of a ``model_type`` viz does not read is refused, naming what it does."""
    from handformer.commands.common import is_causal_model

    return is_causal_model(model, "viz")


def _check_limits(args: argparse.Namespace, N: int, H: int) -> None:
    _check_index("layer", args.layer, N, "layers")
    _check_index("head", args.head, H, "heads per layer")


def _check_budget(args: argparse.Namespace, name: str, N: int, H: int, L: int) -> None:
    """Refuse, before the model runs, a text whose attention weights would pass the budget
    ``handformer serve`` keeps too (:data:`handformer.viz.budget.VIEW_BUDGET`)."""
    from handformer.viz.budget import VIEW_BUDGET, describe_cost, describe_values, view_limit

    limit = view_limit(N, H)  # the server's limit too
    if L <= limit:
        return
    budget = describe_values(VIEW_BUDGET)
    if args.max_tokens is not None:
        raise UsageError(f"--max-tokens {args.max_tokens} is over the attention budget for "
                         f"{name}: {describe_cost(N, H, L)}, more than the {budget} viz and "
                         f"serve allow; at most {limit} tokens fit this model")
    raise UsageError(f"TEXT is {L} tokens for {name}: its attention would be "
                     f"{describe_cost(N, H, L)}, more than the {budget} viz and serve allow; "
                     f"pass --max-tokens {limit} (or fewer) to show the first {limit} tokens")


def _cut_note(args: argparse.Namespace, tokens: int, limit: int) -> None:
    """The note for a text cut to ``--max-tokens`` (``limit``) tokens."""
    note(f"the text has {tokens} tokens here; only the first {limit} are shown "
         f"(--max-tokens {args.max_tokens})")


def _run_bert(args: argparse.Namespace, text: str, device: object) -> _Run:
    import torch

    from handformer.pretrained import load_bert
    from handformer.viz.head_choice import word_index

    kind, kind_text = _kind(args)  # validates --window-size / --stride (ValueError -> exit 2)
    model, tokenizer = load_bert(args.model, attention=kind)
    model.to(device)
    name = ("all-MiniLM-L6-v2" if args.model is None
            else Path(args.model).resolve().name or str(args.model))
    N, H = model.config.num_hidden_layers, model.config.num_attention_heads
    _check_limits(args, N, H)
    if args.max_tokens is not None and args.max_tokens < 2:
        raise UsageError(f"--max-tokens {args.max_tokens} is too small for {name}: its "
                         "tokenizer adds [CLS] and [SEP], so at least 2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        encodings = tokenizer.encode_batch([text])  # truncated to the model's limit, with a warning
    tokens = encodings[0].tokens
    cut = args.max_tokens is not None and len(tokens) > args.max_tokens
    _check_budget(args, name, N, H, args.max_tokens if cut else len(tokens))  # before notes
    if any("truncated" in str(w.message) for w in caught):
        note(f"the text is longer than the model's limit of {tokenizer.max_length} tokens; "
             f"only the first {len(tokens)} are shown")
    if cut:
        _cut_note(args, len(tokens), args.max_tokens)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the truncation warning: noted above
            encodings = tokenizer.encode_batch([text], max_length=args.max_tokens)
        tokens = encodings[0].tokens
    batch = {k: v.to(device) for k, v in tokenizer.pad(encodings).items()}  # (1, L) tensors
    with torch.inference_mode():
        result = model(**batch, need_weights=True)
    pattern: object = kind  # local / strided: the kind draws its own pattern
    pattern_label = kind_text.capitalize()
    if args.attention == "linear":  # every key is reachable; the point is the cost
        pattern = torch.ones(len(tokens), len(tokens), dtype=torch.bool)
        pattern_label = ("Linear attention: every query reaches every key, yet the L x L "
                         "matrix is never formed (cost grows as L·D², not L²·D)")
    return _Run(name, kind_text, tokens, [a.float().cpu() for a in result.attentions], pattern,
                pattern_label, encodings[0].special_tokens_mask,
                word_index(text, encodings[0].offsets), _unknown(tokenizer, encodings[0].ids))


def _unknown(tokenizer: object, ids: list[int]) -> list[bool]:
    """Per token, whether it is the tokenizer's unknown token."""
    from handformer.tokenizers.labels import unk_token_id

    unk = unk_token_id(tokenizer)
    return [unk is not None and int(i) == unk for i in ids]


def _run_causal(args: argparse.Namespace, text: str, device: object) -> _Run:
    import torch

    from handformer.commands.generate import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(args.model, command="viz")
    model.to(device)
    c = model.config
    kind = model.blocks[0].attn.attention
    if args.attention != "full":
        raise UsageError(f"--attention {args.attention} applies to BERT-family encoders; "
                         f"{Path(args.model).name} is a causal language model shown with the "
                         f"attention it was trained with ({c.attention})")
    _check_limits(args, c.num_layers, c.num_heads)
    ids = tokenizer.encode(text)  # ValueError for characters outside a char vocabulary
    if not ids:
        raise UsageError("TEXT gives no tokens for this model's tokenizer")
    limit = c.max_len if args.max_tokens is None else min(args.max_tokens, c.max_len)
    _check_budget(args, Path(args.model).resolve().name, c.num_layers, c.num_heads,
                  min(len(ids), limit))  # before any note: a refusal is one line
    if args.max_tokens is not None and args.max_tokens < len(ids) and \
            args.max_tokens < c.max_len:
        _cut_note(args, len(ids), args.max_tokens)
        ids = ids[:args.max_tokens]
    elif len(ids) > c.max_len:
        note(f"the text has {len(ids)} tokens, more than the model's limit of {c.max_len}; "
             f"only the first {c.max_len} are shown")
        ids = ids[:c.max_len]
    with torch.inference_mode():
        result = model(torch.tensor([ids], device=device), need_weights=True)  # (1, L) ids
    L = len(ids)
    kind_text = {"full": "causal attention",
                 "local": f"causal local attention, window {c.window_size}",
                 "strided": f"causal strided attention, stride {c.stride}",
                 "linear": "causal linear attention"}.get(c.attention, c.attention)
    types = getattr(c, "layer_types", None)
    if types and "local" in types:  # sliding-window layers among full ones (Mistral, Gemma)
        local = sum(t == "local" for t in types)
        kind_text = (f"causal attention; {local} of {len(types)} layers see the last "
                     f"{(c.window_size + 1) // 2} tokens (pattern: layer 0)")
    from handformer.tokenizers.labels import label_words, token_labels

    labels = token_labels(tokenizer, ids)
    return _Run(Path(args.model).resolve().name, kind_text, labels,
                [a.float().cpu() for a in result.attentions], kind.pattern(L, L, causal=True),
                kind_text.capitalize(), None, label_words(labels), _unknown(tokenizer, ids))


def run(args: argparse.Namespace) -> int:
    text = args.text
    if not text.strip():
        raise UsageError("TEXT is empty; pass some words, e.g. handformer viz \"The animal "
                         "didn't cross the street because it was too tired\"")
    _check_pattern_flags(args)
    from handformer.checks import MAX_INT

    if args.max_tokens is not None and not 1 <= args.max_tokens <= MAX_INT:
        raise UsageError(f"--max-tokens must be an integer in [1, {MAX_INT}], got "
                         f"{args.max_tokens}")
    causal = _causal_folder(args.model)
    if args.attribution and not causal:
        raise UsageError("--attribution needs a causal language model (--model DIR of a GPT-2 "
                         "or handformer train folder): it splits the next token's logit")
    if not causal:
        _kind(args)  # bad --window-size / --stride fail before the output folder is made
    device = resolve_device(args.device)
    out = _check_out(args.out)

    from handformer.tokenizers.labels import unknown_notice
    from handformer.viz import plot_attention, plot_heads, save_figure, save_html, summarize
    from handformer.viz.head_choice import choose_head, left_out
    from handformer.viz.heatmap import MissingGlyphWarning

    r = _run_causal(args, text, device) if causal else _run_bert(args, text, device)
    tokens, attentions = r.tokens, r.attentions
    N, H, L = len(attentions), attentions[0].shape[1], len(tokens)
    ordinary = L - (sum(r.special) if r.special is not None else 0)
    unknown = unknown_notice(sum(r.unknown), ordinary, model=r.name, what="TEXT")
    if unknown:
        note(unknown)

    # Links worth showing: between two words at least two words apart (not within "didn't",
    # not to the neighbour), special and unknown tokens left out (relaxed when none remain).
    # The first position is an attention sink (heads with nothing to do park their weight
    # there): left out of the links too, unless --include-sink.
    skip = left_out(tokens, r.special, r.unknown)
    summaries = summarize(attentions, tokens, special=skip, words=r.words, min_distance=2,
                          include_sink=args.include_sink)
    layer, head = choose_head(attentions, tokens, special=skip, words=r.words,
                              layer=args.layer, head=args.head, include_sink=args.include_sink)

    short = " ".join(text.split())
    short = short if len(short) <= 60 else short[:57] + "..."
    title = f"{r.name}: layer {layer}, head {head} ({r.kind_text})"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MissingGlyphWarning)
        head_png = save_figure(plot_attention(attentions[layer][0, head], tokens, title=title,
                                              pattern=r.pattern), out / "head.png")
        model_png = save_figure(plot_heads(attentions, tokens, title=f"{r.name}: every "
                                           f"head ({r.kind_text}), each scaled to its maximum"),
                                out / "model.png")
        rollout_png, rollout = None, None
        if args.rollout:
            from handformer.commands.viz_rollout import draw_rollout

            rollout_png, rollout = draw_rollout(attentions, tokens, out, name=r.name,
                                                causal=_causal_folder(args.model))
    glyphs = [w for w in caught if issubclass(w.category, MissingGlyphWarning)]
    if glyphs:
        note(str(glyphs[0].message))
    html_path = save_html(attentions, tokens, out / "index.html",
                          title=f"Attention of {r.name}: {short}",
                          pattern=r.pattern, pattern_label=r.pattern_label,
                          note=f"{r.name} · {r.kind_text}", layer=layer, head=head,
                          rollout=rollout, include_sink=args.include_sink)

    attribution_pngs, attribution_line = [], None
    if args.attribution:
        from handformer.commands.viz_attribution import draw_attribution

        attribution_pngs, attribution_line = draw_attribution(args.model, text, out,
                                                              device=device, name=r.name)
    for path in (head_png, model_png, rollout_png, *attribution_pngs, html_path):
        if path is not None:
            print(f"wrote {path}")
    if attribution_line:
        print(attribution_line)
    print(f"{L} token{'s' * (L != 1)}, {N} layer{'s' * (N != 1)} x {H} head{'s' * (H != 1)}; "
          f"head.png shows layer {layer}, head {head}"
          + _why(summaries, tokens, layer, head, chosen=args.layer is None and args.head is None))
    for s in summaries:
        print(s.describe(tokens))
    for line in _link_notes(attentions, tokens, summaries, skip, args.include_sink):
        print(line)
    return 0


def _why(summaries: list, tokens: list[str], layer: int, head: int, *, chosen: bool) -> str:
    """``": the strongest link, it -> animal 0.74"`` when head.png shows the strongest link
    of the summary, else nothing."""
    best = max((s for s in summaries if s.link is not None), key=lambda s: s.link[3],
               default=None)
    if not chosen or best is None or (best.layer, best.link[0]) != (layer, head):
        return ""
    _, i, j, w = best.link
    return f": the strongest link, {tokens[i]} -> {tokens[j]} {w:.2f}"


def _link_notes(attentions: list, tokens: list[str], summaries: list, skip: list[bool],
                include_sink: bool) -> list[str]:
    """What the summary leaves out: the first token as an attention sink; no link at all."""
    lines = []
    L = len(tokens)
    if L == 1:
        return [f"TEXT is one token ({tokens[0]}): there is no link between two tokens to "
                "report"]
    if not include_sink and not skip[0]:
        share = sum(float(a[0, :, :, 0].sum()) for a in attentions) / (
            len(attentions) * attentions[0].shape[1] * L)  # mean weight on key 0
        lines.append(f"the first token {tokens[0]} is left out of the links and the head "
                     f"choice as an attention sink (it gets {share:.0%} of all attention); "
                     "--include-sink counts it")
    if all(s.link is None for s in summaries):
        lines.append("no link between two tokens at least two words apart to report "
                     "(special and unknown tokens"
                     + (", and the first token," if not include_sink else "")
                     + " left out)")
    return lines
