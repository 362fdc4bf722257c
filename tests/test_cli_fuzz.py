"""CLI fuzzing: every sub-command exits 0 or 2 with a one-line message, never a traceback.

Inputs: empty, whitespace-only, Chinese, emoji (with a skin-tone modifier), combining marks,
right-to-left (Arabic, Hebrew), 100k characters, binary-looking control characters, lone
surrogates (what Python makes of command-line bytes that are not UTF-8), unknown flags and
out-of-range numbers, for ``demo``, ``embed``, ``viz``, ``generate`` and ``train``. Most calls
run ``handformer.cli.main`` in-process (tiny random models built here, no downloads); two run
the real console entry point in a subprocess.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import handformer as hf
from cli_util import run_cli as cli
from handformer.train.data import CharVocab
from pretrained_util import tiny_checkpoint

TEXTS = {
    "empty": "",
    "whitespace": " \t\n \u3000",
    "chinese": "你好，世界。注意力机制",
    "emoji": "🙂👍🏽🚀 ok",
    "combining": "e\u0301 a\u0308 n\u0303",
    "rtl": "مرحبا بالعالم שלום",
    "long": "the cat sat " * 8334,  # 100,008 characters
    "binary": "\x00\x01\x07\x7f\xff\ufffd\x1b[31m",
    "surrogates": "\udcff\udcfe",
}
NON_EMPTY = [k for k in TEXTS if k not in ("empty", "whitespace", "surrogates")]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bert")
    tiny_checkpoint(folder, hidden_size=16, layers=1, heads=2, intermediate=16)
    return folder


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny CausalLM folder whose character vocabulary holds every fuzz character."""
    folder = tmp_path_factory.mktemp("lm")
    chars = sorted({c for k, t in TEXTS.items() if k != "surrogates" for c in t})
    config = hf.CausalLMConfig(vocab_size=len(chars), max_len=64, d_model=8, num_heads=2,
                               num_layers=1, d_ff=16)
    hf.CausalLM(config).save_pretrained(folder)
    CharVocab(chars).save(folder / "vocab.json")
    return folder


# ---- text inputs ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(TEXTS))
def test_embed_texts(name: str, bert_dir: Path, capsys) -> None:
    code, out, err = cli(capsys, ["embed", TEXTS[name], "--model", str(bert_dir)])
    if name in NON_EMPTY:
        assert code == 0 and "[0]" in out, err
    else:
        assert code == 2
        assert ("is empty" in err) if name != "surrogates" else ("lone surrogate" in err)


@pytest.mark.parametrize("name", list(TEXTS))
def test_generate_prompts(name: str, lm_dir: Path, capsys) -> None:
    code, out, err = cli(capsys, ["generate", "--model", str(lm_dir), "--prompt", TEXTS[name],
                                  "--max-new-tokens", "3"])
    if name == "long":
        assert code == 2 and "longer than the context max_len=64" in err
    elif name in NON_EMPTY:
        assert code == 0 and out.startswith(TEXTS[name]), err
    elif name == "whitespace":  # real characters of this character-level vocabulary
        assert code == 0 and out.startswith(TEXTS[name]), err
    else:
        assert code == 2
        assert ("is empty" in err) if name == "empty" else \
            ("'\\udcff' is not in the vocabulary" in err)


@pytest.mark.parametrize("name", ["empty", "whitespace", "surrogates", "mixed", "long"])
def test_viz_texts(name: str, bert_dir: Path, tmp_path: Path, capsys) -> None:
    text = "".join(TEXTS[k] for k in NON_EMPTY if k != "long") if name == "mixed" \
        else TEXTS[name]
    code, out, err = cli(capsys, ["viz", text, "--model", str(bert_dir),
                                  "--out", str(tmp_path / "v")])
    if name in ("mixed", "long"):
        assert code == 0 and (tmp_path / "v" / "index.html").is_file(), err
        assert ("longer than the model's limit" in err) == (name == "long")
    else:
        assert code == 2


TRAIN_SMALL = ["--steps", "1", "--d-model", "8", "--heads", "2", "--d-ff", "16", "--layers",
               "1", "--batch-size", "2", "--eval-size", "2", "--block-size", "4",
               "--no-progress"]


@pytest.mark.parametrize("name,content,expected", [
    ("empty", b"", 2),
    ("binary", bytes(range(256)), 2),  # not UTF-8
    ("unicode", "".join(TEXTS[k] for k in NON_EMPTY if k != "long").encode() * 4, 0),
    ("long", TEXTS["long"].encode(), 0),
])
def test_train_text_files(name: str, content: bytes, expected: int, tmp_path: Path,
                          capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_bytes(content)
    code, out, err = cli(capsys, ["train", "lm", "--text", str(text), "--out",
                                  str(tmp_path / "run"), *TRAIN_SMALL])
    assert code == expected, err
    if expected == 0:
        assert "finished at step 1" in out


# ---- flags and numbers ------------------------------------------------------------------

BAD_ARGS = [
    (["demo", "--seed", "x"], "invalid int value: 'x'"),
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    (["demo", "--seed", str(2**64)],
     "--seed must be an integer in 0..2**63 - 1, got 18446744073709551616"),
    (["demo", "--seed", "-1"], "--seed must be an integer in 0..2**63 - 1, got -1"),
    (["demo", "extra"], "unrecognized arguments: extra"),
    ([], "the following arguments are required: COMMAND"),
    (["nonsense"], "invalid choice: 'nonsense'"),
    (["embed"], "the following arguments are required: SENTENCE"),
    (["embed", "a", "--batch-size", "0", "--model", "{bert}"],
     "batch_size must be a positive integer, got 0"),
    (["embed", "a", "--batch-size", "-3", "--model", "{bert}"],
     "batch_size must be a positive integer, got -3"),
    (["embed", "a", "--batch-size", "1.5"], "invalid int value: '1.5'"),
    (["embed", "a", "--model", "/nonexistent/dir"], "no checkpoint folder at /nonexistent/dir"),
    (["embed", "a", "--bogus"], "unrecognized arguments: --bogus"),
    (["viz", "the cat", "--model", "{bert}", "--layer", "99", "--out", "{tmp}"],
     "--layer 99 is out of range: the model has 1 layers, valid values are 0..0"),
    (["viz", "the cat", "--model", "{bert}", "--head", "-1", "--out", "{tmp}"],
     "--head -1 is out of range"),
    (["viz", "the cat", "--attention", "local", "--window-size", "-3", "--out", "{tmp}"],
     "--window-size must be a positive integer, got -3"),
    (["viz", "the cat", "--attention", "strided", "--stride", "0", "--out", "{tmp}"],
     "stride must be a positive integer, got 0"),
    (["viz", "the cat", "--attention", "strided", "--global-tokens", "-1", "--out", "{tmp}"],
     "--global-tokens must be a non-negative integer, got -1"),
    (["viz", "the cat", "--attention", "sparse"], "invalid choice: 'sparse'"),
    (["viz", "the cat", "--layer", "1e3"], "invalid int value: '1e3'"),
    (["viz", "the cat", "--bogus"], "unrecognized arguments: --bogus"),
    (["generate", "--model", "{lm}"], "one of the arguments --prompt --chat is required"),
    (["generate", "--model", "/nonexistent", "--prompt", "the"], "no config.json in /nonexistent"),
    (["generate", "--model", "{lm}", "--prompt", "the", "--max-new-tokens", "-1"],
     "--max-new-tokens must be an integer >= 0, got -1"),
    (["generate", "--model", "{lm}", "--prompt", "the", "--max-new-tokens", "100000"],
     "exceeds the context max_len=64"),
    (["generate", "--model", "{lm}", "--prompt", "the", "--temperature", "0"],
     "temperature must be > 0 when sampling, got 0.0"),
    (["generate", "--model", "{lm}", "--prompt", "the", "--temperature", "nan"],
     "temperature must be > 0 when sampling, got nan"),
    (["generate", "--model", "{lm}", "--prompt", "the", "--top-k", "0"],
     "--top-k must be an integer >= 1, got 0"),
    (["generate", "--model", "{lm}", "--prompt", "the", "--top-p", "1.5"],
     "--top-p must be in (0, 1], got 1.5"),
    (["generate", "--model", "{lm}", "--prompt", "the", "--top-p", "nan"],
     "--top-p must be in (0, 1], got nan"),
    (["generate", "--model", "{lm}", "--prompt", "the", "--seed", str(-2**63 - 1)],
     "--seed must be an integer in 0..2**63 - 1, got -9223372036854775809"),
    (["generate", "--model", "{lm}", "--prompt", "the", "--bogus"],
     "unrecognized arguments: --bogus"),
    (["train"], "give a TASK (copy, reverse, sort or lm) or --resume RUN_DIR"),
    (["train", "foo"], "unknown task 'foo'"),
    (["train", "copy", "--steps", "-1", "--out", "{tmp}"], "steps must be a positive integer"),
    (["train", "copy", "--lr", "nan", "--out", "{tmp}"], "lr must be a positive number, got nan"),
    (["train", "copy", "--lr", "inf", "--out", "{tmp}"], "lr must be a positive number, got inf"),
    (["train", "copy", "--d-model", "0", "--out", "{tmp}"],
     "d_model must be a positive integer, got 0"),
    (["train", "copy", "--heads", "3", "--out", "{tmp}"],
     "d_model=64 is not divisible by num_heads=3"),
    (["train", "copy", "--length", "0", "--out", "{tmp}"],
     "length must be a positive integer, got 0"),
    (["train", "copy", "--num-symbols", "99", "--out", "{tmp}"], "num_symbols"),
    (["train", "copy", "--dropout", "1.5", "--out", "{tmp}"],
     "dropout must be a probability in [0, 1), got 1.5"),
    (["train", "copy", "--seed", "-1", "--out", "{tmp}"],
     "seed must be an integer in 0..2**63 - 1, got -1"),
    (["train", "copy", "--precision", "fp8", "--out", "{tmp}"], "precision must be one of"),
    (["train", "copy", "--attention", "local", "--out", "{tmp}"],
     "--attention local needs --window-size N"),
    (["train", "copy", "--grad-accum", "3", "--out", "{tmp}"],
     "batch_size=64 is not divisible by grad_accum=3"),
    (["train", "lm", "--out", "{tmp}"], "task 'lm' needs --text FILE"),
    (["train", "lm", "--text", "/nonexistent.txt", "--out", "{tmp}"], "/nonexistent.txt"),
    (["train", "--resume", "{tmp}"], "is not a handformer run folder (no train.json)"),
    (["train", "copy", "--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize("argv,message", BAD_ARGS, ids=lambda a: " ".join(a)[:60]
                         if isinstance(a, list) else None)
def test_bad_flags_and_numbers_exit_2_with_one_line(argv, message, bert_dir, lm_dir, tmp_path,
                                                    capsys) -> None:
    argv = [a.format(bert=bert_dir, lm=lm_dir, tmp=tmp_path / "out") for a in argv]
    code, _, err = cli(capsys, argv)
    assert code == 2
    assert message in err, err


def test_demo_runs_with_any_seed_in_range(capsys) -> None:
    for seed in ("0", "1", str(2**63 - 1)):
        code, out, _ = cli(capsys, ["demo", "--seed", seed])
        assert code == 0 and "hidden states    (1, 11, 64)" in out


# ---- real processes ---------------------------------------------------------------------


def _real(*args: str | bytes) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "handformer", *args], capture_output=True,
                          timeout=300)


def test_subprocess_non_utf8_argument_is_one_line(bert_dir: Path) -> None:
    result = _real("embed", b"caf\xe9 \xff\xfe", "--model", str(bert_dir))  # Latin-1 bytes
    err = result.stderr.decode("utf-8", "replace")
    assert result.returncode == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "lone surrogate" in err


def test_subprocess_unicode_generate_and_unknown_flag(lm_dir: Path) -> None:
    prompt = TEXTS["chinese"] + TEXTS["emoji"] + TEXTS["rtl"]
    result = _real("generate", "--model", str(lm_dir), "--prompt", prompt,
                   "--max-new-tokens", "4")
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode("utf-8").startswith(prompt)
    bad = _real("generate", "--model", str(lm_dir), "--prompt", prompt, "--frobnicate")
    err = bad.stderr.decode()
    assert bad.returncode == 2 and err.count("\n") == 1 and "--frobnicate" in err
