"""The installed package's modules and what each imports, read from their source (ast):
the layering and packaging tests hold these to the rules in ARCHITECTURE.md."""
from __future__ import annotations

import ast
from pathlib import Path

import ac_observe


def installed_modules() -> dict[str, Path]:
    """Every module of the installed package, subpackages included: name -> source file."""
    root = Path(ac_observe.__file__).parent
    found = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(("ac_observe", *parts))] = path
    return found


def imports_of(path: Path, module: str) -> tuple[set[str], set[str]]:
    """(imported at module level, imported anywhere) as absolute module names."""
    tree = ast.parse(path.read_text())
    top: set[str] = set()
    anywhere: set[str] = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]

    def names(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        if node.level:  # relative: resolve against this module's package
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            prefix = f"{base}.{node.module}" if node.module else base
        else:
            prefix = node.module
        # `from pkg import mod` may import a submodule: count both.
        return [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]

    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            anywhere.update(names(node))
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            top.update(names(node))
        elif isinstance(node, (ast.If, ast.Try)):  # `if TYPE_CHECKING:`, `try: import`
            for child in ast.walk(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    top.update(names(child))
    return top, anywhere


def import_graph() -> dict[str, tuple[set[str], set[str]]]:
    """module -> (imported at module level, imported anywhere)."""
    return {name: imports_of(path, name) for name, path in installed_modules().items()}
