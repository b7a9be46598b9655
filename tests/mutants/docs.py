"""Broken builds of the manual: a section renamed under its links, a page the README no
longer leads to, a README grown back into the manual, history written into a test, a
path in the package that is gone, a file of broken builds left out of their table.
(The phrase of history is joined at run time, so this file has none.)"""

from tests.mutants import Mutant

D = "tests/test_docs.py::"
ISSUE = "iss" + "ue"

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
    Mutant(
        name="history-in-a-test",
        path="tests/test_oracle.py",
        old="#: the client-address fields, which the gateway sets itself.\n",
        new=f"#: the client-address fields, which the gateway sets itself ({ISSUE} 12, item 2).\n",
        tests=(D + "test_code_tests_and_docs_say_what_is_not_how_it_came_to_be",),
        breaks="a test's comment tells where it came from instead of what it holds",
    ),
    Mutant(
        name="concepts-names-a-module-gone",
        path="docs/concepts.md",
        old="`gateway/records.py`",
        new="`gateway/states.py`",
        tests=(D + "test_every_path_in_the_package_a_page_names_exists[docs/concepts.md]",),
        breaks="the manual sends a reader to a module that does not exist",
    ),
    Mutant(
        name="reliability-table-drops-a-file",
        path="docs/reliability.md",
        old="| `sqlite.py` (",
        new="| sqlite.py (",
        tests=(
            "tests/test_mutants.py::"
            "test_the_reliability_table_lists_every_mutant_file_with_its_count",
        ),
        breaks="a file of broken builds the reliability page does not list or count",
    ),
]
