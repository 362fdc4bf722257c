"""Int8 from GGUF blocks (``load_lm(file.gguf, quantize="int8")``).

References: ``gguf.quants.dequantize`` of the file's own blocks (llama.cpp's Python
reference), and the float model loaded from the same tiny file. The int8 weights must be
those blocks' values on each row's int8 grid (outlier columns exact); the embedding is read
from the file row by row (:class:`~handformer.pretrained.gguf.dequant.GGUFRows`), its rows
the file's values bit for bit; chunked dequantization covers every row once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants  # noqa: E402

from gguf_util import tiny_llama_gguf  # noqa: E402
from handformer.models.int8_model import FileEmbedding  # noqa: E402
from handformer.models.quantized import Int8Linear  # noqa: E402
from handformer.pretrained import load_lm  # noqa: E402
from handformer.pretrained.gguf import read_gguf  # noqa: E402
from handformer.pretrained.gguf.dequant import (  # noqa: E402
    GGUFRows,
    dequantize_chunks,
    dequantize_tensor,
)

Q = GGMLQuantizationType


def _blocks(path: Path, name: str) -> torch.Tensor:
    """A tensor of the file through ``gguf.quants.dequantize``, float64."""
    f = read_gguf(path)
    info = f.tensors[name]
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
    rows = quants.dequantize(np.array(raw).reshape(info.shape[0], -1), info.ggml_type)
    return torch.from_numpy(np.array(rows, dtype=np.float64)).reshape(info.shape)


def _on_row_grids(w: torch.Tensor, ref: torch.Tensor, columns: torch.Tensor | None) -> None:
    """``w`` is ``ref`` rounded on each row's int8 grid (half a step at most), ``columns``
    exact."""
    w, ref = w.detach(), ref.detach()
    rest = torch.ones(ref.shape[1], dtype=torch.bool)
    if columns is not None:
        rest[columns] = False
        assert torch.equal(w[:, columns].double(), ref[:, columns])
    step = ref[:, rest].abs().amax(dim=1, keepdim=True) / 127
    assert float(((w.double() - ref)[:, rest].abs() / step).max()) <= 0.5 + 1e-5


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_int8_weights_are_the_blocks_on_row_grids(tmp_path: Path, qtype: Q):
    path = tiny_llama_gguf(tmp_path / "tiny.gguf", qtype=qtype)
    q8, _ = load_lm(path, tokenizer=False, quantize="int8")
    fp, _ = load_lm(path, tokenizer=False)
    names = {"attn.v_proj": "attn_v", "attn.out_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for ours, theirs in names.items():
        layer = q8.get_submodule(f"blocks.0.{ours}")
        assert type(layer) is Int8Linear
        _on_row_grids(layer.weight, _blocks(path, f"blk.0.{theirs}.weight"), layer.exact_columns)
    for ours in ("attn.q_proj", "attn.k_proj"):  # llama.cpp's row permutation undone
        layer = q8.get_submodule(f"blocks.0.{ours}")
        _on_row_grids(layer.weight, fp.get_submodule(f"blocks.0.{ours}").weight.double(),
                      layer.exact_columns)
    # the tied head: the embedding's blocks on row grids; the embedding: the blocks exactly
    embd = _blocks(path, "token_embd.weight")
    _on_row_grids(q8.lm_head.weight, embd, q8.lm_head.exact_columns)
    assert type(q8.tok_emb) is FileEmbedding
    ids = torch.tensor([[3, 0, 15, 3]])
    assert torch.equal(q8.tok_emb(ids).double(), embd[ids])
    assert torch.equal(q8.tok_emb.weight, fp.tok_emb.weight)
    # and the model runs: logits close to the float model's, greedy tokens through the step
    with torch.inference_mode():
        ref, out = fp(ids).logits, q8(ids).logits
        assert float((out - ref).abs().max()) < 0.05 * float(ref.abs().max())
        torch.testing.assert_close(q8.generate(ids, max_new_tokens=4),
                                   q8.generate(ids, max_new_tokens=4, plain_step=False))


def test_file_rows_check_ids_and_the_file(tmp_path: Path):
    path = tiny_llama_gguf(tmp_path / "tiny.gguf", qtype=Q.Q8_0)
    f = read_gguf(path)
    rows = GGUFRows(f, f.tensors["token_embd.weight"])
    table = dequantize_tensor(f, f.tensors["token_embd.weight"])
    assert rows.shape == (16, 32)
    ids = torch.tensor([[1, 1], [7, 15]])
    assert torch.equal(rows(ids), table[ids])
    assert torch.equal(rows(torch.tensor(4)), table[4]) and torch.equal(rows.table(), table)
    with pytest.raises(IndexError, match=r"token_embd.weight: row ids must lie in \[0, 16\), "
                                         r"got 16"):
        rows(torch.tensor([2, 16]))
    with pytest.raises(IndexError, match="got -1"):
        rows(torch.tensor([-1]))
    with pytest.raises(ValueError, match="GGUFRows reads a 2-D tensor"):
        GGUFRows(f, f.tensors["output_norm.weight"])
    with open(path, "ab") as grow:  # the file changed under the model
        grow.write(b"\0" * 32)
    with pytest.raises(ValueError, match="the file changed size since it was read"):
        rows(torch.tensor([1]))


def test_chunks_cover_every_row_once(tmp_path: Path):
    path = tiny_llama_gguf(tmp_path / "tiny.gguf", qtype=Q.Q4_1)
    f = read_gguf(path)
    info = f.tensors["blk.0.ffn_gate.weight"]  # (64, 32)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    for row_order in (None, order):
        whole = dequantize_tensor(f, info, row_order=row_order)
        out = torch.full_like(whole, float("nan"))
        seen = 0
        for rows, values in dequantize_chunks(f, info, row_order=row_order, chunk_values=100):
            assert values.shape == (3, 32) or values.shape[0] == 64 % 3  # 100 values: 3 rows
            out[rows if isinstance(rows, slice) else torch.from_numpy(rows)] = \
                torch.from_numpy(values)
            seen += values.shape[0]
        assert seen == 64 and torch.equal(out, whole)
