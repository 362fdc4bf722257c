"""Learning, honestly: ``reverse`` with the default settings reaches >= 99% exact match on
held-out sequences, and the trained model reads the mirrored position."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from handformer.models.causal_lm import CausalLM
from handformer.train import SequenceTask, TrainConfig, train
from handformer.train.data import CharVocab
from handformer.train.plots import pick_head


@pytest.mark.slow
def test_reverse_defaults_learn_and_attend_to_the_mirrored_position(tmp_path: Path) -> None:
    config = TrainConfig(task="reverse", progress=False)  # the defaults
    result = train(config, tmp_path / "run")
    assert result.finished
    assert result.final_eval["accuracy"] >= 0.99
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_eval"]["accuracy"] >= 0.99
    for name in ("attention.png", "attention_head.png", "loss.png"):
        assert (tmp_path / "run" / name).stat().st_size > 1000

    # Independent check of the accuracy: greedy generation from "x>" on held-out sequences.
    model = CausalLM.from_pretrained(tmp_path / "run")
    vocab = CharVocab.load(tmp_path / "run" / "vocab.json")
    task = SequenceTask("reverse", length=config.length, num_symbols=config.num_symbols,
                        eval_size=config.eval_size, seed=config.seed)
    batch = task.eval_batches(1000)[0]
    n = config.length
    prompts = batch.input_ids[:200, :n + 1]  # (B, n + 1): "x>"
    out = model.generate(prompts, max_new_tokens=n)  # greedy
    texts = [vocab.decode(row) for row in out]
    right = sum(t.split(">")[1] == t.split(">")[0][::-1] for t in texts)
    assert right >= 0.99 * len(texts)

    # The attention: some head puts its largest weight on the mirrored key, for the queries
    # that predict the reversed sequence (query n + j reads key n - 1 - j).
    with torch.no_grad():
        attentions = model(batch.input_ids[:200], need_weights=True).attentions
    mirrored = task.mirrored_keys()  # (L,)
    rows = torch.arange(n, 2 * n)
    scores = torch.stack([(w[:, :, rows].argmax(-1) == mirrored[rows]).float().mean(dim=(0, 2))
                          for w in attentions])  # (N, H): share of rows on the mirrored key
    assert float(scores.max()) >= 0.9
    # ... and attention_head.png shows that head (the one reading the input the most)
    layer, head, _ = pick_head(tuple(w[:1] for w in attentions), slice(n, 2 * n), slice(0, n))
    assert float(scores[layer, head]) >= 0.9
