"""``load_lm(source, mesh=mesh)``: each rank of a tensor-parallel mesh reads its slices.

The model is built on the ``meta`` device and the checkpoint checked against it exactly as
:func:`~handformer.pretrained.build_causal_lm` does (every missing, unexpected or mis-shaped
key reported); then :func:`handformer.distributed.parallelize` asks for this rank's rows and
columns of each parameter, and they are read from the file alone:

* safetensors: ``safe_open(...).get_slice(key)[rows]`` (or ``[:, cols]``), memory-mapped;
* GGUF: the tensor's bytes memory-mapped; a row range is whole rows of blocks, a column
  range is widened to block boundaries (32 values for Q4_1/Q8_0, 256 for K-quants), the
  surplus dequantized and dropped; llama.cpp's Q/K row permutation stays inside each head,
  so a head's rows are undone with that head's order.

No rank holds the whole model; a checkpoint tensor that a family's key map transforms
(GPT-2's fused ``c_attn``) is read whole, one tensor at a time, and sliced after.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from safetensors import safe_open
from torch import Tensor

from handformer.distributed import parallelize
from handformer.distributed.shards import agree
from handformer.legacy_names import legacy_key_map
from handformer.models.causal_lm import CausalLM, read_config
from handformer.pretrained import lm
from handformer.pretrained.families import HANDFORMER_TYPE
from handformer.pretrained.folders import read_config_json
from handformer.pretrained.on_meta import parameters_on_meta
from handformer.weights import CheckpointError

__all__ = ["load_sharded"]


def load_sharded(source: str | os.PathLike, *, mesh: object, dtype: torch.dtype,
                 device: object, attention: object, tokenizer: bool, vocab: str = "replicate"
                 ) -> tuple[CausalLM, object | None]:
    """What ``load_lm(source, mesh=mesh)`` returns, this rank's part of the model.

    Args:
        source: as :func:`~handformer.pretrained.load_lm` (a folder, a safetensors or GGUF
            file, a shipped name).
        mesh: the 1-D ``DeviceMesh`` of the ranks that share the model.
        dtype, device, attention, tokenizer: as :func:`~handformer.pretrained.load_lm`.
        vocab: the embedding and LM head ``"replicate"``-d or ``"shard"``-ed by token id
            (see :func:`handformer.distributed.parallelize`).

    Returns:
        ``(model, tokenizer)``: this rank's part of the model (eval mode), the tokenizer.

    Raises:
        TypeError: for a ``mesh`` that is not a ``DeviceMesh``.
        CheckpointError: on every rank, naming the first rank that failed and its file,
            when any rank could not open its checkpoint or read its slices.
    """
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed DeviceMesh "
                        f"(init_device_mesh('cpu', (N,))), got {type(mesh).__name__}")
    error, model, read, name = None, None, None, str(source)
    try:
        path = lm.resolve_source(source)
        name = str(path)
        model, read, folder, data = _open(path, dtype)
    except Exception as exc:  # every rank hears of it (agree), then raises it
        error = exc if name in str(exc) else CheckpointError(f"{name}: {exc}")
    agree(error, mesh.get_group(), "load its part of the model")
    parallelize(model, mesh, read=read, vocab=vocab, device=torch.device(device))
    if attention is not None:
        lm.swap_attention(model, attention)
    if not tokenizer:
        return model, None
    if folder is None:  # GGUF
        file = lm._sibling("gguf.reader").read_gguf(path)
        return model, lm.LMTokenizer.from_gguf_metadata(
            file.metadata, source=str(path))
    return model, lm.folder_tokenizer(folder, data)


def _open(path: Path, dtype: torch.dtype
          ) -> tuple[CausalLM, Callable, Path | None, dict]:
    """The model on ``meta``, checked against the checkpoint, and its slice reader."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        file = lm._sibling("gguf.reader").read_gguf(path)
        hf_config, state = lm._sibling("gguf.convert").gguf_state(file, dtype=dtype)
        model, where = _checked(hf_config, state, str(path))
        return (model, _gguf_reader(state, where, dtype, int(hf_config["head_dim"])), None,
                hf_config)
    if path.is_file():
        folder, state = path.parent, lm.SafetensorsState([path])
    else:
        folder, state = path, lm.open_weights(path)
    data = read_config_json(folder)
    if data.get("model_type") == HANDFORMER_TYPE:
        with parameters_on_meta():
            model = CausalLM(read_config(folder / "config.json"))
        old = {new: old for old, new in legacy_key_map(model).items()}  # files before 0.x
        where = {k: (k if k in state.header else old.get(k, k), None)
                 for k in dict(model.named_parameters())}
        missing = sorted({f for f, _ in where.values()} - set(state.header))
        if missing:
            raise CheckpointError(f"{state.files[0]}: missing {missing}")
        return model, _safetensors_reader(state, where, dtype), folder, data
    model, where = _checked(data, state, lm._name(state, folder))
    return model, _safetensors_reader(state, where, dtype), folder, data


def _checked(hf_config: dict, state: object, source: str
             ) -> tuple[CausalLM, dict[str, tuple[str, object]]]:
    """:func:`~handformer.pretrained.build_causal_lm`'s checks, reading nothing: the model on
    ``meta`` and, per parameter, ``(checkpoint key, transform or None)``."""
    checked = lm.check_against_config(hf_config, state, source)
    model, canonical, holder, plan = (checked.model, checked.canonical, checked.holder,
                                      checked.plan)
    aliases = {n: group[0] for group in lm._alias_groups(holder) for n in group}
    where = {}
    for file_key, target, _ in plan:
        for our_key, transform in lm._targets(canonical[aliases[target]]):
            where[our_key] = (file_key, transform)
    return model, where


def _span(index: Tensor | None) -> tuple[slice, Tensor | None]:
    """The contiguous range covering ``index`` and the positions inside it (None: in order,
    the whole range)."""
    if index is None:
        return slice(None), None
    lo, hi = int(index.min()), int(index.max()) + 1
    inside = index - lo
    return slice(lo, hi), None if torch.equal(inside, torch.arange(hi - lo)) else inside


def _pick(t: Tensor, rows: Tensor | None, cols: Tensor | None) -> Tensor:
    """``t[rows][:, cols]`` (None: all)."""
    if rows is not None:
        t = t.index_select(0, rows)
    if cols is not None:
        t = t.index_select(1, cols)
    return t


def _safetensors_reader(state: lm.SafetensorsState, where: dict, dtype: torch.dtype
                        ) -> Callable[[str, Tensor | None, Tensor | None], Tensor]:
    def read(name: str, rows: Tensor | None, cols: Tensor | None) -> Tensor:
        key, transform = where[name]
        path = state._where[key][0]
        try:
            with safe_open(str(path), framework="pt") as f:
                if transform is not None:  # a fused tensor: read it, transform, then slice
                    return _pick(transform(f.get_tensor(key)), rows, cols).to(dtype)
                part = f.get_slice(key)
                (r, r_in), (c, c_in) = _span(rows), _span(cols)
                if len(part.get_shape()) == 1:
                    return _pick(part[r], r_in, None).to(dtype)
                return _pick(part[r, c], r_in, c_in).to(dtype)
        except Exception as exc:
            raise CheckpointError(f"{path}: tensor {key}: {exc}") from exc
    return read


def _gguf_reader(state: object, where: dict, dtype: torch.dtype, head_dim: int
                 ) -> Callable[[str, Tensor | None, Tensor | None], Tensor]:
    file, orders = state._file, state._orders  # type: ignore[attr-defined]

    def read(name: str, rows: Tensor | None, cols: Tensor | None) -> Tensor:
        key, transform = where[name]
        gguf_name, fixup = state._where[key]  # type: ignore[attr-defined]
        info = file.tensors[gguf_name]
        if transform is not None or len(info.shape) != 2 or fixup == "transpose" or \
                (rows is None and cols is None):
            whole = state[key]  # type: ignore[index]  # one tensor, dequantized whole
            whole = whole if transform is None else transform(whole)
            return _pick(whole, rows, cols).to(dtype)
        (r, r_in), (c, c_in) = _span(rows), _span(cols)
        part = _dequantize_part(file, info, r, c)  # (rows of r, cols of c) float32, file order
        if fixup in orders:  # whole heads' rows: undo llama.cpp's permutation head by head
            order = lm._sibling("gguf.convert").llama_row_order(part.shape[0] // head_dim,
                                                                head_dim)
            fixed = torch.empty_like(part)
            fixed[order] = part  # file row i -> HF row order[i], inside these heads
            part = fixed
        return _pick(part, r_in, c_in).to(dtype)
    return read


def _dequantize_part(file: object, info: object, rows: slice, cols: slice) -> Tensor:
    """Rows ``rows`` and columns ``cols`` of a 2-D GGUF tensor, from its memory-mapped blocks
    alone (columns widened to whole blocks, the surplus dropped), as float32."""
    R, C = info.shape  # type: ignore[attr-defined]
    r0, r1, _ = rows.indices(R)
    c0, c1, _ = cols.indices(C)
    block, type_size = GGML_QUANT_SIZES[info.ggml_type]  # type: ignore[attr-defined]
    b0, b1 = c0 // block, -(-c1 // block)  # whole blocks covering [c0, c1)
    raw = np.memmap(file.path, dtype=np.uint8, mode="r",  # type: ignore[attr-defined]
                    offset=info.offset, shape=(R, C // block * type_size))  # type: ignore[attr-defined]
    data = np.ascontiguousarray(raw[r0:r1, b0 * type_size:b1 * type_size])
    values = quants.dequantize(data, info.ggml_type).astype(np.float32, copy=False)
    values = values.reshape(r1 - r0, (b1 - b0) * block)[:, c0 - b0 * block:c1 - b0 * block]
    if not np.isfinite(values).all():
        raise file.error(f"tensor {info.name!r}",  # type: ignore[attr-defined]
                         f"rows {r0}-{r1 - 1} hold NaN or infinite values")
    return torch.from_numpy(np.ascontiguousarray(values))
