"""The package boundary: the planning folder loads no torch, no module imports another in a cycle, and the
top-level names resolve lazily."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import networkx as nx

# The moirai that is imported (a checkout, or an installed wheel when .ci/wheel runs this file on its own).
PACKAGE_DIR = Path(importlib.util.find_spec("moirai").origin).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules_under(folder: Path) -> list[str]:
    return sorted(_module_name(path) for path in folder.rglob("*.py"))


def test_every_planning_module_leaves_torch_unimported():
    modules = _modules_under(PACKAGE_DIR / "planning")
    assert "moirai.planning.placers.milp" in modules and "moirai.planning.simulate" in modules
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    assert 'torch' not in sys.modules, (name, sorted(m for m in sys.modules if m.startswith('torch'))[:5])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_rank_imports_neither_sympy_nor_networkx():
    """They took 1.1 s of every rank's start ([Note: what a rank imports] in docs/design.md)."""
    code = (
        "import sys\n"
        "import moirai.runtime.runner\n"
        "assert not {'sympy', 'networkx'} & set(sys.modules), sorted({'sympy', 'networkx'} & set(sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _imported_modules(path: Path, known: set[str]) -> set[str]:
    """The moirai modules ``path`` imports, at its top level or inside functions (lazy imports count too;
    imports for type checkers only do not)."""
    tree = ast.parse(path.read_text())
    type_checking_only = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for statement in node.body
        for child in ast.walk(statement)
    }
    imported = set()
    for node in ast.walk(tree):
        if id(node) in type_checking_only:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        imported.update(name for name in names if name in known)
    return imported


def test_no_import_cycle_between_modules():
    paths = {_module_name(path): path for path in PACKAGE_DIR.rglob("*.py")}
    known = set(paths)
    graph = nx.DiGraph()
    for name, path in paths.items():
        graph.add_node(name)
        # A package's __init__ is where its own modules are collected; an edge from a module to its package is
        # an import of that collection, not a cycle of concerns.
        graph.add_edges_from(
            (name, target)
            for target in _imported_modules(path, known)
            if target != name and not name.startswith(target + ".")
        )
    cycles = list(nx.simple_cycles(graph))
    assert cycles == [], f"import cycles: {cycles[:5]}"


def test_top_level_names_stay_functions_after_their_modules_are_imported():
    code = (
        "import moirai.compile, moirai.planning.simulate, moirai.frontend.trace, moirai.frontend.coarsen\n"
        "import moirai\n"
        "for name in ('compile', 'simulate', 'trace', 'coarsen'):\n"
        "    assert callable(getattr(moirai, name)) and not isinstance(getattr(moirai, name), type(moirai)), name\n"
        "from moirai.planning.placers import place\n"
        "assert moirai.place is place and 'heft' in moirai.list_placers()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_an_unknown_top_level_name_is_an_attribute_error():
    import moirai

    try:
        moirai.no_such_name  # noqa: B018
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:
        raise AssertionError("moirai.no_such_name resolved")
