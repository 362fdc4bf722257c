"""Loader fuzzing: damaged safetensors files and mismatched checkpoints fail cleanly.

Tiny random BERT and GPT-2 checkpoints are written by ``transformers`` into ``tmp_path``; a
``CausalLM`` folder and a training checkpoint are written by handformer. Each is then damaged:
truncated at many points, header-length field corrupted, header bytes bit-flipped, header
replaced by bad JSON or impossible entries, tensors with wrong shapes or dtypes, missing,
extra or renamed keys. Every load must either raise a clear error (``CheckpointError``, a
``ValueError``, or ``FileNotFoundError``) and leave the target model's parameters unchanged
(hashed before and after), or -- only for a header flip that leaves the file meaning the same
thing, e.g. inside ``__metadata__`` -- load exactly the original tensors.

Bit flips inside the tensor *data* cannot be detected by the safetensors format (it has no
checksum); training checkpoints carry SHA-256 sums, so there they are refused too.
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import handformer as hf
from handformer.pretrained import (
    BertConfig,
    BertModel,
    CheckpointError,
    bert_key_map,
    load_bert,
    load_safetensors,
)
from handformer.pretrained.gpt2 import load_gpt2
from handformer.train.checkpoint import load_checkpoint, save_checkpoint
from pretrained_util import state_hash, tiny_checkpoint

CLEAR_ERRORS = (CheckpointError, ValueError, FileNotFoundError)
CHECKPOINT_OR_VALUE = (CheckpointError, ValueError)

# ---- damage ---------------------------------------------------------------------------------


def header_len(data: bytes) -> int:
    return struct.unpack("<Q", data[:8])[0]


def truncations(data: bytes) -> dict[str, bytes]:
    n = header_len(data)
    cuts = {"empty": 0, "4 bytes": 4, "length only": 8, "mid-header": 8 + n // 2,
            "header only": 8 + n, "mid-data": 8 + n + (len(data) - 8 - n) // 2,
            "last byte missing": len(data) - 1}
    return {f"truncated: {k}": data[:v] for k, v in cuts.items()}


def length_field(data: bytes) -> dict[str, bytes]:
    n = header_len(data)
    return {f"header length {v}": struct.pack("<Q", v) + data[8:]
            for v in (0, 1, n - 1, n + 1, len(data), 2**63 - 1)}


def header_bit_flips(data: bytes, count: int = 24) -> dict[str, bytes]:
    n = header_len(data)
    out = {}
    for i in range(count):
        pos = 8 + (i * 7919) % n  # spread over the whole header
        flipped = bytearray(data)
        flipped[pos] ^= 1 << (i % 8)
        out[f"bit {i % 8} of header byte {pos - 8} flipped"] = bytes(flipped)
    return out


def rewritten_headers(data: bytes) -> dict[str, bytes]:
    n = header_len(data)
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    key = next(k for k in header if k != "__metadata__")

    def with_header(h: object) -> bytes:
        raw = json.dumps(h).encode()
        return struct.pack("<Q", len(raw)) + raw + body

    def edited(**change: object) -> dict:
        return {**header, key: {**header[key], **change}}

    first_end = header[key]["data_offsets"][1]
    return {
        "header is a JSON list": with_header([1, 2, 3]),
        "header is not JSON": struct.pack("<Q", 9) + b"{not json" + body,
        "header not UTF-8": struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc" + body,
        "unknown dtype": with_header(edited(dtype="F33")),
        "negative shape": with_header(edited(shape=[-1])),
        "offsets past the end": with_header(edited(data_offsets=[0, len(body) + 64])),
        "offsets overlap": with_header(edited(data_offsets=[0, first_end + 4])),
        "tensor entry missing dtype": with_header({**header, key: {
            k: v for k, v in header[key].items() if k != "dtype"}}),
    }


def all_byte_damage(data: bytes) -> dict[str, bytes]:
    return {**truncations(data), **length_field(data), **header_bit_flips(data),
            **rewritten_headers(data)}


def state_edits(state: dict[str, torch.Tensor]) -> dict[str, Callable[[dict], None]]:
    """Ways to make a well-formed file that does not match the model."""
    keys = sorted(state)
    matrix = next(k for k in keys if state[k].dim() == 2 and state[k].shape[0] !=
                  state[k].shape[1])
    vector = next(k for k in keys if state[k].dim() == 1)

    def put(key: str, value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
        return lambda s: s.__setitem__(key, value(s[key]))

    return {
        "transposed matrix": put(matrix, lambda t: t.t().contiguous()),
        "vector one longer": put(vector, lambda t: torch.cat([t, t[:1]])),
        "extra dimension": put(vector, lambda t: t[None]),
        "int64 weights": put(matrix, lambda t: t.long()),
        "bool weights": put(vector, lambda t: t > 0),
        "missing key": lambda s: s.pop(vector),
        "extra key": lambda s: s.__setitem__("extra.weight", torch.zeros(3)),
        "renamed key": lambda s: s.__setitem__(vector + "_renamed", s.pop(vector)),
    }


# ---- checks ---------------------------------------------------------------------------------


def check_damaged_load(model: torch.nn.Module, path: Path, key_map, original: dict) -> str:
    """Load a damaged file into ``model``: error with the model untouched, or exact load."""
    before = state_hash(model)
    try:
        load_safetensors(model, path, key_map)
    except CLEAR_ERRORS as exc:
        assert state_hash(model) == before, f"model changed by a failed load ({exc})"
        assert str(path.name) in str(exc) or isinstance(exc, FileNotFoundError), str(exc)
        return "refused"
    # accepted: the damage must have been harmless (same tensors as the original file)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    return "accepted" if all(torch.equal(fresh[k], original[k]) for k in original) else "WRONG"


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BertConfig, dict]:
    folder = tmp_path_factory.mktemp("bert")
    tiny_checkpoint(folder, hidden_size=16, layers=1, heads=2, intermediate=24)
    config = BertConfig.from_dict(json.loads((folder / "config.json").read_text()))
    model = BertModel(config)
    load_safetensors(model, folder / "model.safetensors", bert_key_map(False))
    return folder, config, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1,
                                     n_head=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.GPT2LMHeadModel(config).save_pretrained(folder, safe_serialization=True)
    return folder


def copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_bert_byte_damage(bert, tmp_path: Path) -> None:
    folder, config, original = bert
    data = (folder / "model.safetensors").read_bytes()
    damage = all_byte_damage(data)
    model = BertModel(config)
    outcomes = {}
    for label, bad in damage.items():
        path = tmp_path / "model.safetensors"
        path.write_bytes(bad)
        outcomes[label] = check_damaged_load(model, path, bert_key_map(False), original)
    assert "WRONG" not in outcomes.values(), outcomes
    assert all(outcomes[k] == "refused" for k in outcomes if not k.startswith("bit")), outcomes
    assert list(outcomes.values()).count("refused") >= len(damage) - 6  # flips mostly refused
    # and through load_bert (a whole folder): every truncation is a CheckpointError
    target = copy_folder(folder, tmp_path / "folder")
    for label, bad in truncations(data).items():
        (target / "model.safetensors").write_bytes(bad)
        with pytest.raises(CheckpointError, match="truncated or corrupt"):
            load_bert(target)
        assert label


def test_bert_mismatched_state(bert, tmp_path: Path) -> None:
    folder, config, _ = bert
    state = load_file(folder / "model.safetensors")
    model = BertModel(config)
    before = state_hash(model)
    for label, edit in state_edits(state).items():
        edited = {k: v.clone() for k, v in state.items()}
        edit(edited)
        path = tmp_path / "model.safetensors"
        save_file(edited, path)
        with pytest.raises(CheckpointError, match="nothing was loaded") as info:
            load_safetensors(model, path, bert_key_map(False))
        message = str(info.value)
        assert any(w in message for w in ("missing keys", "unexpected keys", "mis-shaped",
                                          "unsupported dtypes")), (label, message)
        assert state_hash(model) == before, label


def test_gpt2_damage(gpt2: Path, tmp_path: Path) -> None:
    data = (gpt2 / "model.safetensors").read_bytes()
    target = copy_folder(gpt2, tmp_path / "g")
    refused = 0
    damage = {**truncations(data), **length_field(data), **rewritten_headers(data)}
    for label, bad in damage.items():
        (target / "model.safetensors").write_bytes(bad)
        with pytest.raises(CheckpointError, match="model.safetensors") as info:
            load_gpt2(target)
        assert "Traceback" not in str(info.value), label
        refused += 1
    state = load_file(gpt2 / "model.safetensors")
    for _label, edit in state_edits(state).items():
        edited = {k: v.clone() for k, v in state.items()}
        edit(edited)
        save_file(edited, target / "model.safetensors")
        with pytest.raises(CheckpointError, match="nothing was loaded"):
            load_gpt2(target)
        refused += 1
    assert refused == len(damage) + 8


def test_causal_lm_from_pretrained_and_load_into_existing(tmp_path: Path) -> None:
    config = hf.CausalLMConfig(vocab_size=23, max_len=16, d_model=8, num_heads=2,
                               num_layers=1, d_ff=16)
    source = hf.CausalLM(config)
    folder = source.save_pretrained(tmp_path / "lm")
    data = (folder / "model.safetensors").read_bytes()
    original = {k: v.clone() for k, v in source.state_dict().items()}
    target = hf.CausalLM(config)  # different random weights
    outcomes = {}
    for label, bad in all_byte_damage(data).items():
        (folder / "model.safetensors").write_bytes(bad)
        outcomes[label] = check_damaged_load(target, folder / "model.safetensors", None,
                                             original)
        if outcomes[label] == "refused":
            with pytest.raises(CHECKPOINT_OR_VALUE):
                hf.CausalLM.from_pretrained(folder)
        else:  # harmless: reset the target for the next case
            target = hf.CausalLM(config)
    assert "WRONG" not in outcomes.values(), outcomes
    (folder / "model.safetensors").write_bytes(data)
    (folder / "config.json").write_text('{"model_type": "handformer-causal-lm", "d_model": ')
    with pytest.raises(ValueError, match="not valid JSON"):
        hf.CausalLM.from_pretrained(folder)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf.CausalLM.from_pretrained(folder)



def test_training_checkpoint_damage_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    config = hf.CausalLMConfig(vocab_size=11, max_len=8, d_model=8, num_heads=2, num_layers=1,
                               d_ff=16)
    model = hf.CausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 11, (2, 8))).logits.sum().backward()
    opt.step()
    ckpt = save_checkpoint(tmp_path / "run", 1, model, opt, {"note": "x"},
                           {"cpu": torch.get_rng_state()})
    files = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    target = hf.CausalLM(config)
    target_opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
    expected = json.loads(files["config.json"])
    refused = 0
    for name, data in files.items():
        damage = {"truncated": data[: len(data) // 2], "empty": b"",
                  "data bit flip": data[:-3] + bytes([data[-3] ^ 0x10]) + data[-2:]}
        for label, bad in damage.items():
            (ckpt / name).write_bytes(bad)
            before = (state_hash(target), repr(target_opt.state_dict()))
            with pytest.raises(CheckpointError) as info:
                load_checkpoint(ckpt, target, target_opt, expected)
            assert name in str(info.value) or "manifest" in str(info.value), (name, label)
            assert (state_hash(target), repr(target_opt.state_dict())) == before
            refused += 1
        (ckpt / name).write_bytes(data)
    assert refused == 3 * len(files)
    load_checkpoint(ckpt, target, target_opt, expected)  # the undamaged one loads
    assert state_hash(target) == state_hash(model)
