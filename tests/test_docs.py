"""The README stays a front door, and no page of the manual links to nothing.

Every relative link in README.md, CONTRIBUTING.md, tests/README.md and the pages under
docs/ must name a file of the repository, and its `#anchor` a heading of that page (as
GitHub makes anchors from headings), so moving a section shows up here rather than in a
reader's 404.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_LINES = 400
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "tests" / "README.md",
        *(ROOT / "docs").rglob("*.md"),
    ]
)

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+?)#*$", re.M)


def prose(text: str) -> str:
    """The page without code blocks and code spans, where brackets are not links."""
    return CODE.sub("", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped
    (`_` and `-` kept), spaces as `-`, a repeated one suffixed -1, -2, ..."""
    found: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in found:
            n += 1
            anchor = f"{slug}-{n}"
        found.add(anchor)
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or root not in (linked, *linked.parents):
            broken.append(f"{target}: no such file in the repository")
        elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked)):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(root)}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_readme_is_a_front_door_not_the_manual() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_LINES, (
        f"README.md has {lines} lines: it is the front door (what and why, the quickstart, "
        "install, a configuration overview, links); behaviours go to docs/concepts.md, "
        "settings to the config model's docstrings, operations to docs/operations.md"
    )


def test_the_readme_links_every_page_of_the_manual() -> None:
    readme = prose((ROOT / "README.md").read_text())
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in LINK.findall(readme)}
    pages = {ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", ROOT / "docs" / "decisions"}
    pages |= set((ROOT / "docs").glob("*.md"))
    missing = [p for p in pages if p not in linked and p / "README.md" not in linked]
    assert missing == [], f"pages README.md does not link: {missing}"


def test_the_checker_catches_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    """The checks bite: a link to no file, to a file outside the repository, or to no
    heading is reported; a link in a code block is no link."""
    (tmp_path / "outside.md").write_text("# Outside\n")
    docs = tmp_path / "repo" / "docs"
    docs.mkdir(parents=True)
    (docs / "concepts.md").write_text("# Concepts\n\n## The promise\n")
    page = docs / "probe.md"
    page.write_text(
        "# Probe\n\n## A `code` heading, and_more\n\n## Probe\n\n"
        "[ok](#a-code-heading-and_more) [ok](concepts.md#the-promise) [ok](#probe-1) "
        "[gone](nowhere.md) [gone](concepts.md#no-such-heading) [gone](#probe-2) "
        "[gone](../../outside.md)\n"
        "```\n[not a link](nowhere.md)\n```\n"
    )
    assert broken_links(page, tmp_path / "repo") == [
        "nowhere.md: no such file in the repository",
        "concepts.md#no-such-heading: no heading #no-such-heading in docs/concepts.md",
        "#probe-2: no heading #probe-2 in docs/probe.md",
        "../../outside.md: no such file in the repository",
    ]


#: A path in the package as the manual writes it: `gateway/...`, or a file of one of its
#: folders (`store/redis/store.py`); in `0NN_*.sql`, each N stands for a digit.
PACKAGE_FOLDERS = sorted(
    p.name for p in (ROOT / "gateway").iterdir() if p.is_dir() and not p.name.startswith("_")
)
PACKAGE_PATH = re.compile(
    r"(?<![\w./-])(gateway/[\w./*-]*[\w*/]"
    rf"|(?:{'|'.join(PACKAGE_FOLDERS)})/[\w./*-]*\.(?:py|lua|sql))"
)


def missing_package_paths(page: Path, root: Path = ROOT) -> list[str]:
    """The paths in the package a page names that are not in this tree."""
    missing = []
    for path in sorted(set(PACKAGE_PATH.findall(page.read_text()))):
        relative = path if path.startswith("gateway/") else f"gateway/{path}"
        if "*" in relative:
            exists = any(root.glob(relative.replace("N", "[0-9]")))
        else:
            exists = (root / relative).exists()
        if not exists:
            missing.append(path)
    return missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_in_the_package_a_page_names_exists(page: Path) -> None:
    """A module moved or renamed shows up here, not in a reader's search; CHANGELOG.md
    names paths as they were, and is not checked."""
    assert missing_package_paths(page) == []


def test_the_path_check_sees_what_it_looks_for(tmp_path: Path) -> None:
    for name in ("gateway/store/sql/001_initial.sql", "gateway/engine/core.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    page = tmp_path / "page.md"
    page.write_text(
        "`gateway/engine/core.py`, `engine/core.py`, gateway/store/ and "
        "`gateway/store/sql/0NN_*.sql` exist; `gateway/settlement.py`, `engine/gone.py`, "
        "gateway/store/lua/ and `gateway/store/sql/1NN_*.sql` do not; "
        "/var/lib/idempotency-gateway/gateway.db and tests/engine/x.py are not the package's.\n"
    )
    assert missing_package_paths(page, tmp_path) == [
        "engine/gone.py",
        "gateway/settlement.py",
        "gateway/store/lua/",
        "gateway/store/sql/1NN_*.sql",
    ]


#: Words that tell a story instead of a manual: history lives in CHANGELOG.md and git.
HISTORY = re.compile(
    r"\b(sessions?|issues?) #?\d+\b"  # a work session or a tracker's issue by number
    r"|\bthe (article|review|lead)\b"
    r"|\bfound by (a|the) [\w ]*review\b"
    r"|\bstep \d+\)",
    re.IGNORECASE,
)
#: "each session 8 hours after its sign-in" is a console session's lifetime, not history.
NOT_HISTORY = re.compile(r"\bsessions? \d+ (hours?|minutes?|seconds?|days?)\b", re.IGNORECASE)
#: Where the manual and the code live: everything but CHANGELOG.md, which is history.
CHECKED = ("README.md", "CONTRIBUTING.md", "config.example.yaml", "pyproject.toml")
CHECKED_FOLDERS = ("gateway", "tests", "scripts", "docs", "deploy")


def _text_files(root: Path = ROOT) -> list[Path]:
    """Every text file of the manual, the package, its tests, scripts and deployment
    files (a binary one, such as a screenshot, is skipped)."""
    paths = [root / name for name in CHECKED if (root / name).is_file()]
    for folder in CHECKED_FOLDERS:
        paths += sorted(
            p for p in (root / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts
        )
    return paths


def history(paths: list[Path], root: Path = ROOT) -> list[str]:
    """Each line of `paths` that tells how something came to be, as `path:line: text`."""
    found = []
    for path in paths:
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            text = data.decode()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if HISTORY.search(NOT_HISTORY.sub("", line)):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_code_tests_and_docs_say_what_is_not_how_it_came_to_be() -> None:
    found = history(_text_files())
    assert not found, "history outside CHANGELOG.md and git:\n" + "\n".join(found)


def test_the_history_check_reads_every_folder_and_bites(tmp_path: Path) -> None:
    """A phrase of history is found in the package, the tests, a script without a suffix,
    the docs and the deployment files; a console session's lifetime, a screenshot and
    CHANGELOG.md are let be. (The phrases are joined here so this file has none.)"""
    issue, session = "iss" + "ue", "sess" + "ion"
    lines = {
        "gateway/store/batch.py": f"# the floor ({session}s 9 and 11)\n",
        "tests/test_x.py": f'"""{issue} 12, item 7: a path with dot-segments."""\n',
        "scripts/mutants": f"# see {issue} #14\n",
        "docs/design/x.md": f"As {'the'} review said, it waits.\n",
        "deploy/config.yaml": f"# {session} 3: the lease\n",
        "README.md": f"Step one (see {'step'} 2) comes first.\n",
        "tests/test_y.py": f"# found by a security {'re'}view of the pool\n",
    }
    calm = {
        "docs/console.md": f"| nothing | each {session} 8 hours after its sign-in |\n",
        "CHANGELOG.md": f"- {issue} 12: the listener.\n",
        "tests/test_z.py": "# the leading bytes, an operator reviewing a key\n",
    }
    for name, text in {**lines, **calm}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "docs" / "shot.png").write_bytes(b"\x89PNG\0 " + f"{session} 9".encode())
    found = history(_text_files(tmp_path), tmp_path)
    assert sorted(line.partition(":")[0] for line in found) == sorted(lines)
