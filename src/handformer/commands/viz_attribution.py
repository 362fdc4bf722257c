"""``handformer viz --attribution`` (causal LMs): attribution.png and attribution_heads.png,
the direct logit attribution of the model's top next token after TEXT."""

from __future__ import annotations

from pathlib import Path


def draw_attribution(model_dir: str, text: str, out: Path, *, device: object,
                     name: str) -> tuple[list[Path], str]:
    """The top next token's logit by component and by head, drawn.

    Returns:
        The two PNG paths and a line saying which token was attributed and its logit.
    """
    import torch

    from handformer.commands.generate import load_model_and_tokenizer
    from handformer.inspect import run_with_cache
    from handformer.tokenizers.labels import next_token_labels
    from handformer.viz import plot_logit_attribution, save_figure

    model, tokenizer = load_model_and_tokenizer(model_dir)
    model.to(device).eval()
    ids = tokenizer.encode(text)[:model.config.max_len]
    with torch.inference_mode():
        out_, cache = run_with_cache(model, torch.tensor([ids], device=device))  # (1, L) ids
    token = int(out_.logits[0, -1].argmax())
    shown = next_token_labels(tokenizer, ids, [token])[0]  # a byte of a character says so
    parts = cache.decompose_resid(pos_slice=-1, return_labels=True)
    attrs, labels = cache.logit_attrs(parts, token, pos_slice=-1, incl_bias=True)
    heads = cache.stack_head_results(pos_slice=-1, incl_remainder=True, return_labels=True)
    head_attrs, head_labels = cache.logit_attrs(heads, token, pos_slice=-1, incl_bias=True)
    title = f"{name}: logit of {shown!r} after the text"
    paths = [save_figure(plot_logit_attribution(attrs, labels, title=title),
                         out / "attribution.png"),
             save_figure(plot_logit_attribution(head_attrs, head_labels, title=title),
                         out / "attribution_heads.png")]
    return paths, (f"next token {shown!r}: logit {float(attrs.sum()):.3f}, attributed to "
                   f"{len(labels) - 1} components and {len(head_labels) - 2} heads")
