"""Text an operator gives, checked before anything keeps it (gateway/operators/text.py,
its callers in gateway/operators/identity.py, gateway/operators/actions.py,
gateway/operators/response.py),
and a failing store said in the gateway's words (gateway/admin/api.py, the console),
caught by tests/test_operator_text.py."""

from tests.mutants import Mutant

T = "tests/test_operator_text.py::"
REFUSED = T + "test_text_the_store_cannot_hold_is_a_422_naming_the_field"

MUTANTS = [
    Mutant(
        name="operator-note-unchecked",
        path="gateway/operators/actions.py",
        old="        check_note(note)\n",
        new="",
        tests=(REFUSED + "[note-nul-postgres]", REFUSED + "[note-surrogate-memory]"),
        breaks="a note with a NUL or a lone surrogate reaches the store: PostgreSQL refuses it "
        "and the operator gets 503 store-unavailable with the driver's words, Redis and "
        "memory a 500",
    ),
    Mutant(
        name="operator-name-unchecked",
        path="gateway/operators/identity.py",
        old='            check_name(given.strip(" "))\n',
        new="            pass\n",
        tests=(REFUSED + "[name-nul-postgres]", REFUSED + "[name-escape-memory]"),
        breaks="a name given with the shared token is kept as sent: a NUL is a false 503, an "
        "ESC sequence is recorded as the holder and replayed into every terminal listing it",
    ),
    Mutant(
        name="operator-body-unchecked",
        path="gateway/operators/response.py",
        old="        check_body(body)  # text no UTF-8 can write: InvalidText, before it is "
        "encoded\n",
        new="        pass\n",
        tests=(REFUSED + "[body-surrogate-memory]",),
        breaks="a response body with a lone surrogate is encoded unchecked: a 500 and a "
        "traceback instead of a 422 naming response.body",
    ),
    Mutant(
        name="operator-controls-allowed",
        path="gateway/operators/text.py",
        old='_NOT_IN_A_NAME = INVISIBLE | {"Cc", "Cs"}\n',
        new='_NOT_IN_A_NAME = {"Cs"}\n',
        tests=(REFUSED + "[name-escape-memory]", T + "test_the_rules_alone"),
        breaks="a name may hold ESC, CSI, line breaks and a right-to-left override: a "
        "holder's name rewrites the operator's terminal when `keys list` prints it, or reads "
        "as another name",
    ),
    Mutant(
        name="operator-name-invisible-allowed",
        path="gateway/operators/text.py",
        old='_NOT_IN_A_NAME = INVISIBLE | {"Cc", "Cs"}\n',
        new='_NOT_IN_A_NAME = frozenset({"Cc", "Cs"})\n',
        tests=(
            REFUSED + "[name-bom-memory]",
            REFUSED + "[name-line-sep-memory]",
            T + "test_the_rules_alone",
        ),
        breaks="a name may hold U+FEFF, a zero-width space, a right-to-left override or a "
        "line separator: `x\\ufeffy` is recorded and shown as `xy (shared token)`, another "
        "name",
    ),
    Mutant(
        name="operator-note-controls-allowed",
        path="gateway/operators/text.py",
        old='_CONTROL_BUT_LINES = re.compile(r"[\\x00-\\x08\\x0b\\x0c\\x0e-\\x1f\\x7f-\\x9f'
        '\\ud800-\\udfff]")\n',
        new='_CONTROL_BUT_LINES = re.compile(r"[\\x00\\ud800-\\udfff]")\n',
        tests=(REFUSED + "[note-bell-memory]",),
        breaks="a note may hold ESC and BEL: printed by `keys show` or a log viewer, it "
        "retitles the terminal or rings it",
    ),
    Mutant(
        name="operator-note-unbounded",
        path="gateway/operators/text.py",
        old="    if limit is not None and len(value) > limit:\n",
        new="    if False:\n",
        tests=(REFUSED + "[note-long-memory]",),
        breaks="a note of any length is kept in the record's history, read back on every "
        "listing of the key",
    ),
    Mutant(
        name="store-failure-said-in-the-drivers-words",
        path="gateway/admin/api.py",
        old="        exc = StoreUnavailable(STORE_DOWN)\n",
        new="        exc = StoreUnavailable(str(exc))\n",
        tests=(T + "test_a_store_that_fails_is_said_in_our_words_and_logged_in_its_own",),
        breaks="an operator call the store failed under answers with the driver's message "
        "(the store's address, an errno, the text it could not take)",
    ),
    Mutant(
        name="problem-with-a-surrogate-crashes",
        path="gateway/errors.py",
        old="        except UnicodeEncodeError:\n",
        new="        except ZeroDivisionError:\n",
        tests=(T + "test_a_header_name_that_is_no_header_is_refused_in_words",),
        breaks="a refusal that repeats a header name holding a lone surrogate cannot be "
        "encoded: a 500 instead of 400 bad-response",
    ),
    Mutant(
        name="console-store-failure-in-the-drivers-words",
        path="gateway/console/site.py",
        old='        "The store did not answer. Nothing was changed; try again shortly (the '
        "gateway's \"\n",
        new='        f"The store did not answer ({exc}). Nothing was changed; (the gateway\'s "\n',
        tests=(T + "test_a_store_that_fails_is_said_in_our_words_and_logged_in_its_own",),
        breaks="the console's page for a failing store quotes the driver: the store's address "
        "and the connection's error, to anyone signed in",
    ),
    Mutant(
        name="overview-store-error-in-the-drivers-words",
        path="gateway/operators/actions.py",
        old='            "error": "the store did not answer; the gateway\'s log says why",\n',
        new='            "error": str(exc),\n',
        tests=(T + "test_a_store_that_fails_is_said_in_our_words_and_logged_in_its_own",),
        breaks="the overview (API, console, `keys overview`) says what the driver said when "
        "the store did not answer",
    ),
    Mutant(
        name="listing-route-filter-unchecked",
        path="gateway/operators/actions.py",
        old="    route = parse_route(route)\n    states = frozenset(states)\n",
        new="    states = frozenset(states)\n",
        tests=(T + "test_every_listing_filter_refuses_hostile_values_up_front",),
        breaks="`GET /admin/keys?route=%00` reaches the store: PostgreSQL refuses the NUL "
        "byte (503, its error logged), the others list nothing instead of saying why",
    ),
]
