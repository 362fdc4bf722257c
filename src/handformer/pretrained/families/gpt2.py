"""GPT-2 checkpoints (``model_type`` ``gpt2``) as a family: the config mapping of
:func:`handformer.pretrained.gpt2.gpt2_config` and a key map with the two layout changes GPT-2
needs (see :mod:`handformer.pretrained.gpt2`): its ``Conv1D`` weights are stored transposed,
and the query, key and value projections are one ``c_attn`` of width ``3 E``, split in three
here. Keys carry ``transformer.`` (``GPT2LMHeadModel``) or not (``GPT2Model``); the old
causal-mask buffers ``attn.bias`` / ``attn.masked_bias`` are skipped.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from handformer.pretrained.families.common import GGUFRules, Layout

__all__ = ["MODEL_TYPES", "LAYOUT", "GGUF", "ACTIVATIONS", "gpt2_config", "config_from_hf",
           "key_map", "file_shapes"]

MODEL_TYPES = ("gpt2",)
LAYOUT = Layout(body="transformer.", bodies=("transformer.", ""), anchor="wte.weight",
                skip_suffixes=(".attn.bias", ".attn.masked_bias"))
# GGUF stores the Conv1D weights as (out, in) matrices: gguf.convert's GPT-2 table transposes.
GGUF = GGUFRules(architectures=("gpt2",))

Transform = Callable[[Tensor], Tensor]
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
               "relu": "relu"}


def gpt2_config(data: dict) -> object:
    """A :class:`~handformer.CausalLMConfig` from a GPT-2 ``config.json`` dict.

    Raises:
        ValueError: for another ``model_type`` or options handformer does not implement
            (cross-attention, ``scale_attn_by_inverse_layer_idx``, unscaled attention,
            unknown activations).
    """
    from handformer.models.causal_lm_config import CausalLMConfig

    if not isinstance(data, dict) or data.get("model_type") != "gpt2":
        found = data.get("model_type") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"model_type is {found!r}, load_gpt2 reads 'gpt2' checkpoints")
    unsupported = [name for name, bad in (
        ("add_cross_attention", data.get("add_cross_attention", False)),
        ("scale_attn_by_inverse_layer_idx", data.get("scale_attn_by_inverse_layer_idx", False)),
        ("scale_attn_weights=False", not data.get("scale_attn_weights", True)),
    ) if bad]
    if unsupported:
        raise ValueError(f"GPT-2 options not supported by handformer: {unsupported}")
    activation = data.get("activation_function", "gelu_new")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation_function {activation!r} is not supported; known: "
                         f"{sorted(ACTIVATIONS)}")
    try:
        n_embd = data["n_embd"]
        return CausalLMConfig(
            vocab_size=data["vocab_size"], max_len=data["n_positions"], d_model=n_embd,
            num_heads=data["n_head"], num_layers=data["n_layer"],
            d_ff=data.get("n_inner") or 4 * n_embd, dropout=0.0,
            activation=ACTIVATIONS[activation], positional="learned", attention="full",
            tie_weights=bool(data.get("tie_word_embeddings", True)), norm_first=True,
            layer_norm_eps=data.get("layer_norm_epsilon", 1e-5), bias=True,
        )
    except KeyError as exc:
        raise ValueError(f"GPT-2 config.json lacks {exc.args[0]!r}") from None


def config_from_hf(hf: dict) -> object:
    """The :class:`~handformer.CausalLMConfig` of a GPT-2 ``config.json`` (:func:`gpt2_config`).
    """
    return gpt2_config(hf)


def file_shapes(config: object) -> dict[str, tuple[int, ...]]:
    """GPT-2's canonical checkpoint keys (with ``transformer.``) and their shapes in the file
    (``Conv1D`` weights as ``(in, out)``, the fused ``c_attn``)."""
    c = config
    E, F = c.d_model, c.d_ff  # type: ignore[attr-defined]
    shapes = {"transformer.wte.weight": (c.vocab_size, E),  # type: ignore[attr-defined]
              "transformer.wpe.weight": (c.max_len, E),  # type: ignore[attr-defined]
              "transformer.ln_f.weight": (E,), "transformer.ln_f.bias": (E,)}
    for i in range(c.num_layers):  # type: ignore[attr-defined]
        p = f"transformer.h.{i}."
        shapes.update({
            p + "ln_1.weight": (E,), p + "ln_1.bias": (E,),
            p + "attn.c_attn.weight": (E, 3 * E), p + "attn.c_attn.bias": (3 * E,),
            p + "attn.c_proj.weight": (E, E), p + "attn.c_proj.bias": (E,),
            p + "ln_2.weight": (E,), p + "ln_2.bias": (E,),
            p + "mlp.c_fc.weight": (E, F), p + "mlp.c_fc.bias": (F,),
            p + "mlp.c_proj.weight": (F, E), p + "mlp.c_proj.bias": (E,),
        })
    if not c.tie_weights:  # type: ignore[attr-defined]
        shapes["lm_head.weight"] = (c.vocab_size, E)  # type: ignore[attr-defined]
    return shapes


def _transposed(t: Tensor) -> Tensor:
    return t.t()  # Conv1D (in, out) -> Linear (out, in)


def _third(k: int, E: int, *, weight: bool) -> Transform:
    """The ``k``-th of the query / key / value blocks of ``c_attn``."""
    if weight:
        return lambda t: t[:, k * E:(k + 1) * E].t()  # (E, 3E) -> (E, E), as (out, in)
    return lambda t: t[k * E:(k + 1) * E]  # (3E,) -> (E,)


def key_map(config: object) -> dict[str, object]:
    """Canonical GPT-2 key -> handformer key, or a list of ``(key, transform)`` pairs."""
    c = config
    E = c.d_model  # type: ignore[attr-defined]
    keys: dict[str, object] = {
        "transformer.wte.weight": "tok_emb.weight", "transformer.wpe.weight": "pos_emb.weight",
        "transformer.ln_f.weight": "ln_final.weight", "transformer.ln_f.bias": "ln_final.bias"}
    if not c.tie_weights:  # type: ignore[attr-defined]
        keys["lm_head.weight"] = "lm_head.weight"
    for i in range(c.num_layers):  # type: ignore[attr-defined]
        hf, ours = f"transformer.h.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            keys[f"{hf}attn.c_attn.{kind}"] = [
                (f"{ours}attn.{name}_proj.{kind}", _third(k, E, weight=kind == "weight"))
                for k, name in enumerate("qkv")]
        keys.update({
            f"{hf}attn.c_proj.weight": [(f"{ours}attn.out_proj.weight", _transposed)],
            f"{hf}attn.c_proj.bias": f"{ours}attn.out_proj.bias",
            f"{hf}ln_1.weight": f"{ours}ln1.weight", f"{hf}ln_1.bias": f"{ours}ln1.bias",
            f"{hf}ln_2.weight": f"{ours}ln2.weight", f"{hf}ln_2.bias": f"{ours}ln2.bias",
            f"{hf}mlp.c_fc.weight": [(f"{ours}mlp.linear1.weight", _transposed)],
            f"{hf}mlp.c_fc.bias": f"{ours}mlp.linear1.bias",
            f"{hf}mlp.c_proj.weight": [(f"{ours}mlp.linear2.weight", _transposed)],
            f"{hf}mlp.c_proj.bias": f"{ours}mlp.linear2.bias",
        })
    return keys
