"""``handformer viz`` shows the head its summary calls strongest, leaves the attention sink out,
keeps the attention budget ``serve`` keeps, and fits its titles (issue 33, items 1-3)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from handformer.cli import main

SEED = "The animal didn't cross the street because it was too tired"
HEAD_LINE = re.compile(r"head\.png shows layer (\d+), head (\d+)")
LINK = re.compile(r"^layer (\d+): .*strongest link (.+) -> (.+) (\d\.\d\d) \(head (\d+)\)$",
                  re.M)


def payload(path):
    page = path.read_text(encoding="utf-8")
    m = re.search(r'<script type="application/json" id="hf-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1))


def run(capsys, *argv):
    code = main(["viz", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def strongest(out: str) -> tuple[int, int, str, str]:
    """The summary's strongest link, read from the printed lines: (layer, head, query, key)."""
    links = [(float(w), int(n), int(h), q, k) for n, q, k, w, h in LINK.findall(out)]
    assert links, out
    _, layer, head, q, k = max(links, key=lambda t: t[0])
    return layer, head, q, k


def test_make_demo_shows_the_head_its_summary_calls_strongest(tmp_path, capsys):
    code, out, err = run(capsys, SEED, "--out", str(tmp_path))
    assert code == 0, err
    shown = tuple(int(g) for g in HEAD_LINE.search(out).groups())
    layer, head, q, k = strongest(out)
    assert shown == (layer, head)
    assert f"head.png shows layer {layer}, head {head}: the strongest link, {q} -> {k}" in out
    data = payload(tmp_path / "index.html")  # the page opens on the same head
    assert (data["layer"], data["head"]) == shown


# ---- planted attention, run through the command ---------------------------------------------

N, H, L = 6, 12, 15
WORDS = ["When", "the", "cat", "sat", "on", "the", "mat", "it", "was", "very", "happy",
         "and", "then", "it", "slept"]


def _planted_run(monkeypatch, attentions: list[torch.Tensor]) -> None:
    """Make ``viz`` draw ``attentions`` on ``WORDS`` instead of running the bundled model."""
    import handformer.commands.viz as viz

    def fake(args, text, device):  # noqa: ANN001, ANN202
        return viz._Run("planted-model", "full attention", list(WORDS),
                        [a.clone() for a in attentions], None, "Full attention", None, None,
                        [False] * L)

    monkeypatch.setattr(viz, "_run_bert", fake)


def _uniform() -> list[torch.Tensor]:
    return [torch.full((1, H, L, L), 1.0 / L) for _ in range(N)]


@pytest.mark.parametrize("layer, head", [(4, 1), (5, 10)])
def test_viz_picks_a_deep_head_and_the_page_opens_on_it(monkeypatch, tmp_path, capsys, layer,
                                                         head):
    x = _uniform()
    x[layer][0, head, 10] = 0.1 / (L - 1)
    x[layer][0, head, 10, 3] = 0.9  # happy -> sat
    _planted_run(monkeypatch, x)
    code, out, err = run(capsys, "planted", "--out", str(tmp_path))
    assert code == 0, err
    assert (f"head.png shows layer {layer}, head {head}: the strongest link, happy -> sat 0.90"
            in out)
    data = payload(tmp_path / "index.html")
    assert (data["layer"], data["head"]) == (layer, head)


def _sink_heavy() -> list[torch.Tensor]:
    """Position 0 ("When") takes 0.9 of every query in every head, 0.97 in layer 1, head 5;
    one weaker link, was -> cat 0.30, in layer 3, head 2."""
    x = []
    for _ in range(N):
        a = torch.full((1, H, L, L), 0.1 / (L - 1))
        a[..., 0] = 0.9
        x.append(a)
    x[1][0, 5, :, 1:] = 0.03 / (L - 1)
    x[1][0, 5, :, 0] = 0.97
    x[3][0, 2, 8, 1:] = 0.6 / (L - 2)
    x[3][0, 2, 8, 2] = 0.3
    return x


def test_the_first_token_is_an_attention_sink_and_the_output_says_so(monkeypatch, tmp_path,
                                                                      capsys):
    _planted_run(monkeypatch, _sink_heavy())
    code, out, err = run(capsys, "planted", "--out", str(tmp_path))
    assert code == 0, err
    assert "head.png shows layer 3, head 2: the strongest link, was -> cat 0.30" in out
    assert " -> When " not in out  # no summary line is about the sink
    assert ("the first token When is left out of the links and the head choice as an attention "
            "sink (it gets 90% of all attention); --include-sink counts it") in out
    assert payload(tmp_path / "index.html")["layer"] == 3

    code, out, err = run(capsys, "planted", "--out", str(tmp_path), "--include-sink")
    assert code == 0, err
    assert "head.png shows layer 1, head 5: the strongest link, " in out
    assert re.search(r"^layer 1: .*strongest link \S+ -> When 0\.97 \(head 5\)$", out, re.M)
    assert "attention sink" not in out


def test_a_sink_on_a_real_llm_is_left_out(smollm2, smollm2_file, tmp_path, capsys,
                                          monkeypatch):
    """SmolLM2 adds no <bos>: its first word is the sink every layer parks its weight on."""
    import handformer.commands.generate as generate

    # the session's SmolLM2 (what `viz --model FILE` loads, loaded once for every test file)
    monkeypatch.setattr(generate, "load_model_and_tokenizer", lambda *a, **k: smollm2)
    code, out, err = run(capsys, "When the cat sat on the mat it was very happy",
                         "--model", str(smollm2_file), "--out", str(tmp_path))
    assert code == 0, err
    summary = re.findall(r"^layer \d+: .*$", out, re.M)
    assert len(summary) == 30
    assert not [ln for ln in summary if "-> When " in ln]
    assert re.search(r"the first token When is left out of the links and the head choice as "
                     r"an attention sink \(it gets \d+% of all attention\)", out)
    shown = tuple(int(g) for g in HEAD_LINE.search(out).groups())
    assert shown == strongest(out)[:2]


@pytest.fixture(scope="module")
def char_lm(tmp_path_factory):
    """A tiny random causal LM with a character vocabulary, as `handformer train` saves it,
    in a folder with a long name (the figures' titles carry it)."""
    from handformer.models.causal_lm import CausalLM
    from handformer.models.causal_lm_config import CausalLMConfig
    from handformer.train.data import CharVocab

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("m") / "gemma3-270m-it-a-rather-long-model-folder-name"
    vocab = CharVocab(list("abcdefghijklmnopqrstuvwxyz .'"))
    config = CausalLMConfig(vocab_size=len(vocab), max_len=64, d_model=32, num_heads=2,
                            num_layers=2, d_ff=64, attention="local", window_size=5)
    CausalLM(config).save_pretrained(folder)
    vocab.save(folder / "vocab.json")
    return folder


def test_one_token_says_there_is_no_link(char_lm, tmp_path, capsys):
    code, out, err = run(capsys, "a", "--model", str(char_lm), "--out", str(tmp_path))
    assert code == 0, err
    assert "1 token, 2 layers x 2 heads; head.png shows layer 0, head 0\n" in out
    assert "TEXT is one token (a): there is no link between two tokens to report" in out
    assert (tmp_path / "head.png").is_file() and (tmp_path / "index.html").is_file()


# ---- the attention budget viz and serve share ------------------------------------------------


def test_one_budget_for_viz_and_serve():
    from handformer.serve import state
    from handformer.viz import budget

    assert state.VIEW_BUDGET is budget.VIEW_BUDGET and state.view_limit is budget.view_limit
    assert budget.view_limit(30, 9) == 544  # SmolLM2-135M
    assert 30 * 9 * 544**2 <= budget.VIEW_BUDGET < 30 * 9 * 545**2
    assert (budget.describe_cost(30, 9, 1600)
            == "30 layers x 9 heads x 1600\u00b2 = 691 M values (2.8 GB)")


def test_a_text_over_the_budget_is_refused_up_front(char_lm, tmp_path, capsys, monkeypatch):
    import handformer.models.causal_lm as causal_lm
    from handformer.viz import budget

    monkeypatch.setattr(budget, "VIEW_BUDGET", 2 * 2 * 20**2)  # 20 tokens fit this model
    calls = []
    forward = causal_lm.CausalLM.forward
    monkeypatch.setattr(causal_lm.CausalLM, "forward",
                        lambda *a, **k: calls.append(1) or forward(*a, **k))
    text = "abcd " * 6  # 30 characters, one token each
    code, out, err = run(capsys, text, "--model", str(char_lm), "--out", str(tmp_path / "a"))
    assert code == 2 and out == "" and not calls  # refused before the model ran
    assert err.count("\n") == 1
    assert ("TEXT is 30 tokens for gemma3-270m-it-a-rather-long-model-folder-name: its "
            "attention would be 2 layers x 2 heads x 30\u00b2 = 3600 values (14 kB), more than "
            "the 1600 values (6 kB) viz and serve allow; pass --max-tokens 20 (or fewer) to "
            "show the first 20 tokens") in err

    code, out, err = run(capsys, text, "--model", str(char_lm), "--out", str(tmp_path / "b"),
                         "--max-tokens", "25")
    assert code == 2 and not calls
    assert err.count("\n") == 1  # no note about the cut before the refusal
    assert ("--max-tokens 25 is over the attention budget for gemma3-270m-it-a-rather-long-"
            "model-folder-name: 2 layers x 2 heads x 25\u00b2 = 2500 values (10 kB), more than "
            "the 1600 values (6 kB) viz and serve allow; at most 20 tokens fit this model") in err

    code, out, err = run(capsys, text, "--model", str(char_lm), "--out", str(tmp_path / "c"),
                         "--max-tokens", "20")
    assert code == 0, err
    assert "note: the text has 30 tokens here; only the first 20 are shown (--max-tokens 20)" in err
    assert len(payload(tmp_path / "c" / "index.html")["tokens"]) == 20


@pytest.mark.parametrize("argv, message", [
    (["--max-tokens", "0"], "--max-tokens must be an integer in [1, 2147483647], got 0"),
    (["--max-tokens", "1"], "--max-tokens 1 is too small for all-MiniLM-L6-v2: its tokenizer "
                            "adds [CLS] and [SEP], so at least 2"),
])
def test_bad_max_tokens(tmp_path, capsys, argv, message):
    code, out, err = run(capsys, SEED, "--out", str(tmp_path), *argv)
    assert code == 2 and err == f"handformer viz: error: {message}\n"


def test_max_tokens_cuts_an_encoder_text(tmp_path, capsys):
    code, out, err = run(capsys, SEED, "--out", str(tmp_path), "--max-tokens", "6")
    assert code == 0, err
    assert "only the first 6 are shown (--max-tokens 6)" in err
    tokens = payload(tmp_path / "index.html")["tokens"]
    assert tokens == ["[CLS]", "the", "animal", "didn", "'", "[SEP]"]


# ---- titles inside their figures -------------------------------------------------------------


def _outside(fig) -> list[str]:  # noqa: ANN001 - a matplotlib Figure
    """The titles (suptitle, axes titles) that reach past the figure's left or right edge, and
    any warning of the layout (a title so tall that the axes collapse)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [fig._suptitle] if fig._suptitle is not None else []
    texts += [ax.title for ax in fig.axes]
    bad = []
    for t in texts:
        box = t.get_window_extent(renderer)
        if t.get_text() and (box.x0 < 0 or box.x1 > fig.bbox.width):
            bad.append(f"{t.get_text()!r}: x {box.x0:.0f}..{box.x1:.0f} of {fig.bbox.width:.0f}")
    return bad + [str(w.message) for w in caught]


KIND = "causal attention; 15 of 18 layers see the last 512 tokens (pattern: layer 0)"


@pytest.mark.parametrize("L_", [3, 15, 120])
def test_long_titles_stay_inside_the_figures(L_):
    from handformer.viz import plot_attention, plot_heads

    tokens = [f"t{i}" for i in range(L_)]
    w = torch.rand(L_, L_)
    causal = torch.ones(L_, L_, dtype=torch.bool).tril()
    figs = [plot_attention(w, tokens, title=f"gemma3-270m: layer 5, head 2 ({KIND})",
                           pattern=causal),
            plot_attention(w, tokens, title=f"gemma3-270m: layer 5, head 2 ({KIND})"),
            plot_heads([torch.rand(1, 4, L_, L_) for _ in range(18)], tokens,
                       title=f"gemma3-270m: every head ({KIND}), each scaled to its maximum")]
    for fig in figs:
        assert _outside(fig) == []
        assert "gemma3-270m" in (fig._suptitle or fig.axes[0].title).get_text()


def test_viz_titles_stay_inside_the_figures(char_lm, tmp_path, capsys, monkeypatch):
    import handformer.viz as viz_pkg

    figures = []
    save = viz_pkg.save_figure
    monkeypatch.setattr(viz_pkg, "save_figure", lambda fig, path: figures.append(fig)
                        or save(fig, path))
    long_text = "the quick brown fox jumps over the lazy dog and then it sleeps"
    folder = tmp_path / ("gemma3-270m-" + "x" * 60)
    shutil.copytree(char_lm, folder)
    code, out, err = run(capsys, long_text, "--model", str(folder), "--out", str(tmp_path / "o"),
                         "--rollout", "--attribution")
    assert code == 0, err
    assert len(figures) == 5  # head.png, model.png, rollout.png, attribution(_heads).png
    for fig in figures:
        assert _outside(fig) == []
    assert figures[0].axes[0].get_title().startswith("gemma3-270m-xxx")  # wrapped, not cut
