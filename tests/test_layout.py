"""The package's shape stays what the README says it is.

Issue 13 split the large files and named every module in the README's design section
and in tests/README.md's module-to-tests table. These checks keep that true when a
module is added or grows: a new module nobody can find, or a file creeping back past
500 lines, fails here rather than in a reviewer's head.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gateway"
MAX_LINES = 500
#: The config package's modules are smaller by design (issue 13: about 300 lines).
MAX_CONFIG_LINES = 300


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py"))


def _named(module: Path) -> str:
    """How the docs name a module: `engine`, `store/redis_record`; config's as `config/`."""
    relative = module.relative_to(PACKAGE).with_suffix("")
    if relative.parts[0] == "config":
        return "config/"
    return relative.name


def _backticked(text: str) -> set[str]:
    return set(re.findall(r"`([a-z_/]+)`", text))


@pytest.mark.parametrize("module", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_package_file_outgrows_its_limit(module: Path) -> None:
    limit = MAX_CONFIG_LINES if "config" in module.relative_to(PACKAGE).parts else MAX_LINES
    lines = len(module.read_text().splitlines())
    assert lines <= limit, f"{module.relative_to(ROOT)} has {lines} lines (limit {limit})"


def test_every_module_is_named_in_the_readme_design_section() -> None:
    readme = (ROOT / "README.md").read_text()
    design = readme[readme.index("## Design") : readme.index("### Dependencies")]
    named = _backticked(design)
    missing = sorted({_named(m) for m in _modules()} - named - {"config/"})
    assert "config/" in named
    assert not missing, f"not in the README's design section: {missing}"


def test_every_module_has_a_row_in_the_tests_readme() -> None:
    table = (ROOT / "tests" / "README.md").read_text()
    rows = table[table.index("## Which tests cover which module") :]
    named = _backticked(rows)
    # store modules may be named with their folder (`store/redis_record`) or bare
    named |= {name.split("/")[-1] for name in named}
    missing = sorted({_named(m) for m in _modules()} - named - {"config/"})
    assert "config/" in named
    assert not missing, f"no row in tests/README.md: {missing}"
