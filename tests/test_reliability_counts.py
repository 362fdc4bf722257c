"""The counts in the "Reliability" table (docs/guide/reliability.md, moved there from the
README) are the counts the tests really run."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import save

import test_cli_fuzz as cli_fuzz
import test_compile as compile_tests
import test_determinism as determinism
import test_error_catalogue as catalogue
import test_loader_fuzz as loader_fuzz
import test_low_precision as low_precision
import test_properties as properties

PAGE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "reliability.md"


def page_counts() -> list[int]:
    """The Count column of the Reliability table (the last number of each cell, or a sum)."""
    section = PAGE.read_text(encoding="utf-8").split("# Reliability", 1)[1]
    counts = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.search(r"\d", cells[1]) and "---" not in cells[1]:
            numbers = [int(n) for n in re.findall(r"\d+", cells[1])]
            counts.append(numbers[-1] if "=" in cells[1] else sum(numbers))
    return counts


def params(test, index: int = 0) -> list:
    """The values of a test's ``index``-th ``pytest.mark.parametrize``."""
    marks = [m for m in test.pytestmark if m.name == "parametrize"]
    return list(marks[index].args[1])


def loader_cases() -> int:
    state = {"w": torch.zeros(3, 2), "b": torch.zeros(4)}
    data = save(state)
    byte_damage = len(loader_fuzz.all_byte_damage(data))
    truncations = len(loader_fuzz.truncations(data))
    edits = len(loader_fuzz.state_edits(state))
    gpt2 = truncations + len(loader_fuzz.length_field(data)) + \
        len(loader_fuzz.rewritten_headers(data)) + edits
    bert = byte_damage + truncations + edits
    causal_lm = byte_damage + 2  # + bad config.json, missing config.json
    training = 5 * 3  # five checkpoint files x (truncated, empty, data bit flip)
    return bert + gpt2 + causal_lm + training


def test_reliability_counts_match_the_tests() -> None:
    given = [name for name in dir(properties) if name.startswith("test_")
             and hasattr(getattr(properties, name), "hypothesis")]
    text_runs = (2 * len(cli_fuzz.TEXTS) + len(params(cli_fuzz.test_viz_texts))
                 + len(params(cli_fuzz.test_train_text_files)) + 3 + 3)
    kinds, dtypes = low_precision.KINDS, low_precision.DTYPES
    modules = len(list(low_precision.module_cases("full"))) + 1  # + CausalLM
    expected = [
        len(catalogue.ROWS),
        len(cli_fuzz.BAD_ARGS),
        text_runs,
        loader_cases(),
        len(given) * properties.EXAMPLES.max_examples,
        len(kinds) * len(dtypes) * len(low_precision.SCALES) * 4,  # x causal x weights
        modules * len(kinds) * len(dtypes),
        len(compile_tests.KINDS) * 4,  # MHA, EncoderLayer, DecoderLayer, CausalLM
        len(determinism.KINDS) * 4 + 2,  # + sampling + training
    ]
    assert page_counts() == expected
