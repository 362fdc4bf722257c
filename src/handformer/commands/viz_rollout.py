"""``handformer viz --rollout``: rollout.png and the rollout view's data for index.html."""

from __future__ import annotations

from pathlib import Path

FLOW_TOKENS = 64  # attention flow beyond this many tokens takes minutes: left out, with a note


def draw_rollout(attentions: list, tokens: list[str], out: Path, *, causal: bool,
                 name: str) -> tuple[Path, dict[str, object]]:
    """Rollout, raw attention and flow of the ``[CLS]`` row (a causal LM's last token).

    Returns:
        The path of ``rollout.png`` and the payload for ``save_html(..., rollout=...)``.
    """
    from handformer.inspect import attention_flow, attention_rollout
    from handformer.viz import plot_rollout, rollout_payload, save_figure

    L = len(tokens)
    row = L - 1 if causal else 0
    rollout = attention_rollout(attentions)[0]  # (L, L)
    raw = attentions[-1][0].mean(dim=0)[row]  # (L,) last layer, heads averaged
    flow = None
    if L <= FLOW_TOKENS:
        flow = attention_flow(attentions, rows=row)[0, 0]
    else:
        print(f"note: attention flow left out of rollout.png: {L} tokens is over "
              f"{FLOW_TOKENS} (it would take minutes); handformer.inspect.attention_flow "
              f"computes it with max_tokens=...")
    which = "last token" if causal else "[CLS]"
    png = save_figure(plot_rollout(rollout, tokens, row=row, raw=raw, flow=flow,
                                   title=f"{name}: attention rollout, {which} row compared"),
                      out / "rollout.png")
    return png, rollout_payload(rollout, row=row, raw=raw, flow=flow)
