"""One entry point for every causal language model: :func:`load_lm`.

``load_lm(source)`` takes

* a folder in Hugging Face's layout: ``config.json`` whose ``model_type`` is one a family
  module reads (``gpt2``, ``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``gemma2``,
  ``gemma3_text``, ``gemma3``; see :mod:`handformer.pretrained.families`), with
  ``model.safetensors`` or shards listed in ``model.safetensors.index.json``; or a folder
  written by ``handformer train`` / ``CausalLM.save_pretrained``;
* a ``.gguf`` file (llama.cpp's format; read by :mod:`handformer.pretrained.gguf`);
* a shipped model's name (``smollm2-135m-instruct``, ``gemma3-270m``).

Loading is strict and all-or-nothing (:func:`build_causal_lm`): the model is built on the
``meta`` device (its parameters take no memory), every tensor of the checkpoint is checked
against it -- missing, unexpected, mis-shaped and wrongly typed keys are reported together
in one :class:`~handformer.weights.CheckpointError`, in the checkpoint's own names -- and only
then are the tensors read, one at a time, converted to the requested dtype and installed.
The peak memory is about one copy of the model.
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor, nn

from handformer.attention.kinds import AttentionKind
from handformer.layers import check_attention, projection_groups
from handformer.models.causal_lm import CausalLM
from handformer.models.int8_model import Int8Installer, quantize_model
from handformer.models.quantized import check_quantize
from handformer.packing import empty_packed
from handformer.pretrained.families import HANDFORMER_TYPE, Family, family_for
from handformer.pretrained.folders import CONFIG_NAME, WEIGHTS_NAME, read_config_json
from handformer.pretrained.on_meta import parameters_on_meta
from handformer.pretrained.shards import INDEX_NAME, SafetensorsState, open_weights
from handformer.tokenizers.byte_bpe import missing_tokenizer_note
from handformer.tokenizers.lm import LMTokenizer
from handformer.tokenizers.loading import folder_tokenizer, require_tokenizer
from handformer.weights import (
    DTYPE_NAMES,
    CheckpointError,
    _plan,
    check_not_pickle,
)

__all__ = ["load_lm", "load_lm_with_tokenizer", "build_causal_lm", "SafetensorsState",
           "open_weights", "INDEX_NAME", "is_causal_source", "resolve_source", "shipped_names",
           "folder_tokenizer", "swap_attention"]


# ---- reading weights (the files themselves: handformer.pretrained.shards) ----------------


def _header_of(state: Mapping[str, Tensor]) -> dict[str, dict]:
    """A safetensors-style header (dtype name and shape per key) of any tensor mapping."""
    header = getattr(state, "header", None)
    if isinstance(header, dict):
        return header
    out = {}
    for key, t in state.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"state[{key!r}] must be a torch.Tensor, got {type(t).__name__}")
        out[key] = {"dtype": DTYPE_NAMES.get(t.dtype, str(t.dtype)), "shape": list(t.shape)}
    return out


# ---- building the model ------------------------------------------------------------------


def _targets(value: object) -> list[tuple[str, object]]:
    """A key map value as ``[(handformer key, transform or None)]``."""
    if isinstance(value, str):
        return [(value, None)]
    return [(t, None) if isinstance(t, str) else tuple(t) for t in value]  # type: ignore[misc]


def _holder(shapes: Mapping[str, tuple[int, ...]], tied: tuple[str, str] | None) -> nn.Module:
    """A parameter-only module on ``meta`` with the checkpoint's canonical names and shapes;
    ``tied = (embedding key, head key)`` registers the head as the same tensor."""
    root = nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]  # type: ignore[assignment]
        module.register_parameter(leaf, nn.Parameter(torch.empty(shape, device="meta"),
                                                     requires_grad=False))
    if tied is not None:
        embed, head = tied
        *path, leaf = head.split(".")
        module = root
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]  # type: ignore[assignment]
        module.register_parameter(leaf, root.get_parameter(embed))
    return root


def _check_options(dtype: object, attention: object) -> torch.dtype:
    if dtype is None:
        dtype = torch.float32
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r} (None: "
                        "float32)")
    if attention is not None and not (isinstance(attention, AttentionKind)
                                      or callable(attention)):
        raise TypeError(f"attention must be an attention kind (e.g. FullAttention(), "
                        f"LocalAttention(9)) or a factory returning one, got "
                        f"{type(attention).__name__}")
    return dtype


def _check_device(device: object) -> torch.device:
    try:
        return torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a torch device; use 'cpu', 'cuda', "
                         "'cuda:0', 'mps', ...") from None


def swap_attention(model: CausalLM, attention: object) -> None:
    """Give every layer its own copy of ``attention`` (a kind, or a factory called per
    layer), keeping the weights. A model with an attention-logit soft-cap (Gemma 2) keeps it
    in softmax kinds given without one: the cap is part of the model, not of the kind."""
    cap = getattr(model.config, "attn_softcap", None)
    for layer in model.blocks:
        kind = (copy.deepcopy(attention) if isinstance(attention, AttentionKind)
                else check_attention(attention()))  # type: ignore[operator]
        if cap is not None and getattr(kind, "softcap", False) is None:
            kind.softcap = cap
        layer.attn.attention = kind


def build_causal_lm(hf_config: Mapping[str, object], state: Mapping[str, Tensor], *,
                    source: str, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu", attention: object = None,
                    quantize: str | None = None) -> CausalLM:
    """A :class:`~handformer.CausalLM` from a Hugging Face config dict and its tensors.

    Strict and all-or-nothing: every tensor the config implies must be in ``state`` once, with
    its shape, and nothing else may be (keys the family skips on purpose aside, such as a
    multimodal checkpoint's vision tower). The model is built on the ``meta`` device and
    filled tensor by tensor, so the memory needed is one copy of the model.

    Args:
        hf_config: the ``config.json`` dict (``model_type`` picks the family).
        state: checkpoint key -> tensor, in the checkpoint's names (a
            :class:`SafetensorsState` reads each tensor when it is asked for).
        source: how errors name the checkpoint (its path).
        dtype: parameter dtype (None: float32).
        device: where the parameters go.
        attention: an attention kind (or a factory) for every layer instead of the
            configured ones, with the same weights.
        quantize: ``"int8"``: each linear layer's weight and the token embedding are
            quantized as they are read, a few rows at a time where ``state`` has a
            ``read_rows`` method (:mod:`handformer.models.quantized`); ``"int4"``: the
            projections of :func:`~handformer.models.int8_model.int4_names` 4-bit
            (:mod:`handformer.models.int4`); None: float.

    Returns:
        The model, in eval mode.

    Raises:
        ValueError: for an unknown ``model_type`` (naming the supported ones) or a config
            field handformer cannot honour (naming it and its value).
        CheckpointError: naming every missing, unexpected, mis-shaped and wrongly typed key
            (in the checkpoint's names); nothing is loaded.
        TypeError: for a non-floating ``dtype`` or an ``attention`` that is not a kind.
    """
    dtype = _check_options(dtype, attention)
    where = _check_device(device)
    quantize = check_quantize(quantize, dtype, where)
    if not isinstance(hf_config, Mapping):
        raise TypeError(f"hf_config must be a dict (config.json), got "
                        f"{type(hf_config).__name__}")
    checked = check_against_config(hf_config, state, str(source))
    family, config, model, canonical = (checked.family, checked.config, checked.model,
                                        checked.canonical)
    header, holder, plan = checked.header, checked.holder, checked.plan
    aliases = {name: group[0] for group in _alias_groups(holder) for name in group}
    wider = set()  # int4: projections a GGUF file stores in more than 4 bits stay int8
    four_bit = getattr(state, "four_bit", None)
    if quantize == "int4" and four_bit is not None:
        for file_key, target, _ in plan:
            if not four_bit(file_key):
                wider.update(k.rpartition(".")[0] for k, _ in _targets(canonical[aliases[target]]))
    installer = (Int8Installer(model, quantize, wider=wider) if quantize
                 else None)  # no float slots to fill
    slots = {} if installer else _packed_slots(model, dtype, where)
    values: dict[str, Tensor] = {}
    read_into = getattr(state, "read_into", None)  # a state that can fill a slot itself
    read_rows = getattr(state, "read_rows", None)  # one that hands out chunks of rows
    for file_key, target, _ in plan:
        targets = _targets(canonical[aliases[target]])
        if (installer is not None and read_rows is not None and len(targets) == 1
                and targets[0][1] is None and installer.wants(targets[0][0])):
            # int8 rows straight from the file's chunks: no float32 copy of the tensor
            our_key = targets[0][0]
            file_rows = (state.row_source(file_key)  # type: ignore[attr-defined]
                         if installer.wants_file_rows(our_key)
                         and hasattr(state, "row_source") else None)
            installer.take_rows(our_key, tuple(header[file_key]["shape"]),
                                functools.partial(read_rows, file_key), file_rows)
            continue
        slot = slots.get(targets[0][0]) if len(targets) == 1 and targets[0][1] is None else None
        if read_into is not None and slot is not None and slot.device.type == "cpu" \
                and header[file_key]["dtype"] == DTYPE_NAMES.get(dtype):
            values[targets[0][0]] = read_into(file_key, slot)  # no temporary copy
            continue
        tensor = state[file_key]
        for our_key, transform in targets:
            value = tensor if transform is None else transform(tensor)  # type: ignore[operator]
            value = value.to(device=where, dtype=dtype)
            if installer is not None and installer.take(our_key, value):
                continue  # quantized now; the float tensor goes
            values[our_key] = (slots[our_key].copy_(value) if our_key in slots
                               else value.contiguous())
        del tensor
    if installer is not None:
        installer.finish()  # a group the file did not give whole
    for name, value in values.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, nn.Parameter(value))
    if config.tie_weights:  # type: ignore[attr-defined]
        if installer is not None:
            installer.tie()  # the embedding's int8 rows, packed for the product
        else:
            model.lm_head.weight = model.tok_emb.weight
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:  # a key map that misses a parameter: a bug here, not in the file
        raise RuntimeError(f"the {family.name} key map leaves parameters unloaded: {left}")
    model.to(where)  # buffers
    if attention is not None:
        swap_attention(model, attention)
    return model.eval()


def _packed_slots(model: CausalLM, dtype: torch.dtype, device: torch.device
                  ) -> dict[str, Tensor]:
    """Parameter name -> its rows in one new tensor per group of projections that read one
    input (q/k/v, gate/up; :func:`~handformer.packing.empty_packed`): the file's tensors are
    copied straight into them, so the model is packed as a constructed one is."""
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)]: view for group in projection_groups(model)
            for p, view in empty_packed(*group, dtype=dtype, device=device)}



@dataclass(frozen=True)
class CheckedCheckpoint:
    """What :func:`check_against_config` found: the model on ``meta`` and the reading plan."""

    family: Family
    config: object
    model: CausalLM
    canonical: dict
    header: dict
    holder: object
    plan: list


def check_against_config(hf_config: Mapping, state: object, source: str) -> CheckedCheckpoint:
    """Build the model of ``hf_config`` on ``meta`` and plan which checkpoint key fills which
    parameter, reading no tensor (shared by :func:`build_causal_lm` and the tensor-parallel
    loader).

    Args:
        hf_config: the checkpoint's ``config.json``.
        state: the checkpoint's tensors (only its header is read).
        source: the file or folder, for messages.

    Returns:
        The :class:`CheckedCheckpoint`.

    Raises:
        CheckpointError: for keys or shapes that do not match the config (every one listed);
            nothing is loaded.
    """
    family = family_for(hf_config.get("model_type"))
    config = family.config_from_hf(dict(hf_config))
    with parameters_on_meta():
        model = CausalLM(config)
    canonical = family.key_map(config)
    ours = dict(model.named_parameters())  # tied parameters once
    header = _header_of(state)
    holder = _holder(_file_shapes(family, config, canonical, ours), _tie(family, config))
    layout = family.layout
    prefix = layout.prefix_of(header)

    def to_canonical(key: str) -> str | None:
        if layout.skips(key):
            return None
        if key in layout.heads:
            return layout.heads[0]
        if key.startswith(prefix):
            return layout.body + key[len(prefix):]
        return key

    plan, _, problems = _plan(holder, header, to_canonical, layout.to_file(header))
    if problems:
        raise CheckpointError(f"{source}: the checkpoint does not match its config "
                              f"({hf_config.get('model_type')}); nothing was loaded.\n"
                              + "\n".join(problems))
    return CheckedCheckpoint(family, config, model, canonical, header, holder, plan)

def _tie(family: Family, config: object) -> tuple[str, str] | None:
    if not config.tie_weights:  # type: ignore[attr-defined]
        return None
    return family.layout.body + family.layout.anchor, family.layout.heads[0]


def _alias_groups(module: nn.Module) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return list(groups.values())


def _file_shapes(family: Family, config: object, canonical: Mapping[str, object],
                 ours: Mapping[str, nn.Parameter]) -> dict[str, tuple[int, ...]]:
    """Canonical checkpoint key -> shape: the family's, or the model's where the key map only
    renames (checking that the map covers every parameter exactly once)."""
    mapped = [k for v in canonical.values() for k, _ in _targets(v)]
    unknown = sorted(set(mapped) - set(ours))
    uncovered = sorted(set(ours) - set(mapped) - ({"lm_head.weight"}
                                                   if config.tie_weights else set()))  # type: ignore[attr-defined]
    if unknown or uncovered:
        raise RuntimeError(f"the {family.name} key map does not fit CausalLM: names no "
                           f"parameter {unknown}, leaves out {uncovered}")
    if family.file_shapes is not None:
        return dict(family.file_shapes(config))
    return {k: tuple(ours[_targets(v)[0][0]].shape) for k, v in canonical.items()}


# ---- finding the source ------------------------------------------------------------------


def _sibling(name: str) -> ModuleType:
    """``handformer.pretrained.<name>``, imported when first needed (the GGUF package and the
    LLM tokenizer are optional at run time and import heavier libraries)."""
    return importlib.import_module(f"handformer.pretrained.{name}")


def _shipped() -> dict[str, object]:
    return dict(_sibling("gguf.shipped").SHIPPED)  # standard library only: always there


def shipped_names() -> list[str]:
    """The shipped models' names (installed or not: loading one that is not says how to
    install it)."""
    return list(_shipped())


def _not_found(source: object) -> FileNotFoundError:
    if Path(source).suffix.lower() == ".gguf":
        return FileNotFoundError(f"{source}: no such file (a .gguf file was named, and "
                                 "nothing is there)")
    names = ", ".join(_shipped())
    return FileNotFoundError(
        f"no checkpoint folder at {source}: handformer reads local folders (config.json + "
        f"model.safetensors), .gguf files and shipped names ({names}), never a model hub. "
        "Save a hub model as a folder once, where you have the network: `from transformers "
        "import AutoModelForCausalLM, AutoTokenizer; AutoModelForCausalLM.from_pretrained(NAME)"
        ".save_pretrained(DIR); AutoTokenizer.from_pretrained(NAME).save_pretrained(DIR)`")


def resolve_source(source: str | os.PathLike) -> Path:
    """The path of ``source``: a folder, a file in one, a ``.gguf`` file, or a shipped name's
    file.

    Raises:
        TypeError: for a source that is not a string or path.
        FileNotFoundError: for nothing there (the message says what ``load_lm`` reads).
    """
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"source must be a folder, a .gguf file or a shipped model name, got "
                        f"{type(source).__name__}")
    path = Path(source)
    if path.exists():
        return path
    if isinstance(source, str) and source in _shipped():
        return Path(_sibling("gguf.shipped").shipped_path(source))
    raise _not_found(source)


def is_causal_source(source: object) -> bool:
    """Whether ``source`` names something :func:`load_lm` reads: a ``.gguf`` file, a shipped
    name, or a folder whose ``config.json`` has a causal LM's ``model_type``."""
    from handformer.pretrained.families import supported_model_types

    if not isinstance(source, (str, os.PathLike)):
        return False
    path = Path(source)
    if path.suffix.lower() == ".gguf":
        return True
    if not path.exists():
        return isinstance(source, str) and source in _shipped()
    folder = path if path.is_dir() else path.parent
    try:
        model_type = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8")).get(
            "model_type")
    except (OSError, ValueError, AttributeError):
        return False
    return model_type in supported_model_types()


# ---- load_lm -----------------------------------------------------------------------------


def load_lm(source: str | os.PathLike, *, dtype: torch.dtype | None = None,
            device: str | torch.device = "cpu", attention: object = None,
            tokenizer: bool = True, quantize: str | None = None,
            mesh: object = None) -> tuple[CausalLM, object | None]:
    """Load a causal language model (and its tokenizer) onto handformer's layers.

    Args:
        source: a checkpoint folder (``config.json`` + ``model.safetensors`` or a sharded
            ``model.safetensors.index.json``; ``model_type`` ``gpt2``, ``llama``,
            ``mistral``, ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3_text``, ``gemma3`` or a
            ``handformer train`` run), its ``.safetensors`` file, a ``.gguf`` file, or a
            shipped model's name (``smollm2-135m-instruct``, ``gemma3-270m``).
        dtype: parameter dtype (None: float32).
        device: where to put the model.
        attention: an attention kind (or a zero-argument factory) for every layer, replacing
            the configured ones with the same weights (as ``load_bert`` does).
        tokenizer: load the tokenizer too; False loads the model alone, quietly.
        quantize: ``"int8"``: int8 linear layers, quantized tensor by tensor as they are read
            (float32 activations; CPU; :mod:`handformer.models.quantized`). ``"int4"``:
            4-bit weights in groups of 32 where the kernel takes them (a GGUF file's 4-bit
            blocks keep their values; projections it stores wider, and the LM head, stay
            int8), bfloat16 inside each product (:mod:`handformer.models.int4`). None: float.
        mesh: a 1-D ``torch.distributed`` ``DeviceMesh``: tensor parallel, each rank reading
            only its slices of the checkpoint (see :mod:`handformer.distributed`); call it on
            every rank. None: the whole model in this process.

    Returns:
        ``(model, tokenizer)``: the model in eval mode; the folder's tokenizer
        (``tokenizer.json`` and its special tokens; GPT-2's ``vocab.json`` + ``merges.txt``;
        a ``handformer train`` run's character ``vocab.json``: see
        :func:`~handformer.tokenizers.loading.folder_tokenizer`), or None with a
        ``UserWarning`` naming the missing files, or None when ``tokenizer`` is False.

    Raises:
        FileNotFoundError: for nothing at ``source`` (the message says what is read), a
            folder without config or weights.
            A shipped name that is not installed, or whose package is missing, names the
            one command that installs it.
        ModuleNotFoundError: for a ``.gguf`` file where the ``llm`` extra is not installed
            (naming the pip line).
        ValueError: for an unknown ``model_type`` (naming every supported one), a config
            field handformer cannot honour (naming it and its value).
        CheckpointError: (a ``ValueError``) for pickle checkpoints (with the conversion),
            truncated or corrupt files, and keys that do not match the config (every one
            listed, in the file's names); no model is returned.
        TypeError: for a non-floating ``dtype``, a bad ``attention`` or ``tokenizer``.
        ValueError: for a ``quantize`` other than None, ``"int8"`` or ``"int4"`` (or not
            float32 on CPU),
            or ``quantize`` together with ``mesh``.
    """
    if mesh is not None:  # tensor parallel: handformer.pretrained.lm_sharded
        if quantize is not None:
            raise ValueError(f"quantize={quantize!r} cannot be combined with mesh: tensor "
                             "parallel shards float weights only")
        dtype = _check_options(dtype, attention)
        _check_device(device)
        return _sibling("lm_sharded").load_sharded(source, mesh=mesh, dtype=dtype,
                                                   device=device, attention=attention,
                                                   tokenizer=tokenizer)
    return _load(source, dtype=dtype, device=device, attention=attention,
                 tokenizer=tokenizer, caller="load_lm", quantize=quantize)


def load_lm_with_tokenizer(source: str | os.PathLike, *, dtype: torch.dtype | None = None,
                           device: str | torch.device = "cpu", quantize: str | None = None
                           ) -> tuple[CausalLM, object]:
    """:func:`load_lm` for callers that cannot go on without a tokenizer (the ``generate``,
    ``chat``, ``viz`` and ``heads`` commands, the server): a folder without one is an error,
    not a warning and None.

    Args:
        source: as :func:`load_lm`'s.
        dtype: parameter dtype (None: float32).
        device: where to put the model.
        quantize: as :func:`load_lm`'s (``"int8"``, ``"int4"`` or None).

    Returns:
        ``(model, tokenizer)``, the tokenizer never None.

    Raises:
        ValueError: for a folder without a tokenizer, naming the files it lacks; otherwise
            what :func:`load_lm` raises.
    """
    return _load(source, dtype=dtype, device=device, attention=None, tokenizer=True,
                 caller="load_lm", quantize=quantize, required=True)


def _load(source: str | os.PathLike, *, dtype: torch.dtype | None, device: object,
          attention: object, tokenizer: bool, caller: str, expect: str | None = None,
          quantize: str | None = None, required: bool = False
          ) -> tuple[CausalLM, object | None]:
    dtype = _check_options(dtype, attention)
    _check_device(device)
    quantize = check_quantize(quantize, dtype, device)
    if not isinstance(tokenizer, bool):
        raise TypeError(f"tokenizer must be True or False, got {tokenizer!r}")
    path = resolve_source(source)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _load_gguf(path, dtype=dtype, device=device, attention=attention,
                          tokenizer=tokenizer, quantize=quantize)
    if path.is_file():
        check_not_pickle(path)
        folder, state = path.parent, SafetensorsState([path])
    else:
        folder, state = path, None
        if not (path / WEIGHTS_NAME).is_file() and not (path / INDEX_NAME).is_file():
            open_weights(path)  # the reason: pickle only, or no weights
    data = read_config_json(folder)
    model_type = data.get("model_type")
    if expect is not None and model_type != expect:
        raise ValueError(f"model_type is {model_type!r}, {caller} reads {expect!r} checkpoints")
    if model_type == HANDFORMER_TYPE:
        model = CausalLM.from_pretrained(folder, dtype=dtype).to(device)
        if attention is not None:
            swap_attention(model, attention)
        if quantize:  # a handformer run is read whole; quantized afterwards
            quantize_model(model, quantize)
        model.eval()
    else:
        family_for(model_type)  # an unknown type is named before the weights are read
        weights = state if state is not None else open_weights(folder)
        model = build_causal_lm(data, weights, source=_name(weights, folder), dtype=dtype,
                                device=device, attention=attention, quantize=quantize)
    if not tokenizer:
        return model, None
    tok = folder_tokenizer(folder, data)
    if tok is None and required:
        require_tokenizer(tok, folder)  # raises, naming the missing files
    if tok is None:
        warnings.warn(f"{missing_tokenizer_note(folder)}; {caller} returns the model with "
                      f"tokenizer None (pass tokenizer=False to load the model alone without "
                      "this warning)", stacklevel=3)
    return model, tok


def _name(state: SafetensorsState, folder: Path) -> str:
    files = state.files
    return str(files[0]) if len(files) == 1 else str(folder / INDEX_NAME)


def _load_gguf(path: Path, *, dtype: torch.dtype, device: object, attention: object,
               tokenizer: bool, quantize: str | None = None
               ) -> tuple[CausalLM, object | None]:
    """A ``.gguf`` file through :mod:`handformer.pretrained.gguf`."""
    missing = _sibling("gguf.shipped").missing_libraries()
    if missing:
        raise ModuleNotFoundError(f"reading {path} needs the llm extra's libraries: "
                                  f"pip install {' '.join(repr(p) for p in missing)} (in a "
                                  "handformer checkout: make llm)")
    file = _sibling("gguf.reader").read_gguf(path)
    hf_config, state = _sibling("gguf.convert").gguf_state(file, dtype=dtype)  # lazy
    if not tokenizer:
        file = None  # its metadata goes before the weights come
    try:
        model = build_causal_lm(hf_config, state, source=str(path), dtype=dtype,
                                device=device, attention=attention, quantize=quantize)
    except CheckpointError:
        raise
    except ValueError as exc:  # a config the converter's per-key checks let through
        raise CheckpointError(f"{path}: its metadata gives a config handformer cannot run: "
                              f"{exc}") from None
    del state
    if not tokenizer:
        return model, None
    tok = LMTokenizer.from_gguf_metadata(file.metadata,
                                                                  source=str(path))
    return model, tok
