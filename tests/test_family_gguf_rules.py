"""A family's GGUF rules live in its family module, and the GGUF converter reads them there.

Each family module declares ``GGUF``: the ``general.architecture`` values of its llama.cpp
files and the fix-ups llama.cpp made (Q/K rows permuted, norms stored as ``w + 1``); which
tensors a file must hold (biases, QK-norm, sandwich norms) follows from the family's own
``config_from_hf``. Here each of those is changed in the family table only, and the
conversion of one tiny llama file changes with it: nothing in ``gguf/convert.py`` repeats
them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from gguf_util import tiny_llama_gguf
from handformer.pretrained import CheckpointError
from handformer.pretrained.families import FAMILIES, GGUF_FAMILIES, gguf_family_for
from handformer.pretrained.gguf import SUPPORTED_ARCHITECTURES, gguf_to_hf

Q, K, V = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gguf import GGMLQuantizationType

    return tiny_llama_gguf(tmp_path_factory.mktemp("rules") / "tiny.gguf",
                           qtype=GGMLQuantizationType.F32)


def _with_rules(monkeypatch: pytest.MonkeyPatch, arch: str, **changes: object) -> None:
    family = GGUF_FAMILIES[arch]
    monkeypatch.setitem(GGUF_FAMILIES, arch, dataclasses.replace(
        family, gguf=dataclasses.replace(family.gguf, **changes)))


def test_the_supported_architectures_are_the_families_declarations() -> None:
    assert SUPPORTED_ARCHITECTURES == ("gemma2", "gemma3", "gpt2", "llama", "qwen2", "qwen3")
    assert {arch: f.name for arch, f in GGUF_FAMILIES.items()} == {
        "llama": "llama", "qwen2": "qwen", "qwen3": "qwen", "gemma2": "gemma",
        "gemma3": "gemma", "gpt2": "gpt2"}
    for family in set(FAMILIES.values()):  # every family reads GGUF files, none twice
        assert family.gguf is not None and family.gguf.architectures, family.name
    with pytest.raises(ValueError, match=r"'mamba' is not supported; supported architectures:"
                                         r" gemma2, gemma3, gpt2, llama, qwen2, qwen3"):
        gguf_family_for("mamba")


def test_the_qk_permutation_is_the_family_rule(llama_file: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _, permuted = gguf_to_hf(llama_file)
    _with_rules(monkeypatch, "llama", permuted_qk=False)
    _, plain = gguf_to_hf(llama_file)
    assert not torch.equal(plain[Q], permuted[Q]) and not torch.equal(plain[K], permuted[K])
    assert torch.equal(plain[V], permuted[V])
    assert sorted(plain[Q].flatten().tolist()) == sorted(permuted[Q].flatten().tolist())


def test_the_norm_offset_is_the_family_rule(llama_file: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    _, stored = gguf_to_hf(llama_file)
    _with_rules(monkeypatch, "llama", norms_plus_one=True)
    _, shifted = gguf_to_hf(llama_file)
    norms = [k for k in stored if k.endswith("norm.weight")]
    assert len(norms) == 3
    for key in norms:
        assert torch.equal(shifted[key], stored[key] - 1), key
    assert torch.equal(shifted[Q], stored[Q])


@pytest.mark.parametrize(("feature", "missing"), [
    ("qk_norm", "blk.0.attn_q_norm.weight"),
    ("out_bias", "blk.0.attn_output.bias"),
    ("sandwich_norm", "blk.0.post_attention_norm.weight"),
])
def test_the_tensors_follow_the_family_config(llama_file: Path,
                                              monkeypatch: pytest.MonkeyPatch, feature: str,
                                              missing: str) -> None:
    """The family's config_from_hf, not a rule in the converter, says which tensors a file
    holds: a family that read the same metadata with one more feature wants one more tensor."""
    family = GGUF_FAMILIES["llama"]

    def config_from_hf(hf: dict) -> object:
        return dataclasses.replace(family.config_from_hf(hf), **{feature: True})

    monkeypatch.setitem(GGUF_FAMILIES, "llama",
                        dataclasses.replace(family, config_from_hf=config_from_hf))
    with pytest.raises(CheckpointError, match=f"missing: {missing}"):
        gguf_to_hf(llama_file)


def test_a_family_refusal_is_the_files(llama_file: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    family = GGUF_FAMILIES["llama"]

    def config_from_hf(hf: dict) -> object:
        raise ValueError("llama config field hidden_act='relu6': not supported")

    monkeypatch.setitem(GGUF_FAMILIES, "llama",
                        dataclasses.replace(family, config_from_hf=config_from_hf))
    with pytest.raises(CheckpointError, match=r"tiny\.gguf: metadata: the llama family refuses "
                                              r"the config it implies: llama config field "
                                              r"hidden_act='relu6'"):
        gguf_to_hf(llama_file)
