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


#: Words that tell a story instead of a manual: history lives in CHANGELOG.md and git.
HISTORY = re.compile(r"\b(session|issue) \d+\b|\bthe (article|review)\b", re.IGNORECASE)
#: "each session 8 hours after its sign-in" is a console session's lifetime, not history.
NOT_HISTORY = re.compile(r"session \d+ hours", re.IGNORECASE)


def _manual_and_code() -> list[Path]:
    suffixes = {".py", ".md", ".sql", ".lua", ".yaml", ".html"}
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "tests" / "README.md"]
    pages += sorted((ROOT / "docs").rglob("*.md"))
    pages += sorted(p for p in (ROOT / "gateway").rglob("*") if p.suffix in suffixes)
    return pages


def test_code_and_docs_say_what_is_not_how_it_came_to_be() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _manual_and_code()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if HISTORY.search(NOT_HISTORY.sub("", line))
    ]
    assert not found, "history outside CHANGELOG.md and git:\n" + "\n".join(found)
