"""The two shipped LLMs against transformers reading the same GGUF files (issue 21).

SmolLM2-135M-Instruct (``llama`` architecture, Q4_1) and Gemma 3 270M (``gemma3``, Q4_K_M)
load through ``load_lm`` and give transformers' logits (float32, eager) within 2e-3 with the
same argmax at every position, on English, Chinese and code; greedy generation agrees for 20
tokens; the instruct model chats. Each model is loaded once per session (conftest).
"""

from __future__ import annotations

import pytest
import torch

from conftest import hf_gguf_reference

PROMPTS = {
    "english": "The animal didn't cross the street because it was too tired.",
    "chinese": "动物没有过马路，因为它太累了。",
    "code": "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
}


def _compare(model, tokenizer, reference, text: str) -> None:  # noqa: ANN001
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=True)])
    with torch.no_grad():
        ours = model(ids).logits
        theirs = reference(ids).logits
    assert ours.shape == theirs.shape
    err = (ours - theirs).abs().max().item()
    assert err <= 2e-3, f"max |logit difference| {err:.2e} on {text!r}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_smollm2_logits_equal_transformers(smollm2, smollm2_file, name: str) -> None:
    model, tokenizer = smollm2
    _compare(model, tokenizer, hf_gguf_reference(smollm2_file), PROMPTS[name])


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_gemma3_logits_equal_transformers(gemma3, gemma3_file, name: str) -> None:
    model, tokenizer = gemma3
    _compare(model, tokenizer, hf_gguf_reference(gemma3_file), PROMPTS[name])


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_greedy_generation_equals_transformers(which: str, request) -> None:  # noqa: ANN001
    model, tokenizer = request.getfixturevalue(which)
    reference = hf_gguf_reference(request.getfixturevalue(f"{which}_file"))
    prompt = PROMPTS["chinese" if which == "gemma3" else "english"]
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=True)])
    ours = model.generate(ids, max_new_tokens=20)
    with torch.no_grad():
        theirs = reference.generate(ids, max_new_tokens=20, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
    assert ours.tolist() == theirs.tolist()


def test_gemma3_continues_chinese(gemma3) -> None:
    """The Chinese sentence of the issue: Gemma 3 continues "因为它太" as transformers did."""
    model, tokenizer = gemma3
    ids = torch.tensor([tokenizer.encode("动物没有过马路，因为它太", add_special_tokens=True)])
    out = model.generate(ids, max_new_tokens=3)
    assert tokenizer.decode(out[0, ids.shape[1]:].tolist()).startswith("慢了")


def test_smollm2_chats(smollm2) -> None:
    from handformer.chat.session import ChatSession

    model, tokenizer = smollm2
    session = ChatSession(model, tokenizer, max_new_tokens=40)
    reply = session.send("What is the capital of France?")
    assert "Paris" in reply
    assert session.messages[-1] == {"role": "assistant", "content": reply}


def test_gemma3_refuses_chat(gemma3) -> None:
    from handformer.chat.session import ChatSession

    model, tokenizer = gemma3
    with pytest.raises(ValueError, match="no chat template"):
        ChatSession(model, tokenizer)
