"""test_prompt, to_str_tokens / to_tokens, and ``handformer heads --metric logit-diff``."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

from handformer.cli import main
from handformer.inspect import prompt as prompt_mod
from handformer.inspect.prompt import to_single_token, to_str_tokens, to_tokens
from handformer.pretrained.gpt2 import load_gpt2

pytest.importorskip("transformers")
from pretrained_util import tiny_gpt2_folder  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gpt2_folder(tmp_path_factory.mktemp("gpt2"), n_layer=2)


def test_test_prompt_reports_rank_probability_and_top_k(folder: Path) -> None:
    model, tok = load_gpt2(folder)
    out = io.StringIO()
    ranks = prompt_mod.test_prompt(model, tok, "w1 w2 w3", "w7 w9", top_k=3, file=out)
    assert [r.token_id for r in ranks] == [7, 9]
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 7, 9]])).logits[0]
    for n, r in enumerate(ranks):
        row = logits[2 + n]
        order = row.argsort(descending=True).tolist()
        assert r.rank == order.index(r.token_id)
        assert r.prob == pytest.approx(float(row.softmax(-1)[r.token_id]), rel=1e-5)
        assert [t for t, _, _ in r.top] == [tok.decode([i]) for i in order[:3]]
    text = out.getvalue()
    assert "Tokenized prompt: ['w1', 'w2', 'w3']" in text
    assert f"Rank: {ranks[0].rank}" in text and text.count("Top 2th token") == 2


def test_str_tokens_tokens_and_single_token(folder: Path) -> None:
    _, tok = load_gpt2(folder)
    assert to_str_tokens(tok, "w4 w5") == ["w4", "w5"]
    assert to_tokens(tok, "w4 w5").tolist() == [[4, 5]]
    assert to_single_token(tok, " w6") == 6
    with pytest.raises(ValueError, match=r"'w1 w2' is 2 tokens \['w1', 'w2'\], not one"):
        to_single_token(tok, "w1 w2")


def test_tokenizer_methods_are_used_when_present() -> None:
    class Protocol:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return ([0] if add_special_tokens else []) + [ord(c) - 96 for c in text]

        def decode(self, ids: list[int]) -> str:
            return "".join("<s>" if i == 0 else chr(i + 96) for i in ids)

        def to_str_tokens(self, text: str) -> list[str]:
            return ["from the tokenizer"]

        def to_tokens(self, text: str) -> torch.Tensor:
            return torch.tensor([self.encode(text)])

    tok = Protocol()
    assert to_tokens(tok, "ab").tolist() == [[0, 1, 2]]  # special tokens as encode adds them
    assert to_str_tokens(tok, "ab") == ["from the tokenizer"]
    assert to_single_token(tok, "c") == 3


def cli(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(argv)) == 0
    return out.getvalue()


def test_heads_logit_diff_matches_an_independent_ablation(folder: Path, tmp_path: Path) -> None:
    text = cli("heads", "w1 w2 w3 w1 w2", "--model", str(folder), "--metric", "logit-diff",
               "--answer", " w3", "--wrong", " w4", "--top", "4", "--out", str(tmp_path))
    lines = text.splitlines()
    assert lines[0].startswith("logit(' w3') - logit(' w4'):")
    clean = float(lines[0].split(":")[1].split()[0])
    model, _ = load_gpt2(folder)
    ids = torch.tensor([[1, 2, 3, 1, 2]])

    def diff(layer: int | None = None, head: int | None = None) -> float:
        handles = []
        if layer is not None:
            mha = model.blocks[layer].attn
            D = mha.head_dim

            def zero(module: torch.nn.Module, args: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
                x = args[0].clone()
                x[..., head * D:(head + 1) * D] = 0.0
                return (x,)
            handles.append(mha.out_proj.register_forward_pre_hook(zero))
        try:
            with torch.no_grad():
                last = model(ids).logits[0, -1]
        finally:
            for h in handles:
                h.remove()
        return float(last[3] - last[4])

    assert clean == pytest.approx(diff(), abs=1e-4)
    for row in lines[2:6]:
        layer, head, change = row.split()
        assert float(change) == pytest.approx(diff(int(layer), int(head)) - diff(), abs=1e-4)
    assert (tmp_path / "heads.png").is_file()


@pytest.mark.parametrize("argv,message", [
    (["heads", "w1 w2", "--metric", "logit-diff", "--answer", " w3"], "needs --answer TOKEN "
                                                                       "and --wrong TOKEN"),
    (["heads", "w1 w2"], "--metric cosine needs two sentences"),
    (["heads", "a", "b", "--answer", "x"], "--answer and --wrong go with --metric logit-diff"),
])
def test_heads_usage_errors(argv: list[str], message: str) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    assert code == 2 and message in err.getvalue()
