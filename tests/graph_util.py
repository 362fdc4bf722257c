"""Tiny float64 models and transcoders for the attribution-graph tests."""

from __future__ import annotations

import torch

import handformer as hf
from handformer.features import Transcoder

GPT2 = dict(positional="learned")  # LayerNorm, biases, learned positions, GELU
LLAMA = dict(positional="rotary", norm="rms", num_kv_heads=2, qk_norm=True, mlp="gated",
             sandwich_norm=True, final_softcap=30.0, attn_softcap=20.0, bias=False,
             activation="gelu", embed_scale=4.0)


def tiny(kind: dict, dtype: torch.dtype = torch.float64, seed: int = 0
         ) -> tuple[hf.CausalLM, list[Transcoder], torch.Tensor]:
    torch.manual_seed(seed)
    model = hf.CausalLM(hf.CausalLMConfig(vocab_size=40, max_len=16, d_model=16, num_heads=4,
                                          num_layers=3, d_ff=32, dropout=0.0, **kind))
    model = model.to(dtype).eval()
    tcs = []
    for i in range(3):
        tc = Transcoder(16, 24, dtype=dtype, skip=i != 1)
        with torch.no_grad():  # biases everywhere, so the constants are not zero
            tc.b_enc.normal_(0, 0.3)
            tc.b_dec.normal_(0, 0.3)
        tcs.append(tc)
    return model, tcs, torch.randint(0, 40, (6,))
