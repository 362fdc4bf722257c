"""The error catalogue (docs/errors.md) is executable: every row is run and checked.

Each table row of docs/errors.md holds a snippet (one Python expression or statement, in
backticks), the exception it raises and an excerpt of the message. This test parses the
table, runs every snippet in a small namespace (tiny models and damaged files built here, see
:func:`namespace`) and asserts that the documented exception is raised and the documented
excerpt appears in its message. The catalogue therefore cannot drift from the code.

``python tests/test_error_catalogue.py`` prints each row's actual message (to write new rows).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

import handformer as hf
from handformer import features, inspect, masks
from handformer.chat.template import render_chat_template
from handformer.cli import main
from handformer.distributed import parallelize
from handformer.pretrained import CheckpointError, load_bert, load_lm
from handformer.pretrained.gguf import gguf_to_hf, read_gguf, shipped_path
from handformer.pretrained.gpt2 import load_gpt2
from handformer.tokenizers.lm import LMTokenizer
from handformer.train import CharVocab, TrainConfig, train
from handformer.train.checkpoint import load_checkpoint, save_checkpoint

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
ROW = re.compile(r"^\|\s*(\d+)\s*\|(.*)\|\s*$")
AREAS = {"attention", "masks", "modules", "positional", "loaders", "tokenizer", "generation",
         "training", "cli", "inspect", "serve", "features"}


class CLIExit(Exception):  # noqa: N818 - stands for "exit 2 with this stderr line"
    """Raised by ``cli(...)`` in snippets when the command exits non-zero."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse_catalogue(text: str) -> list[dict[str, str]]:
    """Rows ``| n | area | `snippet` | exception | `message` | what to do |``."""
    rows = []
    for line in text.splitlines():
        m = ROW.match(line.strip())
        if not m:
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", m.group(2))]
        assert len(cells) == 5, f"row {m.group(1)} has {len(cells)} cells: {line}"
        area, snippet, exc, message, fix = cells
        for name, cell in (("snippet", snippet), ("message", message)):
            assert cell.startswith("`") and cell.endswith("`"), f"row {m.group(1)}: {name}"
        rows.append({"n": m.group(1), "area": area.lower(), "fix": fix,
                     "snippet": snippet[1:-1].replace("\\|", "|"),
                     "exception": exc.split()[0].strip("`"),
                     "message": message[1:-1].replace("\\|", "|")})
    return rows


ROWS = parse_catalogue(DOC.read_text(encoding="utf-8"))


# ---- the namespace the snippets run in ------------------------------------------------------


def _tiny_bert(folder: Path) -> Path:
    from pretrained_util import tiny_checkpoint

    tiny_checkpoint(folder, hidden_size=16, layers=1, heads=2, intermediate=24)
    return folder


def _tiny_gpt2(folder: Path) -> Path:
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1,
                                         n_head=2)
        transformers.GPT2LMHeadModel(config).save_pretrained(folder, safe_serialization=True)
    return folder


def namespace(tmp: Path) -> dict[str, object]:
    """Names available to the snippets."""
    from safetensors.torch import load_file, save_file

    bert_dir = _tiny_bert(tmp / "bert")
    gpt2_dir = _tiny_gpt2(tmp / "gpt2")

    def t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape).to(dtype)

    def ids(*shape: int, high: int = 23) -> torch.Tensor:
        return torch.randint(0, high, shape)

    def lm(**options: object) -> hf.CausalLM:
        base = dict(vocab_size=23, max_len=16, d_model=8, num_heads=2, num_layers=1, d_ff=16)
        return hf.CausalLM(hf.CausalLMConfig(**{**base, **options})).eval()

    def damaged(kind: str) -> Path:
        """A copy of the tiny BERT folder with one kind of damage."""
        folder = tmp / f"damaged-{kind}"
        if not folder.exists():
            folder.mkdir()
            for f in bert_dir.iterdir():
                (folder / f.name).write_bytes(f.read_bytes())
            weights = folder / "model.safetensors"
            if kind == "truncated":
                weights.write_bytes(weights.read_bytes()[:-100])
            elif kind == "missing-key":
                state = load_file(weights)
                del state["pooler.dense.bias"]
                save_file(state, weights)
            elif kind == "pickle":
                weights.rename(folder / "pytorch_model.bin")
            else:
                raise ValueError(kind)
        return folder

    def bert() -> tuple[object, object]:
        return load_bert(bert_dir)

    def checkpoint(damage: str) -> Path:
        """A training checkpoint whose model.safetensors has one byte changed."""
        model = lm()
        opt = torch.optim.AdamW(model.parameters())
        path = save_checkpoint(tmp / f"run-{damage}", 1, model, opt, {}, {})
        weights = path / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
        return path

    def cli(*argv: object) -> int:
        """Run ``handformer ARGV`` in-process; raise CLIExit with the stderr line if not 0."""
        import contextlib
        import io

        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main([str(a) for a in argv])
            except SystemExit as exc:
                code = exc.code
        if code:
            raise CLIExit(code, err.getvalue().strip())
        return 0

    def gpt2_default_ids() -> Path:
        """A GPT-2 folder with a 300-token vocabulary under GPT2Config's default special ids
        (bos = eos = 50256, in config.json and generation_config.json)."""
        from pretrained_util import tiny_gpt2_folder

        folder = tmp / "gpt2-default-ids"
        if not folder.exists():
            tiny_gpt2_folder(folder, vocab_size=300)
            for name in ("config.json", "generation_config.json"):
                data = json.loads((folder / name).read_text())
                data.update(bos_token_id=50256, eos_token_id=50256)
                (folder / name).write_text(json.dumps(data))
        return folder

    def not_installed(*modules: str) -> object:
        """A context in which ``modules`` are not installed (import and find_spec fail)."""
        from unittest import mock

        return mock.patch.dict(sys.modules, dict.fromkeys(modules))

    def enc() -> hf.Encoder:
        """A tiny two-layer encoder (E=8, 2 heads)."""
        return hf.Encoder(hf.EncoderLayer(8, 2, 16, dropout=0.0), 2).eval()

    def spm_meta(**changes: object) -> dict[str, object]:
        """Metadata of a tiny SentencePiece GGUF tokenizer (297 tokens, tests/tokenizer_util);
        ``name=value`` sets ``tokenizer.ggml.name`` (None removes it)."""
        from tokenizer_util import as_metadata, spm_fields

        meta = as_metadata("llama", "llama", spm_fields())
        for name, value in changes.items():
            meta.pop(f"tokenizer.ggml.{name}", None)
            if value is not None:
                meta[f"tokenizer.ggml.{name}"] = value
        return meta

    def fam(model_type: str, **fields: object) -> object:
        """A causal LM family's config from a small config.json dict with ``fields``."""
        from handformer.pretrained.families import family_for

        base = dict(model_type=model_type, vocab_size=23, hidden_size=16, intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=16)
        return family_for(model_type).config_from_hf({**base, **fields})

    def folder_of(model_type: str) -> Path:
        """A folder whose config.json has only ``model_type``."""
        folder = tmp / f"type-{model_type}"
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
        return folder

    def bad_gguf(kind: str) -> Path:
        """A tiny llama GGUF file with one kind of damage (tests/gguf_util.py)."""
        from gguf_util import damaged_gguf

        return damaged_gguf(tmp / "gguf", kind)

    def registry() -> object:
        """A serve ModelRegistry of three models: "tiny" (loaded), "other", "broken"."""
        from types import SimpleNamespace

        from handformer.serve.registry import ModelRegistry

        def loader(source: object, *, device: str) -> object:
            if source == "broken":
                raise FileNotFoundError("broken: no config.json")
            return SimpleNamespace(name=source)

        return ModelRegistry(["tiny", "other", "broken"], loader=loader)

    def chat_state(template: bool = True) -> object:
        """A stand-in for a served causal LM whose tokenizer has a chat template (or not)."""
        from types import SimpleNamespace

        tok = SimpleNamespace(chat_template="{{ messages }}" if template else None,
                              apply_chat_template=lambda m, **_: str(m),
                              decode=lambda ids: " ".join(map(str, ids)))
        model = SimpleNamespace(config=SimpleNamespace(vocab_size=23))
        return SimpleNamespace(causal=True, name="tiny-chat", tokenizer=tok, model=model)

    states: dict[str, object] = {}

    def serve_state(kind: str = "encoder") -> object:
        """The server's ModelState on the tiny BERT ("encoder") or a tiny causal LM with a
        character vocabulary ("causal"), built once."""
        from handformer.serve.state import ModelState
        from handformer.train.data import CharVocab

        if kind not in states:
            folder = bert_dir
            if kind == "causal":
                folder = tmp / "causal-lm"
                lm(vocab_size=5).save_pretrained(folder)
                CharVocab(list("abcd ")).save(folder / "vocab.json")
            states[kind] = ModelState(folder)
        return states[kind]

    def sae_dir(damage: str = "") -> Path:
        """A tiny SAELens folder (d_in 8, d_sae 16) with one kind of damage: "nan" (b_enc[3]),
        "shape" (W_dec one row short), "normalize" (expected_average_only_in), "truncated"."""
        folder = tmp / f"sae-{damage or 'ok'}"
        if not folder.exists():
            folder.mkdir()
            tensors = {"W_enc": t(8, 16), "b_enc": t(16), "W_dec": t(16 - (damage == "shape"), 8),
                       "b_dec": t(8)}
            if damage == "nan":
                tensors["b_enc"][3] = float("nan")
            norm = "expected_average_only_in" if damage == "normalize" else "none"
            (folder / "cfg.json").write_text(json.dumps({
                "d_in": 8, "d_sae": 16, "hook_name": "blocks.0.hook_resid_post",
                "normalize_activations": norm}))
            save_file(tensors, str(folder / "sae_weights.safetensors"))
            if damage == "truncated":
                weights = folder / "sae_weights.safetensors"
                weights.write_bytes(weights.read_bytes()[:-40])
        return folder

    existing_run = tmp / "existing-run"
    existing_run.mkdir()
    (existing_run / "train.json").write_text("{}")
    def mesh(n: int) -> DeviceMesh:  # a mesh of n ranks seen from rank 0, no process group
        return DeviceMesh("cpu", list(range(n)), _init_backend=False, _rank=0)

    return {"torch": torch, "hf": hf, "masks": masks, "t": t, "ids": ids, "lm": lm,
            "parallelize": parallelize, "mesh": mesh, "load_lm": load_lm,
            "bert": bert, "bert_dir": bert_dir, "gpt2_dir": gpt2_dir, "damaged": damaged,
            "load_bert": load_bert, "load_gpt2": load_gpt2, "TrainConfig": TrainConfig,
            "train": train, "load_checkpoint": load_checkpoint, "checkpoint": checkpoint,
            "cli": cli, "tmp": tmp, "existing_run": existing_run, "json": json,
            "inspect": inspect, "enc": enc, "spm_meta": spm_meta, "LMTokenizer": LMTokenizer,
            "render_chat_template": render_chat_template, "CharVocab": CharVocab,
            "fam": fam, "folder_of": folder_of,
            "bad_gguf": bad_gguf, "read_gguf": read_gguf,
            "gguf_to_hf": gguf_to_hf, "shipped_path": shipped_path,
            "registry": registry, "chat_state": chat_state, "serve_state": serve_state,
            "features": features, "sae_dir": sae_dir,
            "not_installed": not_installed, "gpt2_default_ids": gpt2_default_ids}


EXCEPTIONS = {"ValueError": ValueError, "TypeError": TypeError, "OSError": OSError,
              "CheckpointError": CheckpointError, "FileNotFoundError": FileNotFoundError,
              "UserWarning": UserWarning, "exit": CLIExit, "KeyError": KeyError,
              "HookError": inspect.HookError, "RuntimeError": RuntimeError,
              "AttributeError": AttributeError, "IndexError": IndexError}


def run_row(row: dict[str, str], ns: dict[str, object]) -> BaseException | Warning:
    """Run a row's snippet; return the exception (or warning) it produced."""
    expected = EXCEPTIONS[row["exception"]]
    if expected is UserWarning:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec(row["snippet"], dict(ns))  # noqa: S102 - the snippets are ours, in the docs
        found = [w.message for w in caught if isinstance(w.message, UserWarning)]
        assert found, f"row {row['n']}: no UserWarning"
        return found[-1]
    try:
        exec(row["snippet"], dict(ns))  # noqa: S102
    except expected as exc:
        return exc
    raise AssertionError(f"row {row['n']}: `{row['snippet']}` raised nothing")


@pytest.fixture(scope="module")
def ns(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    return namespace(tmp_path_factory.mktemp("catalogue"))


def test_catalogue_size_and_coverage() -> None:
    assert len(ROWS) >= 30
    numbers = [int(r["n"]) for r in ROWS]
    assert numbers[:111] == list(range(1, 112)), "rows 1-111 keep their numbers"
    assert numbers == sorted(set(numbers)), "row numbers are unique and increasing"
    assert {r["area"] for r in ROWS} == AREAS
    assert all(r["fix"] for r in ROWS), "every row says what to do instead"
    assert all(r["exception"] in EXCEPTIONS for r in ROWS)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['n']}-{r['area']}")
def test_catalogue_row(row: dict[str, str], ns: dict[str, object]) -> None:
    exc = run_row(row, ns)
    message = str(exc)
    assert row["message"] in message, f"row {row['n']}: documented `{row['message']}`, " \
                                      f"actual: {message}"
    if row["exception"] == "exit":
        assert exc.code == 2 and "\n" not in message and message.startswith("handformer")


def test_converter_hints_in_foreign_mask_messages() -> None:
    """Masks in another library's convention name the converter in handformer.masks."""
    hinted = [r for r in ROWS if r["area"] == "masks" and "from_" in r["message"]]
    assert len(hinted) >= 3


if __name__ == "__main__":  # print every row's actual message
    sys.path.insert(0, str(Path(__file__).parent))
    with tempfile.TemporaryDirectory() as d:
        space = namespace(Path(d))
        for r in ROWS:
            try:
                got = str(run_row(r, space))
            except BaseException as e:  # noqa: BLE001 - a report, not a test
                got = f"!! {type(e).__name__}: {e}"
            print(f"{r['n']:>3} {r['exception']:<16} {got}")
