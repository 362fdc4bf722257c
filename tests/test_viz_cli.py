"""``handformer viz``: outputs on the bundled model, attention kinds, bad input -> exit 2."""

import base64
import json
import re
import subprocess
import sys

import numpy as np
import pytest
from matplotlib.image import imread

from handformer.cli import main

SEED = "The animal didn't cross the street because it was too tired"
TOKENS = ["[CLS]", "the", "animal", "didn", "'", "t", "cross", "the", "street", "because",
          "it", "was", "too", "tired", "[SEP]"]


def payload(path):
    page = path.read_text(encoding="utf-8")
    m = re.search(r'<script type="application/json" id="hf-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1))


def run(capsys, *argv):
    code = main(["viz", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_seed_sentence_writes_pngs_html_and_summary(tmp_path, capsys):
    out_dir = tmp_path / "attention"
    code, out, err = run(capsys, SEED, "--out", str(out_dir))
    assert code == 0, err
    lines = out.splitlines()
    for name in ("head.png", "model.png", "index.html"):
        assert (out_dir / name).is_file()
        assert f"wrote {out_dir / name}" in lines
    summary = [ln for ln in lines if re.match(r"layer \d: ", ln)]
    assert len(summary) == 6
    assert all("most attention to" in ln and "strongest link" in ln for ln in summary)
    # all-MiniLM-L6-v2, layer 3: "it" looks at "animal" (0.64 in head 1; checked by hand and
    # by the parity tests of the pretrained model against transformers)
    assert re.search(r"^layer 3: .*strongest link it -> animal 0\.6\d \(head 1\)$", out, re.M)
    m = re.search(r"15 tokens, 6 layers x 12 heads; head.png shows layer (\d+), head (\d+)", out)
    assert m
    data = payload(out_dir / "index.html")
    assert data["tokens"] == TOKENS and (data["layers"], data["heads"]) == (6, 12)
    assert [data["layer"], data["head"]] == [int(m.group(1)), int(m.group(2))]
    assert data["pattern"] is None
    page = (out_dir / "index.html").read_text(encoding="utf-8")
    assert "http://" not in page and "https://" not in page
    assert imread(out_dir / "head.png")[..., :3].std() > 0.1
    assert err == ""


def test_layer_and_head_options(tmp_path, capsys):
    code, out, _ = run(capsys, SEED, "--out", str(tmp_path), "--layer", "3", "--head", "1")
    assert code == 0
    assert "head.png shows layer 3, head 1" in out
    data = payload(tmp_path / "index.html")
    assert [data["layer"], data["head"]] == [3, 1]


@pytest.mark.parametrize("kind, extra, label", [
    ("local", ["--window-size", "3"], "Local attention, window 3."),
    ("strided", ["--stride", "4"], "Strided attention, stride 4, 1 global token(s)."),
    ("linear", [], "Linear attention: every query reaches every key"),
])
def test_attention_kinds_show_their_pattern(tmp_path, capsys, kind, extra, label):
    code, out, err = run(capsys, SEED, "--out", str(tmp_path), "--attention", kind, *extra)
    assert code == 0, err
    data = payload(tmp_path / "index.html")
    assert data["pattern"]["label"].startswith(label)
    assert data["note"].startswith("all-MiniLM-L6-v2 · ") and kind in data["note"]
    full = imread(tmp_path / "head.png")
    assert full.shape[1] > 1.5 * full.shape[0]  # weights and pattern side by side
    if kind == "local":  # weights outside the window are exactly zero in the viewer data
        assert "at most 3 per query instead of 15" in data["pattern"]["label"]


def test_long_text_is_truncated_with_a_notice(tmp_path, capsys):
    code, out, err = run(capsys, " ".join([SEED] * 60), "--out", str(tmp_path))
    assert code == 0
    assert err == ("note: the text is longer than the model's limit of 512 tokens; only the "
                   "first 512 are shown\n")  # one line, on stderr
    assert "512 tokens, 6 layers x 12 heads" in out
    assert len(payload(tmp_path / "index.html")["tokens"]) == 512


@pytest.mark.parametrize("argv, message", [
    (["", "--out", "{tmp}"], "TEXT is empty"),
    ([" \t\n ", "--out", "{tmp}"], "TEXT is empty"),
    ([SEED, "--out", "{tmp}", "--layer", "6"],
     "--layer 6 is out of range: the model has 6 layers, valid values are 0..5"),
    ([SEED, "--out", "{tmp}", "--layer", "-1"],
     "--layer -1 is out of range: the model has 6 layers, valid values are 0..5"),
    ([SEED, "--out", "{tmp}", "--head", "12"],
     "--head 12 is out of range: the model has 12 heads per layer, valid values are 0..11"),
    ([SEED, "--out", "{tmp}/file"], "cannot write to --out {tmp}/file"),
    ([SEED, "--out", "{tmp}/file/sub"], "cannot write to --out {tmp}/file/sub"),
    ([SEED, "--out", "{tmp}", "--attention", "local", "--window-size", "0"], "--window-size"),
    ([SEED, "--out", "{tmp}", "--model", "{tmp}/no-such-model"], "no checkpoint folder"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "file").write_text("not a folder")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("handformer viz: error: ")
    assert message.replace("{tmp}", str(tmp_path)) in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "index.html").exists()


def test_bad_option_value_exits_2():
    with pytest.raises(SystemExit) as exc:
        main(["viz", SEED, "--attention", "sparse"])
    assert exc.value.code == 2


def test_new_process_empty_text_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "handformer", "viz", "  ", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("handformer viz: error: TEXT is empty")
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def char_lm(tmp_path_factory):
    """A tiny random causal LM with a character vocabulary, as `handformer train` saves it."""
    import torch

    from handformer.models.causal_lm import CausalLM
    from handformer.models.causal_lm_config import CausalLMConfig
    from handformer.train.data import CharVocab

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("char_lm")
    vocab = CharVocab(list("abcdefghijklmnopqrstuvwxyz .'"))
    config = CausalLMConfig(vocab_size=len(vocab), max_len=24, d_model=32, num_heads=2,
                            num_layers=2, d_ff=64, attention="local", window_size=5)
    CausalLM(config).save_pretrained(folder)
    vocab.save(folder / "vocab.json")
    return folder


def test_causal_lm_folder(char_lm, tmp_path, capsys):
    code, out, err = run(capsys, "the animal was tired", "--model", str(char_lm),
                         "--out", str(tmp_path))
    assert code == 0, err
    data = payload(tmp_path / "index.html")
    assert data["tokens"] == list("the\u2423animal\u2423was\u2423tired")  # spaces made visible
    assert (data["layers"], data["heads"]) == (2, 2)
    label = data["pattern"]["label"]
    assert label.startswith("Causal local attention, window 5.")
    assert "at most 3 per query instead of 20" in label  # two keys back and itself
    back = np.frombuffer(base64.b64decode(data["data"]), np.uint8).reshape(2, 2, 20, 20)
    assert not back[..., np.triu_indices(20, 1)[0], np.triu_indices(20, 1)[1]].any()
    assert "20 tokens, 2 layers x 2 heads" in out
    assert len(re.findall(r"^layer \d: ", out, re.M)) == 2


@pytest.mark.parametrize("argv, message", [
    (["--attention", "local"], "--attention local applies to BERT-family encoders"),
    (["--layer", "2"], "--layer 2 is out of range: the model has 2 layers, valid values are "
                       "0..1"),
])
def test_causal_lm_bad_input(char_lm, tmp_path, capsys, argv, message):
    code, _, err = run(capsys, "the animal", "--model", str(char_lm), "--out", str(tmp_path),
                       *argv)
    assert code == 2 and message in err


def test_causal_lm_unknown_character_and_long_text(char_lm, tmp_path, capsys):
    code, _, err = run(capsys, "THE ANIMAL", "--model", str(char_lm), "--out", str(tmp_path))
    assert code == 2 and "not in the vocabulary" in err
    code, out, err = run(capsys, "abc " * 10, "--model", str(char_lm), "--out", str(tmp_path))
    assert code == 0
    assert "note: the text has 40 tokens, more than the model's limit of 24" in err
    assert len(payload(tmp_path / "index.html")["tokens"]) == 24


# ---- issue 16: options of another attention kind are refused, not ignored -------------------


@pytest.mark.parametrize("argv, message", [
    (["--window-size", "7"], "--window-size 7 applies to --attention local, not --attention "
                             "full; add --attention local or leave --window-size out"),
    (["--attention", "local", "--stride", "4"],
     "--stride 4 applies to --attention strided, not --attention local; add --attention "
     "strided or leave --stride out"),
    (["--attention", "linear", "--global-tokens", "2"],
     "--global-tokens 2 applies to --attention strided, not --attention linear"),
])
def test_pattern_flag_of_another_kind_is_refused(tmp_path, capsys, argv, message):
    out_dir = tmp_path / "v"
    code, out, err = run(capsys, SEED, "--out", str(out_dir), *argv)
    assert code == 2 and out == ""
    assert err.startswith(f"handformer viz: error: {message}") and err.count("\n") == 1
    assert not out_dir.exists()  # refused before anything was written


def test_pattern_flag_on_a_causal_folder_is_refused(char_lm, tmp_path, capsys):
    code, _, err = run(capsys, "the animal", "--model", str(char_lm), "--out", str(tmp_path),
                       "--window-size", "3")
    assert code == 2 and "--window-size 3 applies to --attention local" in err
