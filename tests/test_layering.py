"""The layering rules of ARCHITECTURE.md, held over every module of the installed package:
each module imports only the parts its row of the table allows (its own part always).

The table is the one under a line naming this file: a row's first cell names module
prefixes in backticks, its second the prefixes they may import (none: the standard
library and third-party packages only). A module follows the row of its longest prefix.
"""
from __future__ import annotations

import re

import pytest

from support.imports import import_graph
from support.stack import REPO

NAME = re.compile(r"`(ac_observe[\w.]*)`")


def layering_table() -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """[(module prefixes, may import)] from ARCHITECTURE.md."""
    text = (REPO / "ARCHITECTURE.md").read_text()
    assert "tests/test_layering.py" in text, "ARCHITECTURE.md names no layering table"
    after = text[text.index("tests/test_layering.py"):]
    rows = []
    for line in after.splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or set(cells[0]) <= set("-: ") or "prefix" in cells[0]:
            continue
        rows.append((tuple(NAME.findall(cells[0])), tuple(NAME.findall(cells[1]))))
    assert rows, "the layering table has no rows"
    return rows


def _row(module: str, rows) -> tuple[str, tuple[str, ...]] | None:
    """(the longest prefix of the table that holds `module`, what its row may import)."""
    best = None
    for prefixes, allowed in rows:
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[0]):
                    best = (prefix, allowed)
    return best


def may_import(module: str, imported: str, rows) -> bool:
    """An allowed name that heads a row admits that row's modules (`ac_observe`: the
    contract, not every module under it); any other (a module such as
    `ac_observe.daemon.alerting.rules`) admits itself and what is inside it."""
    own, allowed = _row(module, rows)
    heads = {prefix for prefixes, _ in rows for prefix in prefixes}
    target = _row(imported, rows)
    if target is not None and target[0] in ({own} | (set(allowed) & heads)):
        return True
    return any(imported == name or imported.startswith(name + ".")
               for name in set(allowed) - heads)


def test_every_module_imports_only_what_its_row_allows():
    rows = layering_table()
    graph = import_graph()
    unplaced = sorted(name for name in graph if _row(name, rows) is None)
    assert not unplaced, f"modules in no row of the layering table: {unplaced}"
    broken = [f"{name} imports {imported}"
              for name, (_, anywhere) in sorted(graph.items())
              for imported in sorted(anywhere)
              if imported.startswith("ac_observe") and not may_import(name, imported, rows)]
    assert not broken, "\n".join(broken)


def _module_of(name: str, modules) -> str | None:
    """The module an imported name is (or lies in: `pkg.mod.Class` -> `pkg.mod`)."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in modules else None


def test_no_import_loop_among_the_packages_modules():
    """Dependencies point one way, never in a loop: no module reaches itself through what
    it imports, at module level or inside a function."""
    graph = import_graph()
    edges = {name: {target for imported in anywhere
                    if (target := _module_of(imported, graph)) not in (None, name)}
             for name, (_, anywhere) in graph.items()}
    # A package's own __init__ is no step of a loop: importing `pkg.mod` runs it anyway.
    edges = {name: {t for t in targets if not name.startswith(t + ".")}
             for name, targets in edges.items()}
    loops = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(edges[name]):
            if state.get(target) == 1:
                loops.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert not loops, "\n".join(" -> ".join(loop) for loop in loops)


@pytest.mark.parametrize("module, imported, allowed", [
    ("ac_observe.engine.model", "ac_observe.daemon.service", False),
    ("ac_observe.collectors.nvml", "ac_observe.engine.config", False),
    ("ac_observe.dashboards.grafana", "ac_observe.daemon.store", False),
    ("ac_observe.dashboards.promql", "ac_observe.daemon.alerting.rules", True),
    ("ac_observe.daemon.service", "ac_observe.collectors.base", True),
    ("ac_observe.metrics", "ac_observe.daemon.query", False),
    ("ac_observe.engine.model", "ac_observe.metrics", True),
    ("ac_observe.daemon.cli.engine", "ac_observe.engine.server", True),
    ("ac_observe.daemon.service", "ac_observe.daemon.cli.app", False),
    ("ac_observe.daemon.alerting.rules", "ac_observe.daemon.store", False),
])
def test_the_table_says_what_the_architecture_promises(module, imported, allowed):
    """The rules the table must keep (a table edited into allowing anything fails here)."""
    assert may_import(module, imported, layering_table()) is allowed, (module, imported)
