"""Training building blocks: schedules, tasks, data, vocabulary, checkpoints."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from handformer.models.causal_lm import CausalLM, CausalLMConfig
from handformer.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from handformer.train.data import CharVocab, batch_generator, shard_rows
from handformer.train.schedule import Schedule
from handformer.train.tasks import IGNORE, SEPARATOR, LMTask, SequenceTask

# ---- schedules -----------------------------------------------------------------------------


def test_cosine_schedule_matches_formula() -> None:
    s = Schedule("cosine", 1e-3, warmup=10, total=110, min_lr_ratio=0.1)
    assert s(0) == pytest.approx(1e-4)
    assert s(9) == pytest.approx(1e-3)  # end of warm-up: the peak
    assert s(60) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))))
    assert s(110) == pytest.approx(1e-4)  # the floor
    lrs = [s(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))  # monotone decay


def test_inverse_sqrt_is_the_noam_schedule_rescaled() -> None:
    d_model, warmup = 512, 4000
    s = Schedule("inverse_sqrt", 2.0, warmup=warmup, total=1)

    def noam(step: int) -> float:  # Vaswani et al., eq. (3), step counted from 1
        return d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)

    peak = noam(warmup)
    for step in (1, 100, 3999, 4000, 4001, 20000, 10 ** 6):
        assert s(step - 1) == pytest.approx(2.0 * noam(step) / peak)


@pytest.mark.parametrize("kwargs, word", [
    ({"kind": "linear"}, "schedule"), ({"lr": -0.1}, "lr"), ({"lr": float("nan")}, "lr"),
    ({"warmup": -1}, "warmup"), ({"total": 0}, "steps"), ({"min_lr_ratio": 2.0}, "min_lr"),
])
def test_schedule_rejects_bad_values(kwargs: dict, word: str) -> None:
    args = {"kind": "cosine", "lr": 1e-3, "warmup": 1, "total": 10, **kwargs}
    with pytest.raises(ValueError, match=word):
        Schedule(**args)


# ---- tasks and data ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["copy", "reverse", "sort"])
def test_sequence_task_layout(name: str) -> None:
    task = SequenceTask(name, length=5, num_symbols=7, eval_size=50)
    b = task.batch(seed=3, step=11, micro_step=0, size=32)
    assert b.input_ids.shape == b.targets.shape == (32, 10)
    v = task.vocab
    for ids, tgt in zip(b.input_ids.tolist(), b.targets.tolist(), strict=True):
        text = v.decode(ids)
        x, y_prefix = text.split(SEPARATOR)
        expected = {"copy": x, "reverse": x[::-1], "sort": "".join(sorted(x))}[name]
        assert y_prefix == expected[:-1]
        assert tgt[:5] == [IGNORE] * 5  # no loss on the input or the separator
        assert v.decode(tgt[5:]) == expected


def test_training_never_draws_held_out_sequences() -> None:
    task = SequenceTask("reverse", length=3, num_symbols=4, eval_size=24)  # 64 sequences
    held_out = {task.vocab.decode(b.input_ids[i, :3])
                for b in task.eval_batches(8) for i in range(b.input_ids.shape[0])}
    assert len(held_out) == 24
    for step in range(20):
        b = task.batch(0, step, 0, 64)
        drawn = {task.vocab.decode(row[:3]) for row in b.input_ids}
        assert not drawn & held_out


def test_batches_are_a_function_of_seed_and_step() -> None:
    task = SequenceTask("sort")
    a, b = task.batch(1, 7, 0, 16), task.batch(1, 7, 0, 16)
    assert torch.equal(a.input_ids, b.input_ids)
    assert not torch.equal(a.input_ids, task.batch(1, 8, 0, 16).input_ids)
    assert not torch.equal(a.input_ids, task.batch(2, 7, 0, 16).input_ids)
    assert not torch.equal(a.input_ids, task.batch(1, 7, 1, 16).input_ids)
    g1, g2 = batch_generator(0, 1), batch_generator(0, 1)
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))


def test_shard_rows_partitions_the_global_batch() -> None:
    x = torch.arange(12).view(6, 2)
    parts = [shard_rows(x, r, 3) for r in range(3)]
    assert torch.equal(torch.cat(parts), x)
    with pytest.raises(ValueError, match="evenly"):
        shard_rows(x, 0, 4)


def test_lm_task_windows_and_split(tmp_path: Path) -> None:
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    path = tmp_path / "t.txt"
    path.write_text(text)
    task = LMTask(str(path), block_size=16, val_fraction=0.1, eval_size=7)
    assert task.vocab.chars == sorted(set(text))
    b = task.batch(0, 0, 0, 4)
    assert torch.equal(b.input_ids[:, 1:], b.targets[:, :-1])  # next-character targets
    val = "".join(task.vocab.decode(e.input_ids[i]) for e in task.eval_batches(100)
                  for i in range(e.input_ids.shape[0]))
    assert len(val) == 7 * 16
    joined = task.vocab.decode(task.val_data)
    assert joined == text[900:]
    assert task.vocab.decode(task.eval_batches(100)[0].input_ids[0]) in joined


def test_char_vocab_roundtrip(tmp_path: Path) -> None:
    v = CharVocab(list("ab>ü "))
    assert v.decode(v.encode("ü a>b")) == "ü a>b"
    v.save(tmp_path / "vocab.json")
    assert json.loads((tmp_path / "vocab.json").read_text())["kind"] == "char"
    assert CharVocab.load(tmp_path / "vocab.json").chars == v.chars
    with pytest.raises(ValueError, match="'z' is not in the vocabulary"):
        v.encode("az")
    with pytest.raises(ValueError, match="distinct"):
        CharVocab("aa")


# ---- checkpoints ---------------------------------------------------------------------------


def _model_and_opt(d_model: int = 16) -> tuple[CausalLM, torch.optim.Optimizer]:
    model = CausalLM(CausalLMConfig(vocab_size=7, max_len=8, d_model=d_model, num_heads=2,
                                    num_layers=1, d_ff=32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(7, (2, 8))).logits.sum().backward()
    opt.step()
    return model, opt


def _expected(model: CausalLM) -> dict:
    return json.loads(json.dumps({"model_type": "handformer-causal-lm",
                                  **model.config.to_dict()}))


def test_checkpoint_roundtrip_is_exact(tmp_path: Path) -> None:
    model, opt = _model_and_opt()
    rng = {"torch": torch.get_rng_state()}
    path = save_checkpoint(tmp_path, 3, model, opt, {"tokens": 5}, rng)
    assert path.name == "step-00000003" and latest_checkpoint(tmp_path) == path
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]
    fresh, fresh_opt = _model_and_opt()
    state, rng2 = load_checkpoint(path, fresh, fresh_opt, _expected(model))
    assert state["step"] == 3 and state["tokens"] == 5
    assert torch.equal(rng2["torch"], rng["torch"])
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    s1, s2 = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    for i in s1:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1[i][key], s2[i][key])


def test_truncated_checkpoint_is_refused_and_nothing_loaded(tmp_path: Path) -> None:
    model, opt = _model_and_opt()
    path = save_checkpoint(tmp_path, 1, model, opt, {}, {})
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    fresh, fresh_opt = _model_and_opt()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(path, fresh, fresh_opt, _expected(model))
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def test_altered_or_incomplete_checkpoint_is_refused(tmp_path: Path) -> None:
    model, opt = _model_and_opt()
    path = save_checkpoint(tmp_path, 1, model, opt, {}, {})
    data = bytearray((path / "trainer_state.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size, one bit pattern changed
    (path / "trainer_state.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_checkpoint(path, *_model_and_opt(), _expected(model))
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest"):
        load_checkpoint(path, *_model_and_opt(), _expected(model))


def test_checkpoint_of_another_config_is_refused(tmp_path: Path) -> None:
    small, opt = _model_and_opt(16)
    path = save_checkpoint(tmp_path, 1, small, opt, {}, {})
    big, big_opt = _model_and_opt(32)
    with pytest.raises(CheckpointError, match="another model configuration.*d_model"):
        load_checkpoint(path, big, big_opt, _expected(big))


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    model, opt = _model_and_opt()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model, opt, {}, {})
    prune_checkpoints(tmp_path, 2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    shutil.rmtree(tmp_path / "checkpoints")
    assert latest_checkpoint(tmp_path) is None
