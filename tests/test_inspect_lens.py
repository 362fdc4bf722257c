"""Logit lens and similarity lens against the models' own outputs and transformers."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import handformer as hf
from handformer.inspect.lens import lens_logits, logit_lens, similarity_lens
from handformer.pretrained import embed, load_bert
from handformer.pretrained.gpt2 import load_gpt2
from pretrained_util import tiny_checkpoint


def tiny_lm(norm_first: bool) -> hf.CausalLM:
    return hf.CausalLM(hf.CausalLMConfig(vocab_size=23, max_len=16, d_model=16, num_heads=2,
                                         num_layers=3, d_ff=32, norm_first=norm_first)).eval()


@pytest.mark.parametrize("norm_first", [True, False])
def test_lens_on_the_last_layer_is_the_models_logits(norm_first: bool) -> None:
    lm = tiny_lm(norm_first)
    ids = torch.randint(0, 23, (2, 9))
    with torch.inference_mode():
        logits = lm(ids).logits
    lens = lens_logits(lm, ids)
    assert lens.shape == (3, 2, 9, 23)
    torch.testing.assert_close(lens[-1], logits, rtol=0, atol=1e-6)
    top = logit_lens(lm, ids, k=4)
    expected = logits.softmax(-1).topk(4, dim=-1)
    torch.testing.assert_close(top.top_probs[-1], expected.values)
    assert torch.equal(top.top_ids[-1], expected.indices) and top.layers == [0, 1, 2]


@pytest.mark.parametrize("norm_first", [True, False])
def test_lens_on_a_middle_layer_is_the_truncated_model(norm_first: bool) -> None:
    """Layer i's lens = the logits of the same model cut after layer i."""
    lm = tiny_lm(norm_first)
    ids = torch.randint(0, 23, (1, 7))
    cut = copy.deepcopy(lm)
    cut.blocks = cut.blocks[:2]
    with torch.inference_mode():
        expected = cut(ids).logits
    torch.testing.assert_close(lens_logits(lm, ids, layers=[1])[0], expected, rtol=0,
                               atol=1e-6)


def test_logit_lens_matches_transformers_gpt2(tmp_path: Path) -> None:
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=3,
                                         n_head=2)
        ref = transformers.GPT2LMHeadModel(config).eval()
        ref.save_pretrained(tmp_path, safe_serialization=True)
    model, _ = load_gpt2(tmp_path, tokenizer=False)
    ids = torch.randint(0, 50, (2, 8))
    with torch.inference_mode():
        hidden = ref(ids, output_hidden_states=True).hidden_states  # embeddings + 3 layers
        # transformers applies ln_f to its last hidden state already; the others are raw.
        expected = [ref.lm_head(ref.transformer.ln_f(h)) for h in hidden[1:-1]]
        expected.append(ref.lm_head(hidden[-1]))
    got = lens_logits(model, ids)
    for i in range(3):
        torch.testing.assert_close(got[i], expected[i], rtol=1e-4, atol=1e-4)


def test_logit_lens_bad_input() -> None:
    lm = tiny_lm(True)
    ids = torch.randint(0, 23, (1, 5))
    with pytest.raises(ValueError, match=r"k must be an integer in 1\.\.23"):
        logit_lens(lm, ids, k=0)
    with pytest.raises(ValueError, match=r"layer 3 is out of range: the model has 3 layers, "
                                         r"valid layers are 0\.\.2"):
        logit_lens(lm, ids, layers=[3])
    with pytest.raises(TypeError, match="for encoders use similarity_lens"):
        logit_lens(hf.Encoder(lambda: hf.EncoderLayer(8, 2, 16), 1), ids)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object, object]:
    folder = tmp_path_factory.mktemp("bert")
    ref = tiny_checkpoint(folder, hidden_size=16, layers=3, heads=2, intermediate=24)
    return (*load_bert(folder), ref)


def test_similarity_lens_last_layer_is_the_embedding(tiny_bert: tuple) -> None:
    model, tokenizer, ref = tiny_bert
    a, b = "the cat sat on the mat", "a dog ran fast"
    lens = similarity_lens(model, tokenizer, a, b)
    assert lens.labels == ["embeddings", "layer 0", "layer 1", "layer 2"]
    both = embed([a, b], model=model, tokenizer=tokenizer)
    torch.testing.assert_close(lens.embeddings[-1], both[0], rtol=1e-5, atol=1e-6)
    assert lens.to_final[-1].item() == pytest.approx(1.0)
    assert lens.to_other[-1].item() == pytest.approx(
        F.cosine_similarity(both[0], both[1], dim=0).item(), abs=1e-6)
    # Every depth against transformers' hidden states, mean-pooled by hand.
    batch = tokenizer([a])
    with torch.inference_mode():
        hidden = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     output_hidden_states=True).hidden_states  # (N + 1) x (1, L, E)
    pooled = torch.stack([h[0].mean(0) for h in hidden]).double()  # (N + 1, E)
    torch.testing.assert_close(lens.embeddings.double(), pooled, rtol=1e-4, atol=1e-5)
    expected = F.cosine_similarity(pooled, pooled[-1:].expand_as(pooled), dim=-1)
    torch.testing.assert_close(lens.to_final, expected, rtol=1e-5, atol=1e-5)
    assert similarity_lens(model, tokenizer, a).to_other is None


def test_similarity_lens_bad_input(tiny_bert: tuple) -> None:
    model, tokenizer, _ = tiny_bert
    with pytest.raises(TypeError, match="for causal language models use logit_lens"):
        similarity_lens(tiny_lm(True), tokenizer, "the cat")
