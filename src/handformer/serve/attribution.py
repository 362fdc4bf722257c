"""``/api/attribution``: direct logit attribution of a causal LM's next token.

The model's most likely next token after the text, and its logit split into what each part
of the residual stream contributes (:meth:`~handformer.inspect.run.ActivationCache.logit_attrs`):
per component (``embed``, ``{l}_attn_out``, ``{l}_mlp_out``) and per head (a layer x head
grid, with the rest of the stream and the bias term); both add up to the logit (before a
final soft-cap). Ablated heads (``heads``) are ablated in the run, as in ``/api/run``.

Shape letters: ``N`` layers, ``H`` heads.
"""

from __future__ import annotations

import torch

from handformer.serve.compute import _header, ablated, request_input
from handformer.serve.state import ModelState
from handformer.serve.validation import RequestError, RunRequest
from handformer.tokenizers.labels import next_token_labels

__all__ = ["attribution"]


def attribution(state: ModelState, req: RunRequest) -> dict[str, object]:
    """The attribution of the top next token's logit, per component and per head.

    Raises:
        RequestError: for an encoder (there is no next token to attribute; answered 422, as
            ``/api/generate`` on an encoder).
    """
    from handformer.inspect import run_with_cache
    from handformer.viz.llm_plots import head_grid

    if not state.causal:
        raise RequestError(None, f"{state.name} is an encoder; /api/attribution needs a causal "
                                 "language model (it splits the next token's logit)")
    model = state.variant(req.attention)
    enc = request_input(state, req)  # text, or the token ids a generation made
    with torch.inference_mode(), ablated(model, req.heads):
        out, cache = run_with_cache(model, **enc.batch)
    token = int(out.logits[0, -1].argmax())
    parts = cache.decompose_resid(pos_slice=-1, return_labels=True)
    layer_attrs, layer_labels = cache.logit_attrs(parts, token, pos_slice=-1, incl_bias=True)
    heads = cache.stack_head_results(pos_slice=-1, incl_remainder=True, return_labels=True)
    head_attrs, head_labels = cache.logit_attrs(heads, token, pos_slice=-1, incl_bias=True)
    grid, rest = head_grid(head_attrs[:, 0].double().numpy(), head_labels)
    return _header(state, req) | {
        "tokens": enc.tokens, "notices": enc.notices,
        "token": {"id": token, "token": next_token_labels(
            state.tokenizer, enc.batch["input_ids"][0].tolist(), [token])[0]},
        "logit": float(layer_attrs[:, 0].sum()),
        "components": {"labels": layer_labels,
                       "values": [float(v) for v in layer_attrs[:, 0]]},
        "heads": {"grid": grid.tolist(), "remainder": rest["remainder"], "bias": rest["bias"]},
    }
