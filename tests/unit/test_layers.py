"""The package stacks one way (docs/design.md): each module imports only its own floor or lower ones, at the
top of the module, with no cycle, and no module holds more than one page of concepts."""

import ast
import graphlib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "kvpool"
# Lowest first. A module not named here by its own name is placed by its folder.
FLOORS = {
    "kvpool": 1, "kvpool.cells": 1, "kvpool.stats": 1, "kvpool.cpu_connector": 1, "kvpool.traces": 1,
    "kvpool.engine": 2,
    "kvpool.matrix": 3,
    "kvpool.settings": 3,
    "kvpool.measure": 4,
    "kvpool.studies": 5,
    "kvpool.report": 6,
    "kvpool.config": 7,
}
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor(module: str) -> int:
    placed = module
    while placed not in FLOORS:
        placed = placed.rpartition(".")[0]
        if not placed:
            raise KeyError(f"no floor for {module!r}: name it in FLOORS and docs/design.md")
    return FLOORS[placed]


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def kvpool_imports(tree: ast.Module, module: str) -> list[tuple[ast.stmt, str]]:
    """Every import of a kvpool module in ``tree``, with the module it names (``from kvpool.engine import mp``
    names kvpool.engine.mp where that is a module)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node, alias.name) for alias in node.names if alias.name.split(".")[0] == "kvpool"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvpool":
            found += [(node, f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES
                       else node.module) for alias in node.names]
    return found


def top_level(tree: ast.Module) -> set[int]:
    return {id(node) for node in tree.body}


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_every_module_has_a_floor():
    for module in MODULES:
        floor(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_kvpool_only_at_its_top_and_only_from_its_floor_or_below(module):
    tree = parsed(MODULES[module])
    at_top = top_level(tree)
    for node, target in kvpool_imports(tree, module):
        assert id(node) in at_top, (f"{module}:{node.lineno} imports {target} inside a function: move it to the "
                                    "top (a cycle it dodged is a cycle; move the shared piece down a floor)")
        assert floor(target) <= floor(module), (f"{module}:{node.lineno} (floor {floor(module)}) imports {target} "
                                                f"(floor {floor(target)}): a lower floor never imports a higher one")


def test_the_imports_between_modules_form_no_cycle():
    graph = {module: {target for _, target in kvpool_imports(parsed(path), module)
                      if target in MODULES and target != module and not MODULES[target].name == "__init__.py"}
             for module, path in MODULES.items()}
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the circle


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_over_a_page_of_concepts(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines (at most {MAX_LINES}): split it by concept"


def test_the_rules_catch_what_they_are_for():
    """The checks fail where they should: a function-local import, an upward import, a cycle."""
    tree = ast.parse("import os\n\ndef f():\n    from kvpool.report import page\n")
    (node, target), = kvpool_imports(tree, "kvpool.engine.plan")
    assert target == "kvpool.report.page" and id(node) not in top_level(tree)
    assert floor("kvpool.report.page") > floor("kvpool.engine.plan")
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter({"a": {"b"}, "b": {"a"}}).prepare()
