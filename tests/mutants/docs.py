"""Broken builds of the manual: a section renamed under its links, a page the README no
longer leads to, a README grown back into the manual."""

from tests.mutants import Mutant

D = "tests/test_docs.py::"

MUTANTS = [
    Mutant(
        name="runbook-section-renamed-under-its-links",
        path="docs/operations.md",
        old="## Choosing a store\n",
        new="## Picking a store\n",
        tests=(D + "test_every_relative_link_resolves[README.md]",),
        breaks="the README's link to choosing a store lands on the top of the runbook, "
        "not on the section it names",
    ),
    Mutant(
        name="readme-drops-the-console",
        path="README.md",
        old="- [The operator console](docs/console.md): each page, sessions, and what ends them.\n",
        new="",
        tests=(D + "test_the_readme_links_every_page_of_the_manual",),
        breaks="a page of the manual no reader of the README can find",
    ),
    Mutant(
        name="readme-grows-into-the-manual",
        path="README.md",
        old="## Documentation\n",
        new="## Documentation\n" + "\nA paragraph of the manual.\n" * 70,
        tests=(D + "test_the_readme_is_a_front_door_not_the_manual",),
        breaks="the README turns back into the manual, and the front door into a wall",
    ),
]
