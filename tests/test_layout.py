"""The package's shape stays what the README says it is, and its layers hold.

- The layers contract in pyproject.toml (`[tool.importlinter]`) holds: entry points
  over the front ends over the assembly over the operators over the core over the
  parts over the foundations, type-only imports included.
- No import cycle between modules, type-only imports (`if TYPE_CHECKING:`) included.
- No module uses a name another module keeps private (`_name`): imported, read off an
  imported module, or called on an object of another module's class.
- Every module is named in the README's design section (its map says which module owns
  each behaviour a newcomer asks about, and each module it names exists; its store row
  names each store package and its modules) and in tests/README.md's module-to-tests
  table. A module's size is no rule: one concept
  stays whole.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gateway"

#: Import cycles allowed to remain, by their modules; each names why. Empty: none.
ALLOWED_CYCLES: dict[frozenset[str], str] = {}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py"))


def _module_names() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own)."""
    found: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _target(module: str, path: Path, node: ast.ImportFrom) -> str | None:
    """The module an ImportFrom reads from, relative imports resolved."""
    if not node.level:
        return node.module
    base = module.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports() -> tuple[dict[str, set[str]], list[str]]:
    """Each module's imports of other modules of the package (every import statement,
    wherever it is: `if TYPE_CHECKING:` and function bodies too), and each use of a
    name private to another module."""
    modules = _module_names()
    edges: dict[str, set[str]] = defaultdict(set)
    private: list[str] = []
    defined = {name: _private_definitions(path) for name, path in modules.items()}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        bound: dict[str, str] = {}  # a local name -> the module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules:
                        edges[module].add(alias.name)
                        bound[alias.asname or alias.name.split(".")[0]] = alias.name
            elif isinstance(node, ast.ImportFrom):
                target = _target(module, path, node)
                if target is None:
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in modules:
                        edges[module].add(sub)
                        bound[alias.asname or alias.name] = sub
                    elif target in modules:
                        edges[module].add(target)
                        if _is_private(alias.name):
                            private.append(f"{module} imports {target}.{alias.name}")
        own = defined[module]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in bound:
                private.append(f"{module} uses {bound[value.id]}.{node.attr}")
            elif node.attr not in own and not _is_self(value):
                # obj._name where no class of this module defines _name: another
                # module's private attribute or method
                private.append(f"{module} uses {ast.unparse(node)}")
        edges.setdefault(module, set())
    return edges, private


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_self(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def _private_definitions(path: Path) -> set[str]:
    """The private names a module defines: functions, methods, classes, attributes
    it assigns (self._x, obj._x, class bodies) and __slots__ entries."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.isidentifier():
                names.add(node.value)  # __slots__ entries, getattr names
    return {name for name in names if _is_private(name)}


def _cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = set()
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.add(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_layers_contract_holds() -> None:
    """import-linter's contract from pyproject.toml, on this tree's package."""
    lint = Path(sys.executable).parent / "lint-imports"
    run = subprocess.run(
        [str(lint), str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(ROOT)},
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "1 kept, 0 broken" in run.stdout


def test_no_import_cycles_type_only_imports_included() -> None:
    edges, _ = _imports()
    cycles = [c for c in _cycles(edges) if c not in ALLOWED_CYCLES]
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def test_no_module_uses_another_modules_private_names() -> None:
    _, private = _imports()
    assert not private, "private names used across modules:\n" + "\n".join(sorted(set(private)))


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    """The cycle finder and the private-name finder, on a cycle and a private use."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    source = tmp_path / "m.py"
    source.write_text("class A:\n    __slots__ = ('_x',)\n    def _y(self): self._z = 1\n")
    assert _private_definitions(source) == {"_x", "_y", "_z"}


def _named(module: Path) -> str:
    """How the docs name a module: its path in the package (`engine/core`,
    `assembly`); config's as `config/`; a store module by its own name (the store's
    row lists them)."""
    relative = module.relative_to(PACKAGE).with_suffix("")
    if relative.parts[0] == "config":
        return "config/"
    if relative.parts[0] == "store":
        return relative.name
    return relative.as_posix()


def _backticked(text: str) -> set[str]:
    return set(re.findall(r"`([a-z_/]+)`", text))


def _design() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme[readme.index("## Design") : readme.index("### Dependencies")]


def test_every_module_is_named_in_the_readme_design_section() -> None:
    named = _backticked(_design())
    missing = sorted({_named(m) for m in _modules()} - named - {"config/"})
    assert "config/" in named
    assert not missing, f"not in the README's design section: {missing}"


def test_the_design_map_names_modules_that_exist() -> None:
    """Each answer of the map ("Where does it live?") names modules of this tree."""
    design = _design()
    start = design.index("**Where does it live?**")
    answers = [line for line in design[start:].splitlines() if line.startswith("- ")]
    assert len(answers) >= 20
    for question in (
        "a repeat while the first still runs",
        "who may resolve a parked key",
        "the retry schedule",
    ):
        assert any(question in line for line in answers), question
    modules = {_named(m) for m in _modules()}
    packages = {p.relative_to(PACKAGE).as_posix() + "/" for p in PACKAGE.iterdir() if p.is_dir()}
    for line in answers:
        _, _, where = line.partition(":")
        places = [n for n in _backticked(where) if "/" in n or n in modules]
        assert places, f"names no module: {line}"
        unknown = [n for n in places if n not in modules and n not in packages]
        assert not unknown, f"{unknown} in: {line}"


def test_the_design_map_names_each_store_and_its_modules() -> None:
    """The store row names each store package (`redis/`, `postgres/`, `sqlite/`) and, in
    that store's part of the row, each of its modules: a module named by a bare name
    (`schema`) is not covered by another store's module of the same name."""
    row = next(line for line in _design().splitlines() if line.startswith("| `store/` |"))
    parts = re.split(r"`(\w+)/`:", row)
    named = {parts[i]: _backticked(parts[i + 1]) for i in range(1, len(parts), 2)}
    stores = sorted(p for p in (PACKAGE / "store").iterdir() if (p / "__init__.py").is_file())
    assert {p.name for p in stores} >= {"redis", "postgres", "sqlite"}
    for store in stores:
        assert store.name in named, f"the README's store row has no `{store.name}/`: part"
        modules = {m.stem for m in store.glob("*.py") if m.name != "__init__.py"}
        said = {name.removeprefix(f"{store.name}/") for name in named[store.name]}
        missing = sorted(modules - said)
        assert not missing, f"not in the `{store.name}/` part of the store row: {missing}"


def test_every_module_has_a_row_in_the_tests_readme() -> None:
    table = (ROOT / "tests" / "README.md").read_text()
    rows = table[table.index("## Which tests cover which module") :]
    named = _backticked(rows)
    # store modules may be named with their folders (`store/redis/record`,
    # `redis/record`) or bare
    folders = ("store/", "redis/", "postgres/")
    named |= {name.split("/")[-1] for name in named if name.startswith(folders)}
    missing = sorted({_named(m) for m in _modules()} - named - {"config/"})
    assert "config/" in named
    assert not missing, f"no row in tests/README.md: {missing}"
