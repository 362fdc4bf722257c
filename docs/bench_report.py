"""Helpers of docs/make_benchmarks.py: reading the recorded results and the reports of the
benchmarks that have no section of their own there (each benchmark's ``results/<name>.md``)."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.ticker import FuncFormatter, NullFormatter, NullLocator

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def load(name: str, results: Path = RESULTS) -> dict | None:
    path = results / f"{name}.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def machine_line(data: dict) -> str:
    m = data.get("machine", {})
    line = (f"Measured {m.get('date', '(date not recorded)')} on {m.get('platform', '?')}, "
            f"{m.get('cpu_count', '?')} CPUs ({m.get('torch_threads', '?')} torch threads), "
            f"torch {m.get('torch', '?')}, Python {m.get('python', '?')}.")
    load = data.get("load_average_start_end")
    if load:
        line += f" 1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end"
        busy = isinstance(m.get("cpu_count"), int) and max(load) > m["cpu_count"]
        line += " (more than the CPUs: other jobs were competing for them)." if busy else "."
    return line


def log_axes(ax, xs: list[int]) -> None:  # noqa: ANN001 - matplotlib Axes
    """Log x axis with the measured lengths as plain tick labels; log y axis when the values
    span more than a factor of 20 (linear from 0 otherwise, where a log axis has no labels)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.xaxis.set_minor_locator(NullLocator())
    ys = [y for line in ax.get_lines() for y in line.get_ydata() if y > 0]
    if ys and max(ys) / min(ys) > 20:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3, which="both")


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def reproduce(script: str) -> str:
    return (f"Regenerate: `make bench` (all benchmarks) or `.venv/bin/python benchmarks/{script}`, "
            "then `make docs`.")


def own_reports(results: Path, done: set[str]) -> list[str]:
    """The reports of benchmarks with no section here (features, graphs, hooks, ...): each
    benchmark's own ``results/<name>.md``, its headings one level down, as it wrote them."""
    lines = []
    for path in sorted(results.glob("*.md")):
        if path.stem in done or not (results / f"{path.stem}.json").is_file():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            lines.append("#" + line if line.startswith("#") else line)
        script = ROOT / "benchmarks" / f"bench_{path.stem}.py"
        lines += ["", reproduce(script.name) if script.is_file() else "", ""]
    return lines
