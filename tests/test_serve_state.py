"""The server's model state in-process: attention-kind views share the loaded weights and leave
the loaded model untouched; the optional dependencies are named when missing."""

from __future__ import annotations

import contextlib
import io
import sys

import pytest
import torch

from handformer.attention.kinds import FullAttention
from handformer.attention.local import LocalAttention
from handformer.cli import main
from handformer.serve import AttentionChoice, ModelState, compute
from handformer.serve.validation import parse_run


@pytest.fixture(scope="module")
def state():
    return ModelState()


def test_views_share_every_weight_and_leave_the_model_alone(state):
    local = state.variant(AttentionChoice("local", window_size=3))
    assert local is not state.model
    assert local is state.variant(AttentionChoice("local", window_size=3))  # built once
    assert local is not state.variant(AttentionChoice("local", window_size=7))
    assert state.variant(AttentionChoice("full")) is state.model
    # strided options that the kind does not use do not make a new view
    assert (state.variant(AttentionChoice("linear", stride=9))
            is state.variant(AttentionChoice("linear")))
    base = dict(state.model.named_parameters())
    for name, p in local.named_parameters():
        assert p is base[name], name  # the same tensor object: no copy of the weights
    for layer, base_layer in zip(local.blocks, state.model.blocks, strict=True):
        assert isinstance(layer.attn.attention, LocalAttention)
        assert type(base_layer.attn.attention) is FullAttention
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    compute.run(state, parse_run({"text": "a b c", "attention": "local", "window_size": 3,
                                  "heads": [[0, 1]]}, state))
    after = state.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # no hook is left behind: a plain forward equals the one before the ablated request
    batch = state.tokenizer(["a b c"])
    with torch.inference_mode():
        clean = state.model(**batch).last_hidden_state
        again = compute.run(state, parse_run({"text": "a b c"}, state))
    assert again["heads_ablated"] == []
    with torch.inference_mode():
        assert torch.equal(state.model(**batch).last_hidden_state, clean)


def test_bad_attention_options_name_the_field(state):
    with pytest.raises(ValueError, match="^window_size: "):
        parse_run({"text": "x", "attention": "local", "window_size": 2**31 + 1}, state)


def test_missing_starlette_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "starlette", None)  # import starlette -> ImportError
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["serve", "--port", "0"]) == 2
    assert err.getvalue().count("\n") == 1
    assert "pip install handformer[serve]" in err.getvalue()


def test_uncompressed_viewer_data_holds_the_same_weights():
    import base64
    import zlib

    import numpy as np

    from handformer.viz.data import RAW_LIMIT, encode_weights

    x = torch.softmax(torch.randn(2, 3, 300, 300) * 4, -1).numpy()  # over RAW_LIMIT bytes
    assert x.size > RAW_LIMIT
    packed, plain = encode_weights(x), encode_weights(x, compress=False, max_bytes=1000)
    assert packed["encoding"] == "deflate" and plain["encoding"] == "raw"
    assert plain["levels"] == packed["levels"] == 255 and plain["scale"] == packed["scale"]
    assert (zlib.decompress(base64.b64decode(packed["data"]))
            == base64.b64decode(plain["data"]))
    q = np.frombuffer(base64.b64decode(plain["data"]), np.uint8).reshape(x.shape)
    hi = x.max(axis=(2, 3))[..., None, None]
    assert np.abs(q / 255 * hi - x).max() <= hi.max() / 510 + 1e-7


def test_read_binary_refuses_other_bodies():
    import json
    import struct

    import pytest

    from handformer.serve.wire import read_binary

    header = json.dumps({"viewer": {"layers": 1, "heads": 1, "tokens": ["a", "b"],
                                    "key_tokens": None, "data_bytes": 4}}).encode()
    good = struct.pack("<4sI", b"HFW1", len(header)) + header + bytes([0, 1, 2, 3])
    assert read_binary(good)["viewer"]["data"].tolist() == [[[[0, 1], [2, 3]]]]
    with pytest.raises(ValueError, match="not a handformer binary answer"):
        read_binary(b'{"model": "x"}')
    with pytest.raises(ValueError, match="cut short"):
        read_binary(good[:20])
    with pytest.raises(ValueError, match="holds 3 weight bytes; the header says 4"):
        read_binary(good[:-1])
