"""List the pairs of bagua modules that import each other (two-file import circles).

Every ``import`` counts, at module level or inside a function (a deferred import hides a circle from Python, not
from the reader), except those under ``if TYPE_CHECKING:``, which never run. A package and its own submodules are
not a circle (``__init__`` re-exports them).

Usage::

    python tools/import_cycles.py [PACKAGE_DIR]      # default: bagua/ next to this file; exit 1 if any

Example:
    >>> import pathlib
    >>> cycles(pathlib.Path(__file__).resolve().parent.parent / "bagua")
    []
"""

from __future__ import annotations

import ast
import pathlib
import sys

__all__ = ["module_imports", "cycles"]


def _module_names(package: pathlib.Path) -> dict[str, pathlib.Path]:
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def module_imports(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that the module ``name`` (file ``path``) imports, other than itself."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {id(node) for branch in ast.walk(tree)
               if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
               for node in ast.walk(branch)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return {m for m in found if m in known and m != name}


def cycles(package: pathlib.Path) -> list[tuple[str, str]]:
    """The pairs ``(a, b)``, ``a < b``, of modules under ``package`` that import each other."""
    names = _module_names(package)
    graph = {name: module_imports(path, name, set(names)) for name, path in names.items()}
    pairs = {tuple(sorted((a, b))) for a in graph for b in graph[a] if a in graph[b]}
    return sorted((a, b) for a, b in pairs if not (b.startswith(a + ".") or a.startswith(b + ".")))


if __name__ == "__main__":
    root = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent / "bagua"
    found = cycles(root)
    for a, b in found:
        print(f"{a} <-> {b}")
    sys.exit(1 if found else 0)
