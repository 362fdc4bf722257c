"""Chat sessions (handformer.chat.session) and the ``chat`` / ``generate --chat`` commands,
on a tiny model with a hand-made template; the shipped SmolLM2 chat is in test_shipped_llms."""

from __future__ import annotations

import pytest
import torch

import handformer as hf
from handformer.chat.session import ChatSession, TextStream, check_chat_model


class TemplateTokenizer:
    """Byte-level ids 0..255 plus 256 = end of turn; a template that shows every message."""

    chat_template = "<{role}>{content}"
    eos_token_id = 256
    eos_token_ids = [256, 257]

    def __init__(self) -> None:
        self.rendered: list[str] = []

    def apply_chat_template(self, messages: list[dict[str, str]], *,
                            add_generation_prompt: bool = True) -> str:
        text = "".join(self.chat_template.format(**m) for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        self.rendered.append(text)
        return text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def model(*, eos_first: bool = False) -> hf.CausalLM:
    torch.manual_seed(0)
    config = hf.CausalLMConfig(vocab_size=258, max_len=160, d_model=16, num_heads=2,
                               num_layers=1, d_ff=32, tie_weights=False)
    m = hf.CausalLM(config).eval()
    if eos_first:  # every position's logits favour token 256 (the end of turn)
        with torch.no_grad():
            m.ln_final.weight.zero_()
            m.ln_final.bias.fill_(1.0)  # the final hidden state is all ones
            m.lm_head.weight.zero_()
            m.lm_head.weight[256] = 1.0
    return m


def test_reply_joins_the_history_and_the_next_prompt_shows_it() -> None:
    tok = TemplateTokenizer()
    session = ChatSession(model(), tok, system="be brief", max_new_tokens=5)
    pieces: list[str] = []
    reply = session.send("hi", on_text=pieces.append)
    assert "".join(pieces) == reply
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant"]
    assert session.messages[-1]["content"] == reply
    session.send("again")
    assert tok.rendered[-1].startswith(f"<system>be brief<user>hi<assistant>{reply}<user>again")
    session.reset()
    assert session.messages == [{"role": "system", "content": "be brief"}]


def test_reply_stops_at_the_end_token() -> None:
    session = ChatSession(model(eos_first=True), TemplateTokenizer(), max_new_tokens=20)
    assert session.send("hi") == ""
    assert session.stop_ids() == {256, 257}


def test_conversation_longer_than_the_context_is_refused() -> None:
    session = ChatSession(model(), TemplateTokenizer(), max_new_tokens=5)
    with pytest.raises(ValueError, match=r"as long as the context max_len=160.*reset"):
        session.send("x" * 200)
    assert session.messages == []  # nothing half-added


def test_text_stream_waits_for_whole_characters() -> None:
    tok = TemplateTokenizer()
    seen: list[str] = []
    stream = TextStream(tok, {256}, seen.append)
    for b in "动物".encode():
        stream(torch.tensor([b]))
    stream(torch.tensor([256]))
    stream(torch.tensor([ord("x")]))  # after the end token: ignored
    assert seen == ["动", "物"] and stream.text() == "动物"


def test_base_model_tokenizer_is_refused() -> None:
    class Base:
        chat_template = None

    with pytest.raises(ValueError, match="gemma3-270m has no chat template"):
        check_chat_model(Base(), "gemma3-270m")
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        ChatSession(model(), TemplateTokenizer(), max_new_tokens=0)


def test_generate_stops_at_any_of_several_eos_ids() -> None:
    m = model(eos_first=True)
    ids = torch.tensor([[1, 2, 3]])
    out = m.generate(ids, max_new_tokens=5, eos_token_id=[257, 256])
    assert out.tolist() == [[1, 2, 3, 256]]
    with pytest.raises(ValueError, match="eos_token_id must be a token id in"):
        m.generate(ids, max_new_tokens=2, eos_token_id=[256, 999])
    with pytest.raises(ValueError, match="non-empty list"):
        m.generate(ids, max_new_tokens=2, eos_token_id=[])
