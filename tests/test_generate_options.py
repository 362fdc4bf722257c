"""Decoding options of ``generate`` (the library) and of ``handformer generate`` / ``chat``:
the repetition penalty (transformers' definition, checked against transformers), stop
strings (generation ends at one, the text is cut before it, as llama.cpp and Ollama do),
``--dtype``, ``--threads``, and one-line refusals of bad values."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import transformers

from cli_util import run_cli
from handformer.chat.session import ChatSession
from handformer.checks import OptionError
from handformer.models.generation import apply_repetition_penalty, stop_position
from handformer.pretrained import load_lm
from pretrained_util import tiny_gpt2_folder

PROMPT = "w1 w2 w3 w1"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gpt2_folder(tmp_path_factory.mktemp("gpt2"), vocab_size=40, n_layer=2)


@pytest.fixture(scope="module")
def loaded(folder: Path) -> tuple[object, object]:
    return load_lm(folder)


# ---- repetition penalty ---------------------------------------------------------------------

@pytest.mark.parametrize("penalty", [1.3, 0.7, 1.0])
def test_repetition_penalty_is_transformers(penalty: float) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 4  # positive and negative scores
    ids = torch.randint(0, 50, (3, 9), generator=g)  # with repeats
    expected = transformers.RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits, ids, penalty), expected,
                               rtol=0, atol=0)


def test_generate_with_a_penalty_equals_transformers(folder: Path, loaded: tuple) -> None:
    model, tok = loaded
    ids = torch.tensor([tok.encode(PROMPT)])
    theirs = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    expected = theirs.generate(ids, max_new_tokens=12, do_sample=False, repetition_penalty=1.5,
                               eos_token_id=None, pad_token_id=0)
    ours = model.generate(ids, max_new_tokens=12, repetition_penalty=1.5)
    assert ours.tolist() == expected.tolist()
    assert ours.tolist() != model.generate(ids, max_new_tokens=12).tolist()  # it matters


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "1.1"])
def test_a_bad_penalty_is_refused_by_name(value: object, loaded: tuple) -> None:
    model, _ = loaded
    with pytest.raises(OptionError, match="^repetition_penalty must be a finite number > 0"):
        model.generate(torch.tensor([[1, 2]]), max_new_tokens=2, repetition_penalty=value)


# ---- stop strings ---------------------------------------------------------------------------

def test_stop_position_cuts_and_holds_back() -> None:
    assert stop_position("Hello\nUser: hi", ["User:"]) == (6, True)
    assert stop_position("a STOP b END", ["END", "STOP"]) == (2, True)  # the first one
    assert stop_position("Hello\nUs", ["User:"]) == (6, False)  # "Us" may begin "User:"
    assert stop_position("Hello", ["User:"]) == (5, False)
    assert stop_position("", ["x"]) == (0, False)


def test_generation_stops_at_a_stop_string(loaded: tuple) -> None:
    model, tok = loaded
    ids = torch.tensor([tok.encode(PROMPT)])
    full = model.generate(ids, max_new_tokens=12)[0, ids.shape[1]:].tolist()
    stop = f"w{full[2]}"  # the third new word (w33 w33 w15 ...: "w15")
    k = next(k for k in range(1, 13) if stop in tok.decode(full[:k]))  # the reference
    out = model.generate(ids, max_new_tokens=12, stop=[stop], tokenizer=tok)
    assert out.shape[1] == ids.shape[1] + k < ids.shape[1] + 12
    text = tok.decode(out[0, ids.shape[1]:].tolist())
    end, stopped = stop_position(text, [stop])
    assert stopped and text[:end] == tok.decode(full[:k])[:end] and stop not in text[:end]


@pytest.mark.parametrize("stop, tokenizer, message", [
    ("w1", True, "stop must be a list of non-empty strings"),
    ([""], True, "stop must be a list of non-empty strings"),
    (["w1"], False, "stop strings need the tokenizer"),
])
def test_bad_stop_strings_are_refused(stop: object, tokenizer: bool, message: str,
                                      loaded: tuple) -> None:
    model, tok = loaded
    with pytest.raises(ValueError, match=message):
        model.generate(torch.tensor([[1, 2]]), max_new_tokens=2, stop=stop,
                       tokenizer=tok if tokenizer else None)


# ---- the command line -----------------------------------------------------------------------

def _generate(capsys: pytest.CaptureFixture[str], folder: Path, *extra: str
              ) -> tuple[int, str, str]:
    return run_cli(capsys, ["generate", "--model", str(folder), "--prompt", PROMPT,
                            "--max-new-tokens", "12", *extra])


def _new_text(loaded: tuple, **options: object) -> str:
    """The text of 12 greedy tokens after PROMPT, through the API."""
    model, tok = loaded
    ids = torch.tensor([tok.encode(PROMPT)])
    return tok.decode(model.generate(ids, max_new_tokens=12, **options)[0, 4:].tolist())


def test_cli_stop_cuts_the_printed_text(folder: Path, loaded: tuple, capsys) -> None:
    new = _new_text(loaded)
    stop = " " + new.split()[2]  # " w15"
    code, out, err = _generate(capsys, folder, "--stop", stop, "--stop", "never")
    assert code == 0 and not err
    assert out == PROMPT + new[:new.index(stop)] + "\n"  # cut before the stop string
    code, out, _ = _generate(capsys, folder)
    assert code == 0 and out == PROMPT + new + "\n"


def test_cli_repetition_penalty_is_the_apis(folder: Path, loaded: tuple, capsys) -> None:
    expected = _new_text(loaded, repetition_penalty=1.5)
    code, out, _ = _generate(capsys, folder, "--repetition-penalty", "1.5")
    assert code == 0 and out == PROMPT + expected + "\n"
    assert expected != _new_text(loaded)


def test_cli_dtype_and_threads(folder: Path, capsys, monkeypatch) -> None:
    loads = []
    import handformer.pretrained.lm as lm

    real = lm.load_lm_with_tokenizer  # what the commands load with
    monkeypatch.setattr(lm, "load_lm_with_tokenizer",
                        lambda *a, **k: loads.append(k["dtype"]) or real(*a, **k))
    before = torch.get_num_threads()
    try:
        code, out, _ = _generate(capsys, folder, "--dtype", "bfloat16", "--threads", "1")
        assert code == 0 and out.startswith(PROMPT)
        assert loads == [torch.bfloat16] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("flags, message", [
    (["--repetition-penalty", "0"],
     "--repetition-penalty must be a finite number > 0 (1 = no penalty), got 0.0"),
    (["--repetition-penalty", "nan"], "--repetition-penalty must be a finite number > 0"),
    (["--threads", "0"], "--threads must be an integer in [1, 2147483647], got 0"),
    (["--stop", ""], "--stop must be non-empty text"),
    (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
])
def test_cli_bad_values_are_one_line_naming_the_option(command: str, flags: list[str],
                                                       message: str, folder: Path,
                                                       capsys) -> None:
    extra = ["--prompt", "w1"] if command == "generate" else []
    code, _, err = run_cli(capsys, [command, "--model", str(folder), *extra, *flags])
    assert code == 2 and message in err


def test_cli_help_documents_the_options(capsys) -> None:
    for command in ("generate", "chat"):
        code, out, _ = run_cli(capsys, [command, "--help"])
        assert code == 0
        for flag in ("--dtype", "--threads", "--stop", "--repetition-penalty"):
            assert flag in out


# ---- chat -----------------------------------------------------------------------------------

class _Template:
    """The folder's tokenizer with a one-line chat template (for ChatSession)."""

    def __init__(self, tok: object) -> None:
        self.tok, self.chat_template, self.eos_token_ids = tok, "t", []

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True) -> str:
        return " ".join(m["content"] for m in messages)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def test_chat_session_stop_and_penalty(loaded: tuple) -> None:
    model, tok = loaded
    chat = _Template(tok)
    plain = ChatSession(model, chat, max_new_tokens=12).send(PROMPT)
    stop = " " + plain.split()[2]
    shown = io.StringIO()
    reply = ChatSession(model, chat, max_new_tokens=12, stop=[stop]).send(
        PROMPT, on_text=shown.write)
    assert reply == " ".join(plain.split()[:2]) and shown.getvalue() == reply
    ids = torch.tensor([tok.encode(PROMPT)])
    penalized = tok.decode(model.generate(ids, max_new_tokens=12,
                                          repetition_penalty=1.5)[0, 4:].tolist())
    assert ChatSession(model, chat, max_new_tokens=12, repetition_penalty=1.5).send(
        PROMPT) == penalized != plain
    with pytest.raises(OptionError, match="repetition_penalty"):
        ChatSession(model, chat, repetition_penalty=0)


def test_cli_model_that_does_not_exist_says_so(capsys) -> None:
    for command, extra in (("generate", ["--prompt", "a"]), ("chat", [])):
        code, _, err = run_cli(capsys, [command, "--model", "/nonexistent.gguf", *extra])
        assert code == 2 and "/nonexistent.gguf: no such file" in err
        assert "no checkpoint folder" not in err

