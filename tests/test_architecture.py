"""The layers of the package, read from the source (docs/architecture.md).

Each module's imports (module level and inside functions; not those under ``TYPE_CHECKING``)
are parsed with :mod:`ast` and checked against the layer rules: a lower layer never imports a
higher one, a recipe imports no other recipe and defines no ``nn.Module``, an underscore module
is private to its package, no import cycle. A new top-level module or package must be given a
layer in :data:`LAYERS` (and in docs/architecture.md) before the suite passes.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
import torch

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "structattn"

#: the layer of every top-level module and subpackage of structattn (higher imports lower)
LAYERS: dict[str, int] = {
    # 0: the ground floor, torch / numpy / stdlib only
    "_precision": 0,
    "_validation": 0,
    "io": 0,
    "metrics": 0,
    "names": 0,
    "semirings": 0,
    "trees": 0,
    # 1-2: the inference core
    "structs": 1,
    "distributions": 2,
    # 3: nn.Modules built on the core
    "attention": 3,
    "nn": 3,
    # 4: data and figures
    "data": 4,
    "viz": 4,
    # 5: models and the training loop (neither imports the other)
    "models": 5,
    "training": 5,
    # 6: paper experiments, composing everything below
    "recipes": 6,
    # 7: the command line and the package's public face
    "cli": 7,
    "demo": 7,
    "integrations": 7,
    "": 7,  # structattn/__init__.py
}

#: modules of recipes/ that are shared infrastructure, not experiments
RECIPE_INFRASTRUCTURE = {"base", "config", "runs", "tables"}  # and underscore family helpers

#: the most lines a recipe module may have (issue 36: "under about 600 lines each")
RECIPE_MAX_LINES = 600


@cache
def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's ``__init__``) for every module of the package."""
    found: dict[str, tuple[Path, bool]] = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The structattn modules (or names in them, as ``module.name``) one import statement names."""
    known = modules()
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
        return
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source.split(".")[0] != PACKAGE:
        return
    for alias in node.names:
        candidate = f"{source}.{alias.name}"
        yield candidate if candidate in known else f"{source}:{alias.name}"


def _owner(target: str) -> str:
    """The module a target lives in: the longest known module prefix."""
    name = target.split(":")[0]
    known = modules()
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


@cache
def imports() -> dict[str, set[str]]:
    """Dotted module -> the targets (modules, or ``module:name``) its imports name."""
    found: dict[str, set[str]] = {}
    for module, (path, is_package) in modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        skipped = _type_checking_nodes(tree)
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in skipped:
                targets.update(_targets(module, is_package, node))
        found[module] = targets
    return found


def edges() -> dict[str, set[str]]:
    """Dotted module -> the modules it imports (itself excluded)."""
    return {m: {_owner(t) for t in ts} - {m} for m, ts in imports().items()}


def area(module: str) -> str:
    """``structattn.data.babi`` -> ``data``; ``structattn`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def recipe_modules() -> list[str]:
    """The experiment modules of recipes/ (not the shared infrastructure, not family helpers)."""
    return [
        m
        for m in modules()
        if m.startswith(f"{PACKAGE}.recipes.")
        and m.count(".") == 2
        and not m.rsplit(".", 1)[1].startswith("_")
        and m.rsplit(".", 1)[1] not in RECIPE_INFRASTRUCTURE
    ]


def test_every_module_has_a_layer() -> None:
    unknown = sorted({area(m) for m in modules()} - set(LAYERS))
    assert not unknown, f"give these a layer in LAYERS and docs/architecture.md: {unknown}"


def test_lower_layers_never_import_higher_ones() -> None:
    wrong = [
        f"{m} (layer {LAYERS[area(m)]}) imports {d} (layer {LAYERS[area(d)]})"
        for m, ds in sorted(edges().items())
        for d in sorted(ds)
        if LAYERS.get(area(d), 99) > LAYERS.get(area(m), -1)
    ]
    assert not wrong, "\n".join(wrong)


def test_models_and_training_are_independent() -> None:
    wrong = [
        f"{m} imports {d}"
        for m, ds in edges().items()
        for d in ds
        if {area(m), area(d)} == {"models", "training"}
    ]
    assert not wrong, "\n".join(wrong)


def test_no_recipe_imports_another_recipe() -> None:
    recipes = set(recipe_modules())
    wrong = [f"{m} imports {d}" for m in sorted(recipes) for d in sorted(edges()[m] & recipes)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("module", recipe_modules())
def test_recipes_define_no_module(module: str) -> None:
    loaded = importlib.import_module(module)
    defined = [
        name
        for name, obj in vars(loaded).items()
        if inspect.isclass(obj) and obj.__module__ == module and issubclass(obj, torch.nn.Module)
    ]
    assert not defined, f"{module} defines nn.Modules {defined}: they belong in models/"


@pytest.mark.parametrize("module", recipe_modules())
def test_recipe_modules_are_short(module: str) -> None:
    path, _ = modules()[module]
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= RECIPE_MAX_LINES, f"{path.name}: {lines} lines (at most {RECIPE_MAX_LINES})"


def _private_package(module: str) -> str | None:
    """The package that owns a private module (``a.b._c.d`` -> ``a.b``), None if public."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def test_private_modules_and_names_stay_in_their_package() -> None:
    wrong = []
    for m, targets in sorted(imports().items()):
        for target in sorted(targets):
            owner = _owner(target)
            package = _private_package(owner)
            if package is not None and not (m == package or m.startswith(package + ".")):
                wrong.append(f"{m} imports the private module {owner}")
            name = target.split(":")[1] if ":" in target else ""
            if name.startswith("_") and not name.startswith("__"):
                home = owner if modules()[owner][1] else owner.rsplit(".", 1)[0]
                if not (m == home or m.startswith(home + ".")):
                    wrong.append(f"{m} imports the private name {name} of {owner}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles() -> None:
    graph = edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
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
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    # a package's __init__ re-exporting its submodules is not a cycle of the design: drop the
    # edges from a package to its own submodules and look again
    real = []
    for component in cycles:
        inner = {
            m: {d for d in graph[m] & set(component) if not d.startswith(m + ".")}
            for m in component
        }
        if _has_cycle(inner):
            real.append(component)
    assert not real, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in real)


def _has_cycle(graph: dict[str, set[str]]) -> bool:
    """Whether a small directed graph has a cycle (depth-first search)."""
    state: dict[str, int] = {}

    def visit(node: str) -> bool:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1 or (nxt not in state and visit(nxt)):
                return True
        state[node] = 2
        return False

    return any(node not in state and visit(node) for node in graph)
