"""The commands on a modern causal LM folder (a tiny random Gemma 3 written by transformers,
with a word-level ``tokenizer.json``): generate, viz, heads, serve; embed refuses it; a
folder of another ``model_type`` is refused naming everything each command takes."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import httpx
import pytest
import torch

transformers = pytest.importorskip("transformers")

from handformer.cli import main  # noqa: E402
from handformer.pretrained import load_lm  # noqa: E402
from serve_util import Server  # noqa: E402

V = 40
WORDS = " ".join(f"w{i}" for i in (3, 14, 15, 9, 2, 6))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=48,
        sliding_window=3, query_pre_attn_scalar=8, bos_token_id=None, eos_token_id=V - 1,
        pad_token_id=None, initializer_range=0.3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    transformers.Gemma3ForCausalLM(config).save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(V - 1)} | {"<eos>": V - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _run(*argv: object) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def _ids(tokenizer: object, text: str) -> list[int]:
    """The ids the commands give the model: the tokenizer protocol's ``encode`` with the
    special tokens (a tokenizer without that keyword breaks the protocol: let it fail)."""
    return tokenizer.encode(text, add_special_tokens=True)


def test_generate_greedy_equals_the_model(folder: Path) -> None:
    code, out, err = _run("generate", "--model", folder, "--prompt", WORDS,
                          "--max-new-tokens", 8)
    assert code == 0, err
    model, tok = load_lm(folder)
    ids = torch.tensor([_ids(tok, WORDS)])
    new = model.generate(ids, max_new_tokens=8, eos_token_id=V - 1)[0, ids.shape[1]:].tolist()
    if V - 1 in new:
        new = new[:new.index(V - 1)]
    assert out == WORDS + tok.decode(new) + "\n"  # the prompt, then the new text


def test_viz_draws_every_layer_and_says_which_slide(folder: Path, tmp_path: Path) -> None:
    code, out, err = _run("viz", WORDS, "--model", folder, "--out", tmp_path)
    assert code == 0, err
    assert (tmp_path / "head.png").is_file() and (tmp_path / "index.html").is_file()
    assert "3 layers x 4 heads" in out
    assert "2 of 3 layers see the last 3 tokens" in (tmp_path / "index.html").read_text()


def test_heads_changes_log_probability(folder: Path, tmp_path: Path) -> None:
    code, out, err = _run("heads", "w3 w14 w15", "w9 w2", "--model", folder, "--out", tmp_path)
    assert code == 0, err
    lines = out.splitlines()
    clean = float(lines[0].split(": ")[1].split()[0])
    model, tok = load_lm(folder)
    first, rest = _ids(tok, "w3 w14 w15"), [9, 2]
    ids = torch.tensor([first + rest])
    with torch.no_grad():
        logp = model(ids).logits[0].double().log_softmax(-1)
    expected = sum(float(logp[len(first) - 1 + i, t]) for i, t in enumerate(rest))
    assert clean == pytest.approx(expected, abs=1e-4)
    # the strongest head, zeroed independently of handformer.inspect (a pre-hook on o_proj)
    layer, head, change = (float(x) for x in lines[2].split())
    mha = model.blocks[int(layer)].attn
    D = mha.head_dim

    def zero(module: torch.nn.Module, args: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
        x = args[0].clone()
        x[..., int(head) * D:(int(head) + 1) * D] = 0.0
        return (x,)

    handle = mha.out_proj.register_forward_pre_hook(zero)
    try:
        with torch.no_grad():
            ablated = model(ids).logits[0].double().log_softmax(-1)
    finally:
        handle.remove()
    value = sum(float(ablated[len(first) - 1 + i, t]) for i, t in enumerate(rest))
    assert value - expected == pytest.approx(change, abs=2e-4)


def test_serve_answers_with_the_model(folder: Path) -> None:
    model, tok = load_lm(folder)
    s = Server("--model", str(folder))
    try:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            info = c.get("/api/model").json()
            assert info["type"] == "causal-lm" and (info["layers"], info["heads"]) == (3, 4)
            body = c.post("/api/run", json={"text": WORDS}).json()
            with torch.inference_mode():
                logits = model(torch.tensor([_ids(tok, WORDS)])).logits[0, -1]
            assert body["next_token"][0]["id"] == int(logits.argmax())
    finally:
        s.close()


def test_embed_refuses_a_causal_lm(folder: Path) -> None:
    code, _, err = _run("embed", "a sentence", "--model", folder)
    assert code == 2 and "is a causal language model" in err and "handformer viz" in err


@pytest.mark.parametrize("command", [["viz", "hi"], ["heads", "a", "b"], ["serve"],
                                     ["generate", "--prompt", "x"]])
def test_another_model_type_names_what_the_command_takes(tmp_path: Path,
                                                          command: list[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    code, _, err = _run(*command, "--model", tmp_path)
    assert code == 2 and err.count("\n") == 1
    assert f"model_type 't5' is not a model {command[0]} reads" in err
    assert "gemma3_text" in err and "a .gguf file" in err
    assert ("a BERT-family encoder folder" in err) == (command[0] != "generate")
