"""Pictures and the HTML rollout view of handformer.inspect; ``handformer viz --rollout``."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.image import imread

import handformer as hf
from handformer.cli import main
from handformer.inspect import (
    attention_flow,
    attention_rollout,
    faithfulness,
    logit_lens,
    similarity_lens,
)
from handformer.pretrained import load_bert
from handformer.viz import (
    plot_faithfulness,
    plot_logit_lens,
    plot_rollout,
    plot_similarity_lens,
    render_html,
    rollout_payload,
    save_figure,
)
from pretrained_util import tiny_checkpoint

SEED = "The animal didn't cross the street because it was too tired"


def payload(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="hf-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object, Path]:
    folder = tmp_path_factory.mktemp("bert")
    tiny_checkpoint(folder, hidden_size=16, layers=2, heads=2, intermediate=24)
    return (*load_bert(folder), folder)


def run_tiny(tiny: tuple, text: str = "the cat sat on the mat") -> tuple[list, list[str]]:
    model, tokenizer, _ = tiny
    enc = tokenizer.encode_batch([text])
    with torch.inference_mode():
        return list(model(**tokenizer.pad(enc), need_weights=True).attentions), enc[0].tokens


def test_plot_rollout_draws_the_matrix_and_the_row(tiny: tuple, tmp_path: Path) -> None:
    att, tokens = run_tiny(tiny)
    R = attention_rollout(att)
    fig = plot_rollout(R, tokens, raw=att[-1][0].mean(0)[0], flow=attention_flow(att)[0, 0])
    heat, bars = fig.axes[:2]  # the matrix and the bars (then the colour bar)
    np.testing.assert_allclose(heat.images[0].get_array(), R[0].numpy(), rtol=1e-6)
    assert len(bars.patches) == 3 * len(tokens)  # raw, rollout, flow per token
    assert [t.get_text() for t in bars.get_legend().get_texts()] == ["raw attention",
                                                                      "rollout", "flow"]
    path = save_figure(fig, tmp_path / "rollout.png")
    assert imread(path).std() > 0.05
    with pytest.raises(ValueError, match="row 9 is out of range"):
        plot_rollout(R, tokens, row=9)
    with pytest.raises(ValueError, match="flow must hold one score per token"):
        plot_rollout(R, tokens, flow=torch.ones(3))


def test_rollout_payload_round_trip() -> None:
    att = [torch.rand(1, 2, 5, 5).softmax(-1) for _ in range(3)]
    R = attention_rollout(att)
    data = rollout_payload(R, row=-1, raw=att[-1][0].mean(0)[-1])
    levels = np.frombuffer(base64.b64decode(data["matrix"]), np.uint8).reshape(5, 5)
    np.testing.assert_allclose(levels * data["hi"] / 255, R[0].numpy(),
                               atol=data["hi"] / 255 / 2 + 1e-9)
    assert data["row"] == 4 and data["flow"] is None
    np.testing.assert_allclose(data["rollout_row"], R[0, 4].numpy(), atol=1e-6)
    with pytest.raises(ValueError, match="rollout must be one finite"):
        rollout_payload(torch.rand(2, 5, 5))
    with pytest.raises(ValueError, match="raw must hold 5 finite scores"):
        rollout_payload(R, raw=[1.0, 2.0])


def test_html_page_carries_the_rollout_view(tiny: tuple) -> None:
    att, tokens = run_tiny(tiny)
    view = rollout_payload(attention_rollout(att), flow=attention_flow(att)[0, 0])
    page = render_html(att, tokens, rollout=view)
    assert payload(page)["rollout"] == json.loads(json.dumps(view))
    assert 'section.id = "view-rollout"' in page  # rollout.js is inlined
    assert payload(render_html(att, tokens))["rollout"] is None


def test_plot_faithfulness_and_lenses(tiny: tuple) -> None:
    model, tokenizer, _ = tiny
    result = faithfulness(model, tokenizer, "the cat sat on the mat")
    fig = plot_faithfulness(result)
    strip, table = fig.axes[:2]
    assert [t.get_text() for t in strip.get_yticklabels()] == list(result.methods)
    cells = [t.get_text() for t in table.texts]
    assert cells[3] == f"{result.correlation[0, 3].item():.2f}"  # raw attention vs ablation
    lens = similarity_lens(model, tokenizer, "the cat", "a dog")
    lines = plot_similarity_lens(lens, text="the cat", other="a dog").axes[0].get_lines()
    np.testing.assert_allclose(lines[0].get_ydata(), lens.to_final.numpy())
    np.testing.assert_allclose(lines[1].get_ydata(), lens.to_other.numpy())

    lm = hf.CausalLM(hf.CausalLMConfig(vocab_size=23, max_len=16, d_model=8, num_heads=2,
                                       num_layers=2, d_ff=16)).eval()
    ids = torch.randint(0, 23, (1, 6))
    top = logit_lens(lm, ids, k=2)
    vocab = [f"t{i}" for i in range(23)]
    ax = plot_logit_lens(top, [vocab[i] for i in ids[0].tolist()], vocab).axes[0]
    assert [t.get_text() for t in ax.texts] == [vocab[i] for i in
                                                top.top_ids[:, 0, :, 0].reshape(-1).tolist()]
    with pytest.raises(ValueError, match="batch_index=1 is out of range"):
        plot_logit_lens(top, vocab[:6], vocab, batch_index=1)


def test_cli_viz_rollout(tiny: tuple, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _, _, folder = tiny
    code = main(["viz", "the cat sat on the mat", "--model", str(folder), "--rollout",
                 "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"wrote {tmp_path / 'rollout.png'}" in out
    assert imread(tmp_path / "rollout.png").std() > 0.05
    data = payload((tmp_path / "index.html").read_text(encoding="utf-8"))
    view = data["rollout"]
    assert view["row"] == 0 and len(view["flow"]) == len(data["tokens"])
    model, tokenizer, _ = tiny
    att, _ = run_tiny(tiny)
    np.testing.assert_allclose(view["flow"], attention_flow(att)[0, 0].numpy(), atol=1e-6)
    # without the flag: no rollout.png, no view
    code = main(["viz", "the cat", "--model", str(folder), "--out", str(tmp_path / "plain")])
    assert code == 0 and not (tmp_path / "plain" / "rollout.png").exists()
    assert payload((tmp_path / "plain" / "index.html").read_text())["rollout"] is None


def test_cli_viz_rollout_causal_lm(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A causal LM folder: the row compared is the last token's."""
    from handformer.train.data import CharVocab

    folder = tmp_path / "lm"
    vocab = CharVocab(list("abcdefghijklmnopqrstuvwxyz "))
    config = hf.CausalLMConfig(vocab_size=len(vocab), max_len=24, d_model=16, num_heads=2,
                               num_layers=2, d_ff=32)
    hf.CausalLM(config).save_pretrained(folder)
    vocab.save(folder / "vocab.json")
    code = main(["viz", "the cat", "--model", str(folder), "--rollout", "--out",
                 str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 0, err
    view = payload((tmp_path / "out" / "index.html").read_text(encoding="utf-8"))["rollout"]
    assert view["row"] == 6  # 7 characters, the last one
    levels = np.frombuffer(base64.b64decode(view["matrix"]), np.uint8).reshape(7, 7)
    assert not levels[np.triu_indices(7, 1)].any()  # causal: nothing from later tokens
    assert view["flow"][-1] > 0 and len(view["flow"]) == 7
