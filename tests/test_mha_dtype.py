"""MultiHeadAttention names a dtype mismatch between input and weights (not torch's raw
"mat1 and mat2 must have the same dtype"), and still works under autocast."""

from __future__ import annotations

import pytest
import torch

import handformer as hf


def test_half_input_with_float_weights_names_both_dtypes_and_the_fix() -> None:
    mha = hf.MultiHeadAttention(16, 2)
    x = torch.randn(1, 3, 16)
    with pytest.raises(TypeError, match=r"query has dtype torch.float16 but .*weights are "
                                        r"torch.float32.*\.half\(\)"):
        mha(x.half())
    with pytest.raises(TypeError, match="query has dtype torch.float64"):
        mha(x.double())
    out, _ = mha.half()(x.half())  # the fix the message names works
    assert out.dtype == torch.float16


def test_autocast_mixed_dtypes_are_allowed() -> None:
    mha = hf.MultiHeadAttention(16, 2)
    x = torch.randn(1, 3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = mha(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), mha(x)[0], atol=0.1, rtol=0.1)
