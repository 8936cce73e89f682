"""The package's import graph: no circle, the library never imports ``bench/``, ``bench/`` takes no private
name, and no kernel module ranks itself (route order is ``routing.order``'s).

Every ``import`` counts, at module level or inside a function; imports under ``if TYPE_CHECKING:`` run
nowhere and do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "diffusers_trtllm"
ROOT = PACKAGE.name


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = (ROOT, *path.relative_to(PACKAGE).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def imports(name: str) -> list[tuple[str, str]]:
    """``(imported module, imported name or "")`` for every import statement of module ``name``."""
    tree = ast.parse(MODULES[name].read_text())
    skipped = _type_checking_nodes(tree)
    base = name.split(".") if _is_package(name) else name.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                prefix = base[:len(base) - node.level + 1]
                module = ".".join(prefix + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out += [(module, alias.name) for alias in node.names]
    return out


def edges(name: str) -> set[str]:
    """Modules of the package that importing module ``name`` runs: what it imports (``from pkg import submodule``
    names the submodule) and every package above those, whose ``__init__`` runs first."""
    found = set()
    for module, imported in imports(name):
        target = f"{module}.{imported}" if f"{module}.{imported}" in MODULES else module
        if target not in MODULES:
            continue
        found.add(target)
        parts = target.split(".")
        # packages above the target run first, except the importer's own (already running)
        found.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if not name.startswith(p + "."))
    return found - {name}


def test_no_import_circle():
    graph = {name: edges(name) for name in MODULES}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    circles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_the_library_never_imports_bench():
    bench = f"{ROOT}.bench"
    offenders = {name: sorted(e for e in edges(name) if e == bench or e.startswith(bench + "."))
                 for name in MODULES if not (name == bench or name.startswith(bench + "."))}
    assert not {k: v for k, v in offenders.items() if v}


def test_bench_takes_no_private_name():
    private = []
    for name in MODULES:
        if not name.startswith(f"{ROOT}.bench"):
            continue
        for module, imported in imports(name):
            if module.startswith(ROOT) and (imported.startswith("_") or any(p.startswith("_") for p in module.split("."))):
                private.append(f"{name}: {module} {imported}")
    assert not private


def test_no_kernel_module_ranks_itself():
    for name, path in MODULES.items():
        if name.startswith(f"{ROOT}.kernels."):
            tree = ast.parse(path.read_text())
            defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            assigned = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                        if isinstance(t, ast.Name)}
            assert not {"priority", "PREFERRED"} & (defined | assigned), name
