"""The import graph of `equibuffer/`: every import (top level, inside functions, under
`TYPE_CHECKING`) read from the source, with no circle and no arrow back up the floors of
the house (DESIGN.md, "Layers"): the ground floor (types, checks, errors, barriers, the
buffer protocol), the ring, the sum tree, the rules, the views, the buffers, what is built
on buffers (clusters, mixers, rate limiters, sharding, the archive), the package's public
names, and above all of them `equibuffer.testing`, which the library never imports."""

import ast
import pathlib

import pytest

import equibuffer


# The package as it is imported: the source tree, or the installed wheel (`nox -s package`
# runs the tests from a copy without the source).
PACKAGE = pathlib.Path(equibuffer.__file__).resolve().parent

# The floors, lowest first: a module may import from its own floor or any floor below.
FLOORS: list[set[str]] = [
    {"_custom_types", "_checks", "_carried", "_errors", "_barriers", "_protocol", "_axes"},
    {"_episodes", "_frames"},
    {"_ring"},
    {"_sumtree"},
    {"rules"},
    {"views"},
    {"_buffers"},
    {"_cluster", "_mixer", "_ratelimit", "_sharding", "_archive"},
    {"_offline"},
    {"__init__"},
    {"testing"},
]


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The modules of the package that `name` imports, by every import statement in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # `from x import y` imports the submodule x.y when there is one, else x.
            targets = [
                f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin
                for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name inside
                target = target.rpartition(".")[0]
            if target.startswith("equibuffer") and target != name:
                found.add(target)
    return found


def _floor(name: str) -> tuple[int, bool]:
    """The floor of a module, and whether it is a package's `__init__` (which stands above
    its own modules: it re-exports them)."""
    parts = name.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for i, floor in enumerate(FLOORS):
        if top in floor:
            return i, False
    raise AssertionError(f"{name} is on no floor: add its package to FLOORS in {__file__}")


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_is_on_a_floor():
    assert "equibuffer._errors" in _graph(), f"no modules read under {PACKAGE}"
    for name in _graph():
        _floor(name)


def test_no_arrow_up():
    """No module imports from a floor above its own, and no module of a package imports the
    package's own `__init__` (the re-exports stand above the modules they re-export)."""
    graph, modules = _graph(), _modules()
    up = []
    for name, targets in graph.items():
        for target in targets:
            if _floor(target)[0] > _floor(name)[0]:
                up.append(f"{name} -> {target}")
            is_package = modules[target].name == "__init__.py"
            if is_package and name.startswith(target + ".") and target != "equibuffer":
                up.append(f"{name} -> {target} (its own package's re-exports)")
            if target == "equibuffer" and name != "equibuffer" and _floor(name)[0] < 8:
                up.append(f"{name} -> equibuffer (the public names)")
    assert not up, "imports that run back up:\n" + "\n".join(sorted(up))


def test_no_circle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                circles.append(" -> ".join(stack[stack.index(target) :] + [target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_library_never_imports_testing():
    graph = _graph()
    bad = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        if not name.startswith("equibuffer.testing")
        for target in targets
        if target.startswith("equibuffer.testing")
    )
    assert not bad, bad


@pytest.mark.parametrize("floor", ["equibuffer._errors", "equibuffer._carried"])
def test_errors_import_no_buffer(floor):
    """The checks import no buffer type (the ground floor imports nothing above it)."""
    assert all(_floor(t)[0] == 0 for t in _graph()[floor]), _graph()[floor]
