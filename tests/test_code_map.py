"""docs/code-map.md lists every file of src/handformer with its size, so it cannot drift.

The page's tables name each file (``| `attention/functional.py` | 350 | ... |``) under a
heading per room that gives the room's total (``### `attention/` (2,884 lines)``); its
first paragraph gives the number of files and of lines. Every file must be listed once, no
listed file may be gone, and every count must be within 15 % (or 10 lines, for small files)
of the real one: add a row when you add a file, and update the counts when a file grows.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "handformer"
PAGE = ROOT / "docs" / "code-map.md"
ROW = re.compile(r"^\| `([\w/]+\.py)` \| ([\d,]+) \|", re.M)
ROOM = re.compile(r"^### `([\w/]+)/`[^(\n]*\(([\d,]+) lines\)", re.M)


def lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def real_files() -> dict[str, int]:
    return {p.relative_to(SRC).as_posix(): lines(p) for p in sorted(SRC.rglob("*.py"))}


def close(quoted: int, real: int) -> bool:
    return abs(quoted - real) <= max(0.15 * real, 10)


def number(text: str) -> int:
    return int(text.replace(",", ""))


def test_every_file_is_listed_once() -> None:
    listed = [name for name, _ in ROW.findall(PAGE.read_text(encoding="utf-8"))]
    real = real_files()
    missing = [f"| `{name}` | {real[name]} | ... |" for name in real if name not in listed]
    assert not missing, "docs/code-map.md lacks rows for:\n" + "\n".join(missing)
    gone = [name for name in listed if name not in real]
    assert not gone, f"docs/code-map.md lists files that do not exist: {gone}"
    twice = sorted({name for name in listed if listed.count(name) > 1})
    assert not twice, f"docs/code-map.md lists these more than once: {twice}"


def test_the_line_counts_are_right() -> None:
    real = real_files()
    wrong = [f"{name}: page says {quoted}, the file has {real[name]}"
             for name, quoted in ROW.findall(PAGE.read_text(encoding="utf-8"))
             if name in real and not close(number(quoted), real[name])]
    assert not wrong, "update docs/code-map.md:\n" + "\n".join(wrong)


def test_every_room_and_its_total() -> None:
    text = PAGE.read_text(encoding="utf-8")
    rooms = {room: number(total) for room, total in ROOM.findall(text)}
    real = real_files()
    folders = {name.rpartition("/")[0] for name in real if "/" in name}
    assert set(rooms) == folders | {"handformer"}, (sorted(rooms), sorted(folders))
    for room, quoted in rooms.items():
        if room == "handformer":
            total = sum(n for name, n in real.items() if "/" not in name)
        else:
            total = sum(n for name, n in real.items() if name.rpartition("/")[0] == room)
        assert close(quoted, total), f"room {room}/: page says {quoted} lines, it has {total}"


def test_the_first_paragraph_counts() -> None:
    intro = PAGE.read_text(encoding="utf-8").split("\n\n")[1]
    files, total = re.search(r"(\d+) Python files, about ([\d,]+) lines", intro).groups()
    real = real_files()
    assert number(files) == len(real), f"{files} files on the page, {len(real)} in src"
    assert close(number(total), sum(real.values())), (total, sum(real.values()))


def test_the_reading_order_names_real_code() -> None:
    """The five stops exist where the page says."""
    text = PAGE.read_text(encoding="utf-8")
    order = text.split("## Read in this order")[1].split("## ")[0]
    for name, where in (("attention_reference", "attention/functional.py"),
                        ("class MultiHeadAttention", "layers.py"),
                        ("class DecoderLayer", "decoder_layer.py"),
                        ("def run(", "models/causal_lm.py"),
                        ("def config_from_hf", "pretrained/families/llama.py")):
        assert where in order and name in (SRC / where).read_text(encoding="utf-8"), name
