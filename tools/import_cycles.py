"""List the import circles among bagua modules, and imports of another package's private module.

A circle is a strongly connected component of the module import graph with more than one module: modules that
reach each other through imports, however long the loop. Every ``import`` counts: at module level, inside a
function (a deferred import hides a circle from Python, not from the reader) and under ``if TYPE_CHECKING:`` (a
type annotation ties two layers as firmly as a call). A package's ``__init__`` importing its own submodules is
not an edge (it only re-exports them), and ``from pkg import module`` is an edge to the module, not to ``pkg``.

A private module (``_name.py``) or a private name (``_name`` in a module) belongs to its package: importing it
from another package is reported too (``from pkg.mod import _helper``; not attribute reads such as ``mod._helper``).

Usage::

    python tools/import_cycles.py [PACKAGE_DIR]      # default: bagua/ next to this file; exit 1 if any

Example:
    >>> import pathlib
    >>> root = pathlib.Path(__file__).resolve().parent.parent / "bagua"
    >>> cycles(root), private_imports(root), private_names(root)
    ([], [], [])
"""

from __future__ import annotations

import ast
import pathlib
import sys

__all__ = ["module_imports", "import_graph", "cycles", "private_imports", "private_names"]


def _module_names(package: pathlib.Path) -> dict[str, pathlib.Path]:
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def module_imports(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
    """Return the modules of ``known`` that the module ``name`` (file ``path``) imports, other than itself."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known  # `from pkg import module`
            found.update(submodules)
            if len(submodules) < len(node.names):  # some names are the package's own
                found.add(base)
    return {m for m in found if m in known and m != name}


def import_graph(package: pathlib.Path) -> dict[str, set[str]]:
    """Map each module under ``package`` to the modules it imports, less a package's edges to its own submodules."""
    names = _module_names(package)
    graph = {name: module_imports(path, name, set(names)) for name, path in names.items()}
    is_package = {name for name, path in names.items() if path.name == "__init__.py"}
    return {a: {b for b in targets if not (a in is_package and b.startswith(a + "."))} for a, targets in graph.items()}


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of ``graph``, each a sorted list of its nodes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def cycles(package: pathlib.Path) -> list[list[str]]:
    """Return the import circles under ``package``: each a sorted list of the modules that reach one another."""
    return sorted(c for c in _strongly_connected(import_graph(package)) if len(c) > 1)


def private_imports(package: pathlib.Path) -> list[tuple[str, str]]:
    """Return the pairs ``(importer, private module)`` where a module imports another package's ``_module``."""
    names = _module_names(package)
    found = []
    for importer, targets in import_graph(package).items():
        importer_package = importer if names[importer].name == "__init__.py" else importer.rpartition(".")[0]
        for target in targets:
            owner, _, leaf = target.rpartition(".")
            if leaf.startswith("_") and not leaf.startswith("__") and not (
                importer_package == owner or importer_package.startswith(owner + ".")
            ):
                found.append((importer, target))
    return sorted(found)


def _outside(importer_package: str, owner: str) -> bool:
    return not (importer_package == owner or importer_package.startswith(owner + "."))


def private_names(package: pathlib.Path) -> list[tuple[str, str]]:
    """Return the pairs ``(importer, "module._name")`` where a module imports a private name of another package's
    module by ``from module import _name``."""
    names = _module_names(package)
    found = []
    for importer, path in names.items():
        importer_package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.level or node.module not in names:
                continue
            owner = node.module if names[node.module].name == "__init__.py" else node.module.rpartition(".")[0]
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and f"{node.module}.{alias.name}" not in names and _outside(importer_package, owner):
                    found.append((importer, f"{node.module}.{alias.name}"))
    return sorted(found)


if __name__ == "__main__":
    root = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent / "bagua"
    circles, private = cycles(root), private_imports(root) + private_names(root)
    for circle in circles:
        print("circle: " + " <-> ".join(circle))
    for importer, target in private:
        print(f"private: {importer} imports {target}")
    sys.exit(1 if circles or private else 0)
