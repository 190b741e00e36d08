"""The layout holds: one-way dependencies, no module cycles, no private reach-ins.

The import graph of the four packages is built from the source (ast), counting every
import: at module level, inside functions and under ``TYPE_CHECKING`` alike, since a
deferred import that closes a cycle is still a cycle. ``from pkg import name`` is an
edge to ``pkg.name`` when that is a module, else to ``pkg`` itself. Importing a module
also runs its parents' ``__init__``; those implicit edges are not counted (the
package ``__init__`` files are light: see ``resilient/__init__.py``).

The declared order, bottom to top, is docs/ARCHITECTURE.md's "Dependency order".
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("resilient", "membership", "recovery", "chaos")

# Bottom to top. A module may import only from its own layer or the ones below.
# A name matches a module and everything under it; "resilient" alone is the
# package's __init__ (the public face), matched exactly.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "base",
        (
            "resilient.errors",
            "resilient.config",
            "resilient.events",
            "resilient.procs",
            "resilient.failures",
        ),
    ),
    ("membership", ("membership",)),
    ("links", ("resilient.links",)),
    ("collectives", ("resilient.collectives",)),
    ("detection", ("resilient.detect",)),
    ("call checks", ("resilient.check",)),
    (
        "process group",
        ("resilient.group", "resilient.process_group", "resilient.backend", "resilient.progress"),
    ),
    ("launch", ("resilient.launch",)),
    ("recovery", ("recovery",)),
    ("chaos", ("chaos",)),
    ("cli", ("resilient.cli", "resilient.__main__", "resilient")),
)


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
        # Compiled extensions are modules too (their source is C).
        for path in sorted((ROOT / pkg).rglob("*.c")):
            found[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
    return found


MODULES = _modules()


def _edges(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import of the four packages in ``path``."""
    if path.suffix != ".py":
        return []
    is_pkg = path.name == "__init__.py"
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                if not is_pkg:
                    base.pop()
                base = base[: len(base) - node.level + 1]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                out.append((sub if sub in MODULES else mod, node.lineno))
    return [(m, line) for m, line in out if m.split(".")[0] in PACKAGES]


GRAPH = {name: _edges(name, path) for name, path in MODULES.items()}


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            exact = p == "resilient"
            if (module == p or (not exact and module.startswith(p + "."))) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def _private_owner(module: str) -> str | None:
    """The package a private module belongs to (``a.b._c`` -> ``a.b``), or None."""
    parts = module.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part.startswith("_") and part not in ("__init__", "__main__"):
            return ".".join(parts[:i])
    return None


def test_every_module_has_a_declared_layer() -> None:
    missing = sorted(m for m in MODULES if layer_of(m) < 0)
    assert not missing, f"modules in no layer of LAYERS: {missing}"


def test_no_module_imports_upward() -> None:
    bad = []
    for name, edges in GRAPH.items():
        for target, line in edges:
            if target in MODULES and layer_of(target) > layer_of(name):
                bad.append(
                    f"{MODULES[name].relative_to(ROOT)}:{line}: {name} "
                    f"({LAYERS[layer_of(name)][0]}) imports {target} "
                    f"({LAYERS[layer_of(target)][0]})"
                )
    assert not bad, "imports against the declared order:\n" + "\n".join(sorted(bad))


def test_no_module_imports_another_packages_private_module() -> None:
    bad = []
    for name, edges in GRAPH.items():
        for target, line in edges:
            owner = _private_owner(target)
            if owner is not None and not name.startswith(owner + ".") and name != owner:
                bad.append(f"{MODULES[name].relative_to(ROOT)}:{line}: {name} imports {target}")
    assert not bad, "imports of another package's private module:\n" + "\n".join(sorted(bad))


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in GRAPH[v]:
            if w not in MODULES or w == v:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in MODULES:
        if v not in index:
            visit(v)
    return found


def test_no_module_cycles() -> None:
    cycles = _cycles()
    assert not cycles, "module cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checks_see_what_they_look_for() -> None:
    # The graph is not empty and the order is not vacuous: the process group
    # imports the links, and the links sit below it.
    assert ("resilient.links.table", 0) not in GRAPH["resilient.process_group"]
    targets = {t for t, _ in GRAPH["resilient.process_group"]}
    assert any(t.startswith("resilient.links") for t in targets)
    assert layer_of("resilient.links.link") < layer_of("resilient.process_group")
    assert layer_of("resilient") == len(LAYERS) - 1
    assert _private_owner("resilient.links._stepio") == "resilient.links"
    assert _private_owner("membership.members") is None


def test_top_level_of_resilient_stays_small() -> None:
    top = [p for p in (ROOT / "resilient").iterdir() if p.suffix in (".py", ".c")]
    assert len(top) <= 12, sorted(p.name for p in top)


def test_modules_stay_under_the_size_bound() -> None:
    # ~500 lines; a little slack so that a docstring line does not fail CI.
    long = {
        str(p.relative_to(ROOT)): n
        for p in MODULES.values()
        if (n := len(p.read_text().splitlines())) > 520
    }
    assert not long, f"modules over ~500 lines: {long}"


def _one_edit_apart(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` differ by one inserted, deleted or changed letter."""
    if abs(len(a) - len(b)) > 1 or a == b:
        return False
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return a[i + 1 :] == b[i + 1 :] or a[i:] == b[i + 1 :] or a[i + 1 :] == b[i:]


def test_no_two_module_names_one_letter_apart() -> None:
    # `_elide` beside `_elided`, `_loss` beside `_lost`: names a reader confuses.
    names = sorted({p.stem for p in MODULES.values() if p.stem not in ("__init__", "__main__")})
    close = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :] if _one_edit_apart(a, b)]
    assert not close, f"module names one letter apart: {close}"
    assert _one_edit_apart("_loss", "_lost") and _one_edit_apart("epoch", "epochs")
    assert not _one_edit_apart("link", "links_table")
