"""The console's guards (gateway/console/), caught by tests/test_console.py (real
browsers and gateway processes) and tests/test_console_session.py."""

from tests.mutants import Mutant

C = "tests/test_console.py::"
S = "tests/test_console_parts.py::"

MUTANTS = [
    Mutant(
        name="console-empty-page-says-nothing-waits",
        path="gateway/console/templates/keys_table.html",
        old="{% if next_url %}None on this page:",
        new="{% if False %}None on this page:",
        tests=(S + "test_an_empty_page_with_more_to_follow_says_so_and_links_on",),
        breaks="an empty page that stopped at its bound tells the operator no key waits "
        "while older ones follow",
    ),
    Mutant(
        name="console-autoescape-off",
        path="gateway/console/rendering.py",
        old="        autoescape=True,\n",
        new="        autoescape=False,\n",
        tests=(
            C + "test_a_hostile_key_note_and_header_show_as_text_and_run_nothing",
            S + "test_autoescape_draws_hostile_text_as_text",
        ),
        breaks="a key, note or header written by a caller is drawn as HTML: "
        "`\"><img src=x onerror=alert(1)>` becomes an element on the operator's page",
    ),
    Mutant(
        name="console-csp-dropped",
        path="gateway/console/rendering.py",
        old="    response.headers.update(HEADERS)\n",
        new="",
        tests=(C + "test_every_page_sends_the_strict_csp_and_has_no_inline_script_or_style",),
        breaks="pages go out without their Content-Security-Policy (and nosniff, frame "
        "denial, no-store): one escaping slip would run a caller's script",
    ),
    Mutant(
        name="console-csrf-unchecked",
        path="gateway/console/access.py",
        old="    if not csrf.token_ok(",
        new="    if False and not csrf.token_ok(",
        tests=(C + "test_forged_posts_are_refused_and_change_nothing",),
        breaks="a post without the session's CSRF token is acted on: a forged form "
        "claims keys in a signed-in operator's name",
    ),
    Mutant(
        name="console-origin-unchecked",
        path="gateway/console/access.py",
        old="    check_origin(request)\n    who = await visitor(request)\n",
        new="    who = await visitor(request)\n",
        tests=(C + "test_forged_posts_are_refused_and_change_nothing",),
        breaks="a post from another site's page (wrong or missing Origin) is acted on",
    ),
    Mutant(
        name="console-removed-operator-kept",
        path="gateway/console/access.py",
        old="    operator = gateway.operators.by_name(session.name)\n",
        new="    operator = gateway.operators.by_name(session.name) or Operator(\n"
        "        session.name,\n"
        '        __import__("gateway.operators.identity", fromlist=["Role"]).Role.OPERATOR,\n'
        '        "session",\n'
        "    )\n",
        tests=(C + "test_removing_an_operator_signs_them_out",),
        breaks="the session is trusted as signed instead of checked against the current "
        "operator list: an operator removed from the config keeps acting until the "
        "cookie expires",
    ),
    Mutant(
        name="console-cookie-mac-unchecked",
        path="gateway/console/session.py",
        old="    if not hmac.compare_digest(mac.encode(), _b64(_mac(secret, payload)).encode()):\n",
        new="    if False:\n",
        tests=(
            C + "test_forged_posts_are_refused_and_change_nothing",
            S + "test_a_forged_or_altered_cookie_is_no_session",
        ),
        breaks="a cookie anyone wrote is a session: changing the name in it makes its "
        "bearer another operator",
    ),
    Mutant(
        name="console-cookie-never-expires",
        path="gateway/console/session.py",
        old="    if not issued - CLOCK_SKEW <= moment < expires:\n",
        new="    if not issued - CLOCK_SKEW <= moment:\n",
        tests=(
            C + "test_forged_posts_are_refused_and_change_nothing",
            S + "test_a_session_round_trips_until_it_expires",
        ),
        breaks="a session is good forever: a cookie copied once keeps working",
    ),
    Mutant(
        name="console-viewer-gets-action-buttons",
        path="gateway/console/templates/key.html",
        old="  {% if not can_act %}\n",
        new="  {% if False %}\n",
        tests=(C + "test_a_viewer_sees_everything_and_has_no_action_buttons",),
        breaks="a viewer's key page offers claim and resolve forms they may not use",
    ),
    Mutant(
        name="console-live-refresh-off",
        path="gateway/console/static/refresh.js",
        old="      window.setTimeout(refresh, PERIOD_MS, elements[i]);\n",
        new="",
        tests=(C + "test_two_operators_on_two_replicas_hand_a_parked_key_over",),
        breaks="the keys list never refreshes: an operator does not see that another "
        "took a key until they reload",
    ),
    Mutant(
        name="console-invisible-characters-drawn",
        path="gateway/console/rendering.py",
        old="        finalize=_drawn,\n",
        new="",
        tests=(
            S + "test_text_that_shows_nothing_is_spelled_out_and_posted_back_as_it_is",
            C + "test_a_key_with_a_right_to_left_override_is_drawn_in_its_order",
        ),
        breaks="a key holding U+202E is drawn with the rest of it reversed, a key it is not; "
        "keys that differ by a zero-width space look alike",
    ),
    Mutant(
        name="console-posted-key-spelled-out",
        path="gateway/console/templates/ref_fields.html",
        old='value="{{ record.key|exact }}"',
        new='value="{{ record.key }}"',
        tests=(
            S + "test_text_that_shows_nothing_is_spelled_out_and_posted_back_as_it_is",
            C + "test_a_key_with_a_right_to_left_override_is_drawn_in_its_order",
        ),
        breaks="the claim and resolve forms post a key with its invisible characters spelled "
        "out: a key that is not the one on the page, which the operator cannot act on",
    ),
]
