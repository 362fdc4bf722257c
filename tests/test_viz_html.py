"""The HTML viewer file (without a browser): self-contained, escaped, data round-trips."""

import base64
import html
import json
import re
import zlib
from importlib import resources

import numpy as np
import pytest
import torch

from handformer import Encoder, EncoderLayer
from handformer.masks import window_mask
from handformer.viz import AttentionView, render_html, save_html
from handformer.viz.html import VIEWER_SCRIPTS

TOKENS = ["[CLS]", "the", "animal", "didn", "'", "t", "cross", "the", "street", "because",
          "it", "was", "too", "tired", "[SEP]"]


@pytest.fixture(scope="module")
def attentions():
    torch.manual_seed(2)
    enc = Encoder(EncoderLayer(32, 4, 64, dropout=0.0), 2).eval()
    with torch.no_grad():
        return enc(torch.randn(1, len(TOKENS), 32) * 3, need_weights=True).attentions


def payload(page):
    m = re.search(r'<script type="application/json" id="hf-data">(.*?)</script>', page, re.S)
    assert m is not None
    return json.loads(m.group(1))


def weights_of(data):
    raw = base64.b64decode(data["data"])
    if data["encoding"] == "deflate":
        raw = zlib.decompress(raw)
    N, H, Lq = data["layers"], data["heads"], len(data["tokens"])
    Lk = len(data["key_tokens"] or data["tokens"])
    q = np.frombuffer(raw, dtype=np.uint8).reshape(N, H, Lq, Lk).astype(np.float64)
    s = np.asarray(data["scale"]).reshape(N, H, 2)
    return s[..., :1, None] + q / data["levels"] * (s[..., 1:, None] - s[..., :1, None])


def test_self_contained_no_urls_and_assets_inlined(attentions, tmp_path):
    path = save_html(attentions, TOKENS, tmp_path / "index.html", title="Seed sentence")
    page = path.read_text(encoding="utf-8")
    assert "http://" not in page and "https://" not in page
    assert not re.search(r'<(script|link|img)[^>]+(src|href)="(?!data:)', page)
    assert "__HF_" not in page  # every placeholder filled
    assert "function drawHeat" in page and ".tok {" in page  # JS and CSS inline
    assert "<title>Seed sentence</title>" in page
    data = payload(page)
    assert data["tokens"] == TOKENS and data["layers"] == 2 and data["heads"] == 4
    assert data["encoding"] == "raw" and data["pattern"] is None


def test_one_inline_script_holds_the_viewer_files_in_order(attentions):
    """The viewer's script files, verbatim and in VIEWER_SCRIPTS order, inside one function
    (they share its names; none leaks to the page), then rollout.js, in one <script>."""
    page = render_html(attentions, TOKENS)
    scripts = re.findall(r"<script>(.*?)</script>", page, re.S)
    assert len(scripts) == 1
    script = scripts[0]
    files = resources.files("handformer.viz")
    parts = [files.joinpath(name).read_text(encoding="utf-8") for name in VIEWER_SCRIPTS]
    where = [script.index(part) for part in parts]
    assert where == sorted(where)
    assert script.strip().startswith('"use strict";\n(function () {\n' + parts[0])
    assert parts[-1] + "})();" in script
    rollout = files.joinpath("rollout.js").read_text(encoding="utf-8")
    assert script.rstrip().endswith(rollout.rstrip())
    for name, part in zip(VIEWER_SCRIPTS, parts, strict=True):
        assert "innerHTML" not in part, name  # text is set with textContent only
        assert '"use strict"' not in part, name  # the joined script is strict as a whole


def test_weights_round_trip(attentions):
    data = payload(render_html(attentions, TOKENS))
    ref = torch.stack([a[0] for a in attentions]).double().numpy()  # (N, H, L, L)
    np.testing.assert_allclose(weights_of(data), ref, atol=0.5 / 255 + 1e-6)


def test_hostile_tokens_are_escaped(tmp_path):
    tokens = ["</script><script>alert(1)</script>", "https://example.com/x", "a&b", "<!--"]
    page = render_html(torch.rand(4, 4), tokens, title="<b>x</b> & y")
    assert "https://" not in page and "alert(1)</script>" not in page
    assert "<title>&lt;b&gt;x&lt;/b&gt; &amp; y</title>" in page
    assert payload(page)["tokens"] == tokens


def test_pattern_bits_and_caption(attentions):
    L = len(TOKENS)
    pattern = window_mask(L, L, 3)
    data = payload(render_html(attentions, TOKENS, pattern=pattern,
                               pattern_label="Local attention, window 3"))
    bits = np.unpackbits(np.frombuffer(base64.b64decode(data["pattern"]["bits"]), np.uint8))
    np.testing.assert_array_equal(bits[:L * L].reshape(L, L).astype(bool), pattern.numpy())
    label = data["pattern"]["label"]
    n = int(pattern.sum())
    assert label.startswith("Local attention, window 3.")
    assert f"{n} of {L * L} pairs" in label and "at most 3 per query instead of 15" in label


@pytest.mark.parametrize("L, window, causal, expected", [
    (11, 21, True, "Keys each query may reach: 66 of 121 pairs (55%); up to all 11 keys per "
                   "query."),
    (11, 31, False, "Keys each query may reach: 121 of 121 pairs (100%); up to all 11 keys per "
                    "query."),
    (11, 5, True, "Keys each query may reach: 30 of 121 pairs (25%); at most 3 per query "
                  "instead of 11."),
])
def test_reach_caption_when_the_window_covers_the_text(L, window, causal, expected):
    """Issue 33, item 16: "at most 11 per query instead of 11" said nothing."""
    from handformer.viz.html import describe_pattern

    allowed = window_mask(L, L, window).numpy()
    if causal:
        allowed &= np.tril(np.ones((L, L), dtype=bool))
    assert describe_pattern(allowed) == expected


def test_cross_attention_needs_key_tokens():
    w = torch.rand(1, 2, 3, 5)
    with pytest.raises(ValueError, match="pass key_tokens"):
        render_html(w, list("abc"))
    data = payload(render_html(w, list("abc"), key_tokens=list("vwxyz")))
    assert data["key_tokens"] == list("vwxyz")


@pytest.mark.parametrize("kwargs, match", [
    ({"layer": 2}, r"layer=2 is out of range: valid layers are 0\.\.1"),
    ({"head": 4}, r"head=4 is out of range: valid heads are 0\.\.3"),
    ({"view": "grid"}, "view must be"),
])
def test_bad_options(attentions, kwargs, match):
    with pytest.raises(ValueError, match=match):
        render_html(attentions, TOKENS, **kwargs)


def test_unwritable_path_raises_oserror(attentions, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        save_html(attentions, TOKENS, tmp_path / "file" / "index.html")


def test_notebook_object(attentions, tmp_path):
    view = AttentionView(attentions, TOKENS, height=500, title="nb")
    frame = view._repr_html_()
    assert frame.startswith("<iframe srcdoc=\"") and "height:500px" in frame
    inner = html.unescape(re.search(r'srcdoc="([^"]*)"', frame).group(1))
    assert inner == view.html() and payload(inner)["tokens"] == TOKENS
    assert view.save(tmp_path / "v.html").read_text(encoding="utf-8") == view.html()
    with pytest.raises(ValueError, match="height must be an int >= 100"):
        AttentionView(attentions, TOKENS, height=10)
    with pytest.raises(ValueError, match="tokens has 16 entries"):
        AttentionView(attentions, TOKENS + ["x"])
