"""Bad input to the core raises clear errors that name the argument and the shapes/values."""

from __future__ import annotations

import pytest
import torch

import handformer as hf
from handformer import masks
from handformer import scaled_dot_product_attention as sdpa


def qkv(q=(2, 4, 8), k=(2, 5, 8), v=(2, 5, 8), dtype=torch.float32):
    return (torch.randn(q, dtype=dtype), torch.randn(k, dtype=dtype),
            torch.randn(v, dtype=dtype))


@pytest.mark.parametrize("args,kwargs,exc,message", [
    ((510, 8), {}, ValueError, "d_model=510 is not divisible by num_heads=8"),
    ((512, 0), {}, ValueError, "num_heads must be a positive integer, got 0"),
    ((512, -2), {}, ValueError, "num_heads must be a positive integer, got -2"),
    ((512, 8), {"dropout": 1.0}, ValueError, "dropout must be a probability in [0, 1), got 1.0"),
    ((512, 8), {"dropout": -0.1}, ValueError, "dropout must be a probability in [0, 1)"),
    ((512, 8), {"attention": 42}, TypeError, "attention must be an attention kind"),
    ((512, 8), {"attention": "sparse"}, ValueError, "attention must be one of full, local"),
])
def test_mha_construction_errors(args, kwargs, exc, message):
    with pytest.raises(exc) as info:
        hf.MultiHeadAttention(*args, **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("kwargs,message", [
    ({"activation": "swish"},
     "activation must be one of ['gelu', 'gelu_tanh', 'relu', 'silu'], got 'swish'"),
    ({"dropout": 2}, "dropout must be a probability in [0, 1), got 2"),
])
def test_layer_construction_errors(kwargs, message):
    with pytest.raises(ValueError) as info:
        hf.EncoderLayer(16, 4, 32, **kwargs)
    assert message in str(info.value)


def test_encoder_num_layers_error():
    with pytest.raises(ValueError, match="num_layers must be a positive integer, got 0"):
        hf.Encoder(hf.EncoderLayer(16, 4, 32), 0)


@pytest.mark.parametrize("shapes,message", [
    (((2, 4, 8), (2, 5, 6), (2, 5, 8)),
     "q and k must have the same head dim D: q (2, 4, 8) has D=8, k (2, 5, 6) has D=6"),
    (((2, 4, 8), (2, 5, 8), (2, 6, 8)),
     "k and v must have the same length L_k: k (2, 5, 8), v (2, 6, 8)"),
    (((2, 4, 8), (3, 5, 8), (3, 5, 8)),
     "q, k and v must have the same batch dims: q (2, 4, 8), k (3, 5, 8), v (3, 5, 8)"),
    (((2, 4, 8), (2, 0, 8), (2, 0, 8)), "L_k == 0: k (2, 0, 8) has no keys to attend to"),
    (((8,), (5, 8), (5, 8)), "q must be (..., L, D), got shape (8,)"),
])
def test_sdpa_shape_errors(shapes, message):
    with pytest.raises(ValueError) as info:
        sdpa(*qkv(*shapes))
    assert message in str(info.value)


def test_sdpa_dtype_errors():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"q, k and v must share one dtype, got q torch.float32, "
                                        r"k torch.float64"):
        sdpa(q, k.double(), v)
    with pytest.raises(TypeError, match="q must be a floating tensor, got dtype torch.int64"):
        sdpa(q.long(), k, v)


def test_integer_mask_names_the_convention_and_converters():
    q, k, v = qkv()
    with pytest.raises(TypeError) as info:
        sdpa(q, k, v, torch.ones(4, 5, dtype=torch.long))
    message = str(info.value)
    assert "mask has dtype torch.int64" in message
    assert "True = may attend" in message
    assert "from_hf_attention_mask" in message and "from_torch_mask" in message


def test_mask_that_does_not_broadcast():
    q, k, v = qkv()
    with pytest.raises(ValueError) as info:
        sdpa(q, k, v, torch.ones(3, 5, dtype=torch.bool))
    assert "mask of shape (3, 5) does not broadcast to the attention scores' shape (2, 4, 5)" \
        in str(info.value)


def test_mask_may_not_enlarge_the_output():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"mask of shape \(7, 2, 4, 5\) does not broadcast"):
        sdpa(q, k, v, torch.ones(7, 2, 4, 5, dtype=torch.bool))


def test_dropout_p_error():
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got 1.5"):
        sdpa(*qkv(), dropout_p=1.5)


def test_mha_input_shape_errors():
    mha = hf.MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match=r"query must be \(B, L, 16\) \(batch-first\), got shape "
                                         r"\(2, 5, 12\)"):
        mha(torch.randn(2, 5, 12))
    with pytest.raises(ValueError, match=r"query, key and value must share the batch size B"):
        mha(torch.randn(2, 5, 16), torch.randn(3, 5, 16))
    with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 1, 4\) does not broadcast"):
        mha(torch.randn(2, 5, 16), mask=torch.ones(2, 1, 1, 4, dtype=torch.bool))


@pytest.mark.parametrize("module", [
    hf.SinusoidalPositionalEncoding(8, max_len=10),
    hf.LearnedPositionalEmbedding(10, 8),
])
def test_positional_too_long(module):
    with pytest.raises(ValueError, match="sequence length 11 \\(offset 0\\) exceeds max_len=10"):
        module(torch.zeros(1, 11, 8))
    with pytest.raises(ValueError, match="sequence length 4 \\(offset 8\\) exceeds max_len=10"):
        module(torch.zeros(1, 4, 8), offset=8)


def test_mask_helpers_errors():
    with pytest.raises(ValueError, match="attention_mask must hold only 0 and 1"):
        masks.from_hf_attention_mask(torch.tensor([[1, 2, 0]]))
    with pytest.raises(ValueError, match="a length \\(5\\) exceeds max_len=3"):
        masks.padding_mask(torch.tensor([5, 1]), max_len=3)
    with pytest.raises(ValueError, match="lengths_or_attention_mask must be lengths"):
        masks.padding_mask(torch.ones(1, 1, 3))
