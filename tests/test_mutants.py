"""Every mutant in tests/mutants/ still applies, and names tests that exist.

`scripts/mutants` runs the broken builds (minutes each); this checks in milliseconds
that a rename or a refactor has not left a mutant pointing at text that is gone, at a
file that moved, or at a test that was renamed, which would make it "missed" for the
wrong reason or, worse, silently never run.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import tests.mutants as package
from tests.mutants import Mutant

ROOT = Path(__file__).resolve().parents[1]


def _mutants() -> list[Mutant]:
    found: list[Mutant] = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        found.extend(getattr(importlib.import_module(f"tests.mutants.{info.name}"), "MUTANTS", []))
    return found


MUTANTS = _mutants()


def _test_names(path: Path) -> set[str]:
    """Top-level test functions and `Class::method` names defined in a test file."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(f"{node.name}::{item.name}")
    return names


def test_mutant_names_are_unique() -> None:
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_applies_exactly_once_and_names_real_tests(mutant: Mutant) -> None:
    target = ROOT / mutant.path
    assert target.is_file(), f"{mutant.name}: {mutant.path} does not exist"
    count = target.read_text().count(mutant.old)
    assert count == 1, f"{mutant.name}: its text occurs {count} times in {mutant.path}"
    assert mutant.old != mutant.new
    assert mutant.tests, f"{mutant.name} names no test"
    for node in mutant.tests:
        file, _, name = node.partition("::")
        path = ROOT / file
        assert path.is_file(), f"{mutant.name}: {file} does not exist"
        if name:
            base = name.split("[", 1)[0]
            assert base in _test_names(path), f"{mutant.name}: {node} is not defined"
