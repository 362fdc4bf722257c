"""Issue 24, sharp edges: each test runs what the user ran (command or call) and checks the
one-line answer that replaced a traceback or a misleading message.

Items: 1 (integer options bounded), 2 (reverse beyond length 64), 3 (faithfulness on a causal
LM), 5 (atomic writers name the target), 6 (device / path / metric), 7 (attention kinds by
name), 8 (no hub), 9 (image format from the extension); 10-11 (one rule for the CLI and the
API) are in ``test_one_rule.py``.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import matplotlib
import pytest
import torch

import handformer as hf
from cli_util import run_cli
from handformer import masks
from handformer.attention import attention_kind
from handformer.checks import MAX_INT, OptionError
from handformer.cli import build_parser
from handformer.pretrained import load_bert, load_gpt2
from pretrained_util import tiny_checkpoint, tiny_gpt2_folder

matplotlib.use("Agg")
HUGE = 99999999999999999999  # what the user typed


def cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    """Run ``handformer ARGV`` in-process; exit 0, or 2 with one line and no traceback."""
    return run_cli(capsys, [str(a) for a in argv])


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bert")
    tiny_checkpoint(folder, hidden_size=16, layers=1, heads=2, intermediate=16)
    return folder


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_gpt2_folder(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from handformer.train.data import CharVocab

    folder = tmp_path_factory.mktemp("lm")
    chars = list("abcdefgh ")
    hf.CausalLM(hf.CausalLMConfig(vocab_size=len(chars), max_len=32, d_model=8, num_heads=2,
                                  num_layers=1, d_ff=16)).save_pretrained(folder)
    CharVocab(chars).save(folder / "vocab.json")
    return folder


# ---- 1: integer options ------------------------------------------------------------------


@pytest.mark.parametrize("argv, flag", [
    (["--attention", "local", "--window-size", HUGE], "--window-size"),
    (["--attention", "strided", "--stride", HUGE], "--stride"),
    (["--attention", "strided", "--global-tokens", HUGE], "--global-tokens"),
])
def test_viz_huge_pattern_options_exit_2_naming_them(argv, flag, tmp_path, capsys) -> None:
    code, _, err = cli(capsys, "viz", "hello", *argv, "--out", tmp_path / "v")
    assert code == 2
    assert f"{flag} must be at most 2147483647 (2**31 - 1), got {HUGE}" in err
    assert not (tmp_path / "v").exists()  # refused before anything was made


def _int_options() -> list[tuple[str, str, str]]:
    """(command, flag, dest) of every integer option of every sub-command."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = []
    for command, p in sub.choices.items():
        for action in p._actions:
            if action.type is int and action.option_strings:
                found.append((command, action.option_strings[0], action.dest))
    return found


INT_OPTIONS = _int_options()


def test_the_int_options_are_all_found() -> None:
    names = {(c, f) for c, f, _ in INT_OPTIONS}
    assert {("viz", "--window-size"), ("generate", "--top-k"), ("train", "--steps"),
            ("train", "--length"), ("demo", "--seed"), ("heads", "--top"),
            ("serve", "--port"), ("embed", "--batch-size")} <= names
    assert len(INT_OPTIONS) >= 30


@pytest.mark.parametrize("command, flag, dest", INT_OPTIONS,
                         ids=[f"{c} {f}" for c, f, _ in INT_OPTIONS])
def test_every_int_option_refuses_a_huge_value_by_name(command, flag, dest, bert_dir, lm_dir,
                                                       tmp_path, capsys) -> None:
    base = {
        "demo": [],
        "embed": ["a b", "--model", bert_dir],
        "viz": ["the cat", "--model", bert_dir, "--out", tmp_path / "v"],
        "generate": ["--model", lm_dir, "--prompt", "ab"],
        "chat": ["--model", lm_dir],
        "heads": ["a b", "b a", "--model", bert_dir, "--out", tmp_path / "h"],
        "serve": ["--model", bert_dir],
        "train": ["copy", "--out", tmp_path / "run", "--steps", "1", "--no-progress"],
        "train-sae": ["--model", lm_dir, "--at", "blocks.0.hook_resid_post", "--out",
                      tmp_path / "run", "--no-progress"],
    }[command]
    kind = {"--window-size": ["--attention", "local"], "--stride": ["--attention", "strided"],
            "--global-tokens": ["--attention", "strided"]}.get(flag, [])
    code, _, err = cli(capsys, command, *base, *kind, flag, HUGE)
    assert code == 2
    assert flag in err or dest in err, err
    assert str(HUGE) in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("call, name", [
    (lambda: hf.LocalAttention(HUGE), "window_size"),
    (lambda: hf.local_attention(*[torch.randn(1, 3, 4)] * 3, window_size=HUGE), "window_size"),
    (lambda: masks.window_mask(4, 4, HUGE), "window_size"),
    (lambda: masks.strided_mask(4, 4, HUGE), "stride"),
    (lambda: hf.StridedAttention(HUGE), "stride"),
    (lambda: hf.StridedAttention(2, global_tokens=HUGE), "global_tokens"),
    (lambda: hf.strided_attention(*[torch.randn(1, 3, 4)] * 3, stride=2, global_tokens=HUGE),
     "global_tokens"),
    (lambda: __import__("handformer.attention.cache", fromlist=["_"]).KVCache(capacity=HUGE),
     "capacity"),
    (lambda: __import__("handformer.attention.cache", fromlist=["_"]).StaticKVCache(HUGE),
     "capacity"),
])
def test_python_api_bounds_name_the_argument(call, name) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be at most 2147483647 \(2\*\*31 - 1\)"):
        call()


def test_generate_max_new_tokens_and_top_k_are_bounded() -> None:
    lm = hf.CausalLM(hf.CausalLMConfig(vocab_size=11, max_len=8, d_model=8, num_heads=2,
                                       num_layers=1, d_ff=16))
    ids = torch.randint(11, (1, 3))
    with pytest.raises(ValueError, match="^max_new_tokens must be at most 2147483647"):
        lm.generate(ids, max_new_tokens=HUGE)
    with pytest.raises(ValueError, match="^top_k must be at most 2147483647"):
        lm.generate(ids, max_new_tokens=1, do_sample=True, top_k=HUGE)


def test_bounds_admit_real_model_configs() -> None:
    """A Hugging Face sliding_window of 131072 is window_size 2 * 131072 - 1 = 262143."""
    kind = hf.LocalAttention(262143)
    q = torch.randn(1, 2, 5, 4)
    out, w = kind(q, q, q, need_weights=True)
    ref, ref_w = hf.scaled_dot_product_attention(q, q, q, need_weights=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(w, ref_w)
    assert bool(masks.window_mask(5, 5, MAX_INT).all())
    assert hf.CausalLMConfig(vocab_size=5, max_len=8, d_model=8, num_heads=2, num_layers=1,
                             d_ff=8, attention="local", window_size=262143).window_size == 262143
    assert attention_kind("local", window_size=MAX_INT).window_size == MAX_INT


# ---- 2: reverse beyond 64 ------------------------------------------------------------------


TRAIN_SMALL = ["--steps", "1", "--d-model", "8", "--heads", "2", "--d-ff", "16", "--layers",
               "1", "--batch-size", "2", "--eval-size", "4", "--no-progress"]


@pytest.mark.parametrize("length", [100, 1000])
def test_train_reverse_beyond_64_runs(length, tmp_path, capsys) -> None:
    code, out, err = cli(capsys, "train", "reverse", "--length", length, "--out",
                         tmp_path / "x", *TRAIN_SMALL)
    assert code == 0, err
    assert "finished at step 1" in out


def test_the_user_command_length_100_default_options(tmp_path, capsys) -> None:
    """Exactly what the user ran (default model, batch and held-out set)."""
    code, out, err = cli(capsys, "train", "reverse", "--length", "100", "--steps", "1",
                         "--out", tmp_path / "x", "--no-progress")
    assert code == 0, err
    assert "finished at step 1" in out


def test_too_long_sequences_are_refused_up_front_with_the_limit(tmp_path, capsys) -> None:
    code, _, err = cli(capsys, "train", "reverse", "--length", "100000", "--steps", "1",
                       "--out", tmp_path / "x")
    assert code == 2
    assert "length must be at most 4096 for the synthetic tasks" in err
    assert "got 100000" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", ["copy", "reverse", "sort"])
@pytest.mark.parametrize("length", [30, 64, 100, 1000])
def test_long_held_out_sets_are_real_distinct_sequences(name, length) -> None:
    from handformer.train.tasks import SequenceTask

    task = SequenceTask(name, length=length, num_symbols=10, eval_size=20, seed=1)
    x = task.eval_x.long()
    assert x.shape == (20, length) and int(x.max()) < 10
    assert torch.unique(x, dim=0).shape[0] == 20  # distinct
    assert x.float().std() > 2  # random symbols, not a decoded hash (mostly zeros)
    batch = task.eval_batches(8)[0]
    if name == "reverse":  # the target is the input reversed
        n = length
        assert torch.equal(batch.targets[:, n:], batch.input_ids[:, :n].flip(-1))
    # training rows never equal a held-out row
    for step in range(3):
        train_x = task.batch(0, step, 0, 64).input_ids[:, :length] - 1
        same = (train_x[:, None, :] == x[None]).all(-1)  # (64, 20)
        assert not bool(same.any())


def test_short_held_out_sets_are_unchanged_exact_codes() -> None:
    """Up to 36**n < 2**62 the held-out set is what base-s codes gave before: the same
    sequences in the same order (runs resume and compare as before)."""
    from handformer.train.tasks import SequenceTask

    task = SequenceTask("reverse", length=8, num_symbols=10, eval_size=1000, seed=3)
    weights = 10 ** torch.arange(7, -1, -1)
    codes = (task.eval_x.long() * weights).sum(-1)
    assert torch.equal(codes, task.eval_codes)
    assert bool((codes[1:] > codes[:-1]).all())  # sorted, distinct
    assert task.eval_codes[:3].tolist() == [215000, 230773, 379941]  # pinned before the change


# ---- 3: faithfulness on a causal LM -----------------------------------------------------


def test_faithfulness_on_gpt2_says_it_needs_an_encoder(gpt2_dir) -> None:
    from handformer.inspect import faithfulness

    model, tok = load_gpt2(gpt2_dir)
    with pytest.raises(TypeError, match=r"^faithfulness needs a BERT-family encoder "
                                        r"\(BertModel.*got CausalLM"):
        faithfulness(model, tok, "text")


# ---- 5: atomic writers ---------------------------------------------------------------------


def _writers(tmp: Path) -> dict[str, object]:
    from handformer.train.checkpoint import atomic_write_bytes
    from handformer.viz import plot_attention, save_figure, save_html
    from handformer.viz.files import write_atomic
    from handformer.weights import save_safetensors, write_atomically

    att = [torch.rand(1, 2, 3, 3)]
    return {
        "save_html": lambda p: save_html(att, ["a", "b", "c"], p),
        "save_figure": lambda p: save_figure(plot_attention(att[0][0, 0], list("abc")), p),
        "write_atomic": lambda p: write_atomic(p, b"x"),
        "write_atomically": lambda p: write_atomically(p, lambda t: t.write_text("x")),
        "save_safetensors": lambda p: save_safetensors({"a": torch.zeros(2)}, p),
        "atomic_write_bytes": lambda p: atomic_write_bytes(p, b"x"),
    }


@pytest.mark.parametrize("name", ["save_html", "save_figure", "write_atomic",
                                  "write_atomically", "save_safetensors", "atomic_write_bytes"])
def test_atomic_writers_name_the_target_and_its_missing_folder(name, tmp_path) -> None:
    write = _writers(tmp_path)[name]
    suffix = {"save_figure": ".png", "save_safetensors": ".safetensors"}.get(name, ".html")
    target = tmp_path / "nonexistent" / "dir" / f"a{suffix}"
    with pytest.raises(FileNotFoundError) as info:
        write(target)
    message = str(info.value)
    assert message.startswith(f"cannot write {target}: its folder {target.parent} does not "
                               "exist")
    assert f"({tmp_path / 'nonexistent'} is missing)" in message
    assert ".tmp" not in message
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_the_user_call_save_html_nonexistent_dir() -> None:
    from handformer.viz import save_html

    with pytest.raises(FileNotFoundError, match=r"^cannot write /nonexistent/dir/a\.html: its "
                                                r"folder /nonexistent/dir does not exist"):
        save_html([torch.rand(1, 2, 3, 3)], ["a", "b", "c"], "/nonexistent/dir/a.html")


def test_model_save_pretrained_into_a_file_names_it(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    lm = hf.CausalLM(hf.CausalLMConfig(vocab_size=5, max_len=8, d_model=8, num_heads=2,
                                       num_layers=1, d_ff=8))
    from handformer.checks import mkstemp_beside

    with pytest.raises(NotADirectoryError, match=r"cannot write .*file/x: .*file is not a "
                                                 r"folder"):
        mkstemp_beside(tmp_path / "file" / "x")
    with pytest.raises(OSError, match="file"):
        lm.save_pretrained(tmp_path / "file")


def test_checkpoint_temporaries_keep_the_prefix_cleanup_looks_for(tmp_path) -> None:
    from handformer.checks import mkstemp_beside

    tmp = Path(mkstemp_beside(tmp_path / "step-00000007", folder=True))
    assert tmp.is_dir() and tmp.name.startswith(".tmp-step-00000007-")
    f = Path(mkstemp_beside(tmp_path / "a.json"))
    assert f.is_file() and f.name.startswith(".a.json.") and f.name.endswith(".tmp")


# ---- 6: device, path, metric ---------------------------------------------------------------


def test_load_bert_bad_device_names_argument_value_and_choices(bert_dir) -> None:
    with pytest.raises(ValueError, match=r"^device must be a torch device such as 'cpu', "
                                         r"'cuda' or 'cuda:0', got 'tpu'$"):
        load_bert(bert_dir, device="tpu")
    with pytest.raises(TypeError, match="^device must be a string .* got int 3"):
        load_bert(bert_dir, device=3)
    with pytest.raises(ValueError, match="^device='tpu' is not a torch device; use 'cpu'"):
        load_gpt2(bert_dir, device="tpu")  # load_lm's rule (load_gpt2 is its alias)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_load_bert_cuda_without_a_gpu_says_so(bert_dir) -> None:
    with pytest.raises(ValueError, match="^device 'cuda': no CUDA GPU is available"):
        load_bert(bert_dir, device="cuda")


def test_load_bert_non_path_names_the_argument() -> None:
    with pytest.raises(TypeError, match=r"^path must be a checkpoint folder or file \(a str "
                                        r"or os.PathLike\), got int 123$"):
        load_bert(123)
    with pytest.raises(TypeError, match="^source must be a folder, a .gguf file or a shipped "
                                        "model name, got list"):
        load_gpt2(["a"])  # load_lm's rule


def test_ablation_metric_returning_none_names_metric(bert_dir) -> None:
    from handformer.inspect import head_ablation_sweep

    model, tok = load_bert(bert_dir)
    with pytest.raises(TypeError, match=r"^metric must return one number \(a float or a "
                                        r"one-element tensor\), got NoneType None"):
        head_ablation_sweep(model, tok(["the cat"]), lambda o: None)
    with pytest.raises(TypeError, match="^metric must return one number .* got str 'x'"):
        head_ablation_sweep(model, tok(["the cat"]), lambda o: "x")
    with pytest.raises(TypeError, match="^metric must be a function"):
        head_ablation_sweep(model, tok(["the cat"]), 3)


# ---- 7: attention kinds by name --------------------------------------------------------------


def _pattern_kinds(model) -> list[object]:
    return [layer.attn.attention for layer in model.blocks]


@pytest.mark.parametrize("kwargs, kind, attrs", [
    ({"attention": "local"}, hf.LocalAttention, {"window_size": 5}),
    ({"attention": "local", "window_size": 7}, hf.LocalAttention, {"window_size": 7}),
    ({"attention": "strided"}, hf.StridedAttention, {"stride": 3, "global_tokens": 1}),
    ({"attention": "strided", "stride": 2, "global_tokens": 0}, hf.StridedAttention,
     {"stride": 2, "global_tokens": 0}),
    ({"attention": "linear"}, hf.LinearAttention, {}),
    ({"attention": "full"}, hf.FullAttention, {}),
])
def test_load_bert_takes_the_cli_names_with_options(bert_dir, kwargs, kind, attrs) -> None:
    model, tok = load_bert(bert_dir, **kwargs)
    kinds = _pattern_kinds(model)
    assert all(type(k) is kind for k in kinds)
    assert all(getattr(k, a) == v for k in kinds for a, v in attrs.items())
    assert len({id(k) for k in kinds}) == len(kinds)  # one module per layer
    # the same numbers as the instance the name stands for
    instance = {hf.LocalAttention: lambda: hf.LocalAttention(attrs.get("window_size", 5)),
                hf.StridedAttention: lambda: hf.StridedAttention(
                    attrs["stride"], global_tokens=attrs["global_tokens"]),
                hf.LinearAttention: hf.LinearAttention, hf.FullAttention: hf.FullAttention}
    ref, _ = load_bert(bert_dir, attention=instance[kind]())
    batch = tok(["the cat sat on the mat", "a dog"])
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).last_hidden_state,
                                   ref(**batch).last_hidden_state, rtol=0, atol=0)


def test_names_everywhere_a_kind_is_taken(bert_dir) -> None:
    from handformer.pretrained import BertModel

    model = BertModel.from_pretrained(bert_dir, attention="local", window_size=3)
    assert all(k.window_size == 3 for k in _pattern_kinds(model))
    config = model.config
    assert isinstance(_pattern_kinds(BertModel(config, attention="linear"))[0],
                      hf.LinearAttention)
    assert isinstance(hf.MultiHeadAttention(8, 2, attention="local").attention,
                      hf.LocalAttention)
    layer = hf.EncoderLayer(8, 2, 16, attention="strided")
    assert layer.attn.attention.stride == 3 and layer.attn.dropout == 0.0
    assert isinstance(hf.DecoderLayer(8, 2, 16, attention="linear", cross_attention=False)
                      .attn.attention, hf.LinearAttention)


@pytest.mark.parametrize("kwargs, exc, message", [
    ({"attention": "sparse"}, ValueError,
     r"^attention must be one of full, local, strided, linear, got 'sparse'$"),
    ({"window_size": 7}, ValueError,
     r"^window_size=7 applies to attention 'local', not 'full'; pass attention='local' or "
     r"leave window_size out$"),
    ({"attention": "local", "stride": 2}, ValueError,
     r"^stride=2 applies to attention 'strided', not 'local'"),
    ({"attention": "local", "window_size": 4}, ValueError, r"^window_size must be odd"),
    ({"attention": hf.LocalAttention(3), "window_size": 5}, ValueError,
     r"^window_size is for attention given by name"),
    ({"attention": lambda: hf.LocalAttention(3), "stride": 5}, ValueError,
     r"^stride is for attention given by name"),
    ({"attention": 5}, TypeError, r"^attention must be None, a name"),
])
def test_bad_kinds_and_options_are_refused_by_name(bert_dir, kwargs, exc, message) -> None:
    with pytest.raises(exc, match=message):
        load_bert(bert_dir, **kwargs)


def test_the_server_and_the_cli_build_kinds_with_the_same_helper(monkeypatch, bert_dir,
                                                                   tmp_path, capsys) -> None:
    """One helper: replace it and both the server's choices and `viz` see the change."""
    import handformer.attention.registry as registry
    from handformer.serve.state import AttentionChoice

    calls = []
    real = registry.attention_kind

    def spy(kind, **options):
        calls.append((kind, options))
        return real(kind, **options)

    monkeypatch.setattr(registry, "attention_kind", spy)
    import handformer.serve.state as state_module

    monkeypatch.setattr(state_module, "attention_kind", spy)
    AttentionChoice("strided", stride=2, global_tokens=0).make()
    code, _, err = cli(capsys, "viz", "the cat", "--model", bert_dir, "--attention", "local",
                       "--window-size", "3", "--out", tmp_path / "v")
    assert code == 0, err
    assert ("strided", {"stride": 2, "global_tokens": 0}) in calls
    assert ("local", {"window_size": 3}) in calls


# ---- 8: no hub -----------------------------------------------------------------------------


@pytest.mark.parametrize("call, name", [(load_gpt2, "gpt2"), (load_bert, "bert-base-uncased"),
                                         (load_bert, "sentence-transformers/all-MiniLM-L6-v2")])
def test_a_hub_name_says_local_only_and_shows_the_saving_line(call, name, tmp_path,
                                                              monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        call(name)
    message = str(info.value)
    if call is load_gpt2:  # causal LMs: load_lm's message (GGUF files and shipped names too)
        assert message.startswith(f"no checkpoint folder at {name}: handformer reads local "
                                  "folders (config.json + model.safetensors), .gguf files and "
                                  "shipped names")
        assert "never a model hub" in message
        assert "AutoModelForCausalLM.from_pretrained(NAME).save_pretrained(DIR)" in message
        return
    assert message.startswith(f"no checkpoint folder at {name}; handformer reads local "
                              "folders and files only (no model hub)")
    line = (f"AutoModel.from_pretrained('{name}').save_pretrained('{name}'); "
            f"AutoTokenizer.from_pretrained('{name}').save_pretrained('{name}')")
    assert line in message
    assert 'python -c "from transformers import AutoModel, AutoTokenizer; ' in message


def test_the_saving_line_makes_a_folder_handformer_loads(tmp_path, monkeypatch) -> None:
    """What the line does, with a local model standing in for the hub download."""
    import transformers

    monkeypatch.chdir(tmp_path)
    tiny_checkpoint(tmp_path / "src-bert", hidden_size=16, layers=1, heads=2, intermediate=16)
    with pytest.raises(FileNotFoundError) as info:
        load_bert("mybert")
    command = str(info.value).split('python -c "', 1)[1].rstrip('"')
    command = command.replace("from_pretrained('mybert')", "from_pretrained('src-bert')")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(command, {"transformers": transformers})  # noqa: S102 - our own message
    model, tok = load_bert("mybert")
    assert model.config.hidden_size == 16 and tok(["the cat"])["input_ids"].shape[0] == 1


def test_generate_with_a_hub_name_says_the_same(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, "generate", "--model", "gpt2", "--prompt", "Hello")
    assert code == 2
    assert "handformer reads local folders and files only (no model hub)" in err
    assert "AutoModel.from_pretrained('gpt2').save_pretrained('gpt2')" in err


def test_paths_that_are_no_hub_names_keep_the_short_message(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"^no checkpoint folder at /nonexistent/dir$"):
        load_bert("/nonexistent/dir")


# ---- 9: image format from the extension ----------------------------------------------------


MAGIC = {".png": b"\x89PNG\r\n\x1a\n", ".svg": b"<?xml", ".pdf": b"%PDF-", ".jpg": b"\xff\xd8\xff",
         ".jpeg": b"\xff\xd8\xff", ".JPG": b"\xff\xd8\xff"}


@pytest.mark.parametrize("suffix", list(MAGIC))
def test_save_figure_writes_the_format_of_the_extension(suffix, tmp_path) -> None:
    from handformer.viz import plot_attention, save_figure

    fig = plot_attention(torch.rand(3, 3), list("abc"))
    path = save_figure(fig, tmp_path / f"x{suffix}")
    assert path.read_bytes().startswith(MAGIC[suffix])


@pytest.mark.parametrize("name", ["x.gif", "x.bmp", "x", "x.html"])
def test_save_figure_refuses_other_extensions(name, tmp_path) -> None:
    from handformer.viz import plot_attention, save_figure

    fig = plot_attention(torch.rand(3, 3), list("abc"))
    with pytest.raises(ValueError, match=r"^cannot tell the image format of .* from its "
                                         r"extension .*: save_figure writes \.png, \.svg, "
                                         r"\.pdf, \.jpg, \.jpeg"):
        save_figure(fig, tmp_path / name)
    assert list(tmp_path.iterdir()) == []


def test_the_user_call_save_figure_jpg_is_jpeg(tmp_path, monkeypatch) -> None:
    from PIL import Image

    from handformer.viz import plot_attention, save_figure

    monkeypatch.chdir(tmp_path)
    save_figure(plot_attention(torch.rand(3, 3), list("abc")), "x.jpg")
    with Image.open(tmp_path / "x.jpg") as image:
        assert image.format == "JPEG"


def test_json_is_not_touched_by_options() -> None:
    """OptionError keeps the message every caller printed before (`name problem`)."""
    exc = OptionError("window_size", "must be a positive integer, got 0")
    assert str(exc) == "window_size must be a positive integer, got 0"
    assert isinstance(exc, ValueError)
    assert (exc.name, exc.problem) == ("window_size", "must be a positive integer, got 0")
    # The server's JSON error names the field and keeps the words (not the option's repr).
    from handformer.serve.validation import _field_error

    answer = _field_error(exc)
    assert json.loads(json.dumps({"error": str(answer), "field": answer.field})) == {
        "error": "window_size: must be a positive integer, got 0", "field": "window_size"}
