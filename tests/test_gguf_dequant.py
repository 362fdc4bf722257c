"""dequantize_tensor: bit for bit ``gguf.quants.dequantize``, a chunk of rows at a time.

Every type the two shipped files use is checked on their own tensors; every other type
``gguf`` can dequantize on random blocks written here (``gguf`` quantizes only a few types,
so K-quant and IQ blocks are random bytes with finite float16 scale fields).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

import handformer.pretrained.gguf.dequant as dequant_module
from gguf_util import F16_FIELDS, random_blocks, tiny_llama_gguf, write_gguf
from handformer.pretrained import CheckpointError
from handformer.pretrained.gguf import (
    TensorInfo,
    dequantize_tensor,
    read_gguf,
    shipped_path,
    supported_types,
)

Q = GGMLQuantizationType


def reference(path: Path, info: TensorInfo) -> torch.Tensor:
    """The whole tensor through ``gguf.quants.dequantize`` at once (float32)."""
    rows = info.numel // info.shape[-1]
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=info.offset,
                    shape=(rows, info.nbytes // rows))
    return torch.from_numpy(np.array(quants.dequantize(raw, info.ggml_type))).reshape(info.shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype == torch.float32 and \
        torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_every_type_in_the_shipped_files(name: str) -> None:
    """Per type: its smallest and its largest tensor (Gemma's 168M-value embedding aside)."""
    f = read_gguf(shipped_path(name))
    by_type: dict[Q, list[TensorInfo]] = {}
    for info in f.tensors.values():
        if info.name != "token_embd.weight" or name.startswith("smollm2"):
            by_type.setdefault(info.ggml_type, []).append(info)
    expected = {"smollm2-135m-instruct": {Q.F32, Q.Q4_1, Q.Q8_0},
                "gemma3-270m": {Q.F32, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K}}[name]
    assert set(by_type) == expected
    for infos in by_type.values():
        for info in {min(infos, key=lambda t: t.numel), max(infos, key=lambda t: t.numel)}:
            assert same_bits(dequantize_tensor(f, info), reference(f.path, info)), info.name


def test_chunking_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    f = read_gguf(shipped_path("smollm2-135m-instruct"))
    info = f.tensors["blk.0.ffn_down.weight"]  # (576, 1536) Q4_1
    whole = dequantize_tensor(f, info)
    monkeypatch.setattr(dequant_module, "CHUNK_VALUES", 1536 * 7)  # 7 rows per chunk, 83 chunks
    assert same_bits(dequantize_tensor(f, info), whole)


ALL = sorted(supported_types(), key=lambda t: t.value)


@pytest.mark.parametrize("qtype", ALL, ids=[t.name for t in ALL])
def test_every_supported_type_from_random_blocks(qtype: Q, tmp_path: Path) -> None:
    rng = np.random.default_rng(qtype.value)
    block = 256 if qtype in (Q.F32, Q.F16, Q.BF16) else quants.GGML_QUANT_SIZES[qtype][0]
    rows, cols = 6, 4 * block
    if qtype == Q.F32:
        tensor = rng.standard_normal((rows, cols)).astype(np.float32)
    elif qtype == Q.F16:
        tensor = rng.standard_normal((rows, cols)).astype(np.float16)
    else:
        tensor = (random_blocks(qtype, rows, cols, rng), qtype)
    path = write_gguf(tmp_path / "t.gguf", "llama", {}, {"w": tensor})
    f = read_gguf(path)
    info = f.tensors["w"]
    assert info.shape == (rows, cols) and info.ggml_type == qtype
    ref = reference(path, info)
    assert torch.isfinite(ref).all(), "the scale fields written should be finite"
    assert ref.abs().sum() > 0
    assert same_bits(dequantize_tensor(f, info), ref)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):  # rounded once, from float32
        assert torch.equal(dequantize_tensor(f, info, dtype=dtype), ref.to(dtype))
    for at in F16_FIELDS.get(qtype, ()):  # the listed offsets are the scales: NaN there shows
        raw = tensor[0].copy()
        raw[0, at:at + 2] = np.array([np.nan], np.float16).view(np.uint8)
        with np.errstate(invalid="ignore"):
            assert np.isnan(quants.dequantize(raw, qtype)[0, :block]).any(), at


def test_every_dequantizable_type_is_covered() -> None:
    """The K-quants, the IQ types and the 32-blocks are all among the supported types."""
    names = {t.name for t in supported_types()}
    assert {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
            "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
            "IQ3_S", "IQ4_NL", "IQ4_XS"} <= names


def test_three_dimensional_tensor(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    raw = random_blocks(Q.Q4_K, 2 * 3, 512, rng).reshape(2, 3, -1)
    path = write_gguf(tmp_path / "t.gguf", "llama", {}, {"w": (raw, Q.Q4_K)})
    f = read_gguf(path)
    assert f.tensors["w"].shape == (2, 3, 512)
    assert same_bits(dequantize_tensor(f, f.tensors["w"]), reference(path, f.tensors["w"]))


def test_row_order_and_offset(tmp_path: Path) -> None:
    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    f = read_gguf(write_gguf(tmp_path / "t.gguf", "llama", {}, {"w": w}))
    order = torch.tensor([2, 0, 3, 1])
    out = dequantize_tensor(f, f.tensors["w"], row_order=order, offset=-1.0)
    expected = torch.empty(4, 6)
    expected[order] = torch.from_numpy(w) - 1
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match=r"row_order must have shape \(4,\)"):
        dequantize_tensor(f, f.tensors["w"], row_order=torch.arange(3))


def test_out_is_written_in_place(tmp_path: Path) -> None:
    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    f = read_gguf(write_gguf(tmp_path / "t.gguf", "llama", {}, {"w": w}))
    memory = torch.full((10, 6), -7.0)  # a loader's packed tensor: w goes into rows 3..6
    order = torch.tensor([2, 0, 3, 1])
    result = dequantize_tensor(f, f.tensors["w"], row_order=order, offset=-1.0,
                               out=memory[3:7])
    assert result.data_ptr() == memory[3].data_ptr()  # no new memory
    expected = torch.empty(4, 6)
    expected[order] = torch.from_numpy(w) - 1
    assert torch.equal(memory[3:7], expected)
    assert (memory[:3] == -7).all() and (memory[7:] == -7).all()  # nothing else written
    bad_outs = {r"\(4, 5\) torch.float32": torch.empty(4, 5),
                r"\(4, 6\) torch.float64": torch.empty(4, 6).double(),
                r"\(4, 6\) torch.float32": torch.empty(6, 4).t()}  # not contiguous
    for what, bad in bad_outs.items():
        with pytest.raises(ValueError, match=rf"out must be a contiguous CPU tensor of shape "
                                             rf"\(4, 6\) .* for tensor 'w', got {what} on cpu"):
            dequantize_tensor(f, f.tensors["w"], out=bad)


def test_refusals(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "t.gguf", "llama", {},
                      {"ints": np.arange(32, dtype=np.int32),
                       "nan": np.array([[1.0, np.nan], [0.0, 1.0]], np.float32)})
    f = read_gguf(path)
    with pytest.raises(CheckpointError, match=r"tensor 'ints' type: I32 cannot be dequantized"):
        dequantize_tensor(f, f.tensors["ints"])
    with pytest.raises(CheckpointError, match=r"tensor 'nan': row 0 holds NaN"):
        dequantize_tensor(f, f.tensors["nan"])
    with pytest.raises(TypeError, match="dtype must be a floating"):
        dequantize_tensor(f, f.tensors["nan"], dtype=torch.int32)


def test_a_file_that_shrank_after_reading(tmp_path: Path) -> None:
    path = tiny_llama_gguf(tmp_path / "t.gguf")
    f = read_gguf(path)
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(CheckpointError, match="changed size since it was read"):
        dequantize_tensor(f, f.tensors["blk.0.ffn_down.weight"])


def test_damaged_scale_is_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    raw = random_blocks(Q.Q8_0, 4, 64, rng)
    raw[2, 34:36] = np.array([np.inf], np.float16).view(np.uint8)  # row 2, block 1's scale
    f = read_gguf(write_gguf(tmp_path / "t.gguf", "llama", {}, {"w": (raw, Q.Q8_0)}))
    with pytest.raises(CheckpointError, match=r"tensor 'w': row 2 holds NaN or infinite"):
        dequantize_tensor(f, f.tensors["w"])
