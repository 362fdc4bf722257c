"""The package's layering, read from every module's imports (ast): nothing imports upward, no
import cycles.

Every ``import`` and ``from ... import`` counts, wherever it sits (module level, inside a
function, under ``TYPE_CHECKING``), and so does a module imported by name
(``importlib.import_module("handformer.commands.viz")``, the CLI's list of sub-commands).
A module may import modules of its own layer or of a lower one; ``handformer.checks`` imports
nothing of handformer at all.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Bottom first. A layer is a tuple of units: a unit is a top-level module or subpackage of
# handformer ("handformer" itself is the package's __init__, the public API it re-exports).
LAYERS: list[tuple[str, ...]] = [
    ("checks", "hooks", "legacy_names"),  # shared argument checks, hook points, the module
    # names before "one name per part": import nothing of handformer
    ("masks", "weights", "norms", "packing"),  # the mask convention; safetensors reading;
    # LayerNorm, RMSNorm; projection weights stored back to back
    ("attention",),
    ("positional", "positional_rotary"),
    ("layers", "decoder_layer", "weight_views"),  # weight_views: TransformerLens' W_Q...
    ("models",),
    ("chat", "tokenizers"),  # chat templates and sessions; text <-> token ids (a tokenizer's
    # chat template renders through chat.template; a chat session stands on models' sampling)
    ("interop",),  # torch.nn <-> handformer modules
    ("distributed",),  # tensor parallel: shards a CausalLM over a DeviceMesh
    ("pretrained",),
    ("inspect",),  # hook points read, caches, ablations: stands on models and pretrained
    ("viz",),  # draws what inspect computes
    ("train",),  # its plots use viz
    ("features",),  # dictionaries, loaders, splicing: stands on inspect (and train's trainer)
    ("handformer",),  # the package __init__: re-exports what lies below
    ("serve",),  # stands on inspect and viz
    ("commands",),  # the only place that parses arguments
    ("cli", "__main__"),
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
LEAVES = {"handformer.checks"}  # import nothing of handformer at all
MODULE_NAME = re.compile(r"handformer(\.\w+)+")


def module_files(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the ``handformer`` package."""
    modules = {}
    for path in sorted((src / "handformer").rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def unit(module: str) -> str:
    """The layering unit of a module: ``handformer.attention.local`` -> ``attention``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The handformer modules ``module`` imports (resolved to the most specific module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def add(name: str) -> None:
        while name and name not in modules:  # a name inside a module -> the module
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "handformer":
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x, from ..y import z
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            if origin.split(".")[0] != "handformer":
                continue
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                add(sub if sub in modules else origin)
        else:
            for name in _dynamic_imports(node):
                if MODULE_NAME.fullmatch(name) and name in modules:
                    add(name)
    return found


def _dynamic_imports(node: ast.AST) -> list[str]:
    """Module names imported by name: ``import_module("...")`` and lists of module names
    (the CLI's sub-commands). Other strings (``resources.files("handformer.viz")``) are data."""
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return [node.args[0].value] if name == "import_module" else []
    if isinstance(node, (ast.List, ast.Tuple)):
        return [e.value for e in node.elts
                if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def import_graph(src: Path) -> dict[str, set[str]]:
    modules = module_files(src)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """One line per import that breaks the layering (or whose unit has no layer)."""
    problems = []
    for module, targets in sorted(graph.items()):
        if unit(module) not in RANK:
            problems.append(f"{module}: unit {unit(module)!r} has no layer; add it to LAYERS")
            continue
        for target in sorted(targets):
            if RANK.get(unit(target), len(LAYERS)) > RANK[unit(module)]:
                problems.append(f"{module} (layer {RANK[unit(module)]}) imports {target} "
                                f"(layer {RANK.get(unit(target))}): an upward import")
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles, one per strongly connected component of two or more modules (or a
    module importing itself), each as a path that closes on its first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                components.append(_path_through(sorted(component), graph))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _path_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A cycle inside ``component`` from its first module back to it (breadth first)."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                return paths[node] + [start]
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    return component


def test_every_import_goes_down_the_layers():
    problems = upward_imports(import_graph(SRC))
    assert not problems, "\n".join(problems)


def test_there_are_no_import_cycles():
    found = cycles(import_graph(SRC))
    assert not found, "\n".join(" -> ".join(c) for c in found)


def test_the_leaves_import_nothing_of_handformer():
    graph = import_graph(SRC)
    for leaf in sorted(LEAVES):
        assert not graph[leaf], f"{leaf} imports {sorted(graph[leaf])}"


def test_the_shared_checks_have_one_home():
    """``check_positive_int`` & co. are defined once, in handformer.checks, and imported
    from there (nothing reaches them through handformer.layers any more)."""
    modules = module_files(SRC)
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        if name != "handformer.checks":
            assert not defined & {"check_positive_int", "check_dropout"}, name
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "handformer.layers":
                names = {a.name for a in node.names}
                assert not names & {"check_positive_int", "check_dropout"}, name


def test_interop_imports_go_one_way():
    graph = import_graph(SRC)
    assert "handformer.interop.encoder" in graph["handformer.interop.decoder"]
    assert not {m for m in graph["handformer.interop.encoder"]
                if m.startswith("handformer.interop")}


# ---- the checker itself finds what it should ------------------------------------------------

def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "handformer" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize("files, expected", [
    ({"__init__.py": "", "checks.py": "from handformer.layers import x\n", "layers.py": ""},
     "an upward import"),
    ({"__init__.py": "", "layers.py": "", "attention/__init__.py": "",
      "attention/local.py": "def f():\n    from handformer.layers import check\n"},
     "an upward import"),
    ({"__init__.py": "", "layers.py": "from handformer import viz\n", "viz/__init__.py": ""},
     "an upward import"),
    ({"__init__.py": "", "newthing.py": ""}, "has no layer"),
])
def test_the_checker_reports_upward_imports(tmp_path, files, expected):
    problems = upward_imports(import_graph(_fake_package(tmp_path, files)))
    assert any(expected in p for p in problems), problems


def test_the_checker_reports_cycles(tmp_path):
    src = _fake_package(tmp_path, {
        "__init__.py": "",
        "interop/__init__.py": "from . import encoder\n",
        "interop/encoder.py": "from handformer.interop import decoder\n",
        "interop/decoder.py": "from handformer.interop.encoder import FROM_TORCH\n",
        "cli.py": 'COMMANDS = ["handformer.commands.viz"]\n',
        "commands/__init__.py": "",
        "commands/viz.py": "from handformer.cli import UsageError\n",
    })
    found = {tuple(c) for c in cycles(import_graph(src))}
    assert ("handformer.interop.decoder", "handformer.interop.encoder",
            "handformer.interop.decoder") in found
    assert ("handformer.cli", "handformer.commands.viz", "handformer.cli") in found


def floors(graph: dict[str, set[str]], src: Path = SRC) -> list[str]:
    """The house floor by floor, bottom first: each layer's units with their modules, lines
    and the imports that leave the unit (``python tests/test_layering.py`` prints it)."""
    files = module_files(src)
    out = []
    for i, layer in enumerate(LAYERS):
        parts = []
        for name in layer:
            members = [m for m in graph if unit(m) == name]
            size = sum(len(files[m].read_text(encoding="utf-8").splitlines()) for m in members)
            below = sorted({unit(t) for m in members for t in graph[m]} - {name})
            parts.append(f"{name} ({len(members)} modules, {size:,} lines"
                         + (f"; imports {', '.join(below)})" if below else ")"))
        out.append(f"{i:2d}  " + "; ".join(parts))
    return out


def test_floors_lists_every_unit_once() -> None:
    lines = floors(import_graph(SRC))
    assert len(lines) == len(LAYERS)
    assert "tokenizers (" in lines[RANK["tokenizers"]] and "chat (" in lines[RANK["chat"]]


if __name__ == "__main__":
    graph = import_graph(SRC)
    print("\n".join(floors(graph)))
    print(f"upward imports: {len(upward_imports(graph))}, cycles: {len(cycles(graph))}")
