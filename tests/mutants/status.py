"""Broken builds of the status URL: each shows a delivery to someone who
does not hold its URL, and the identical-404 test must catch it."""

from tests.mutants import Mutant

S = "tests/test_status_url.py::"
WRONG = S + "test_every_wrong_url_gets_the_identical_404"

MUTANTS = [
    Mutant(
        name="status-token-unchecked",
        path="gateway/proxy/status.py",
        old="    if not hmac.compare_digest(record.token.encode(), given.encode()):\n",
        new="    if False:\n",
        tests=(WRONG + "[memory]", WRONG + "[redis]"),
        breaks="anyone who knows a key's digest reads its delivery, whatever token they send",
    ),
    Mutant(
        name="status-route-unchecked",
        path="gateway/proxy/status.py",
        old="record is None or record.route != name or not record.delivery",
        new="record is None or not record.delivery",
        tests=(WRONG + "[memory]", WRONG + "[redis]"),
        breaks="a delivery is shown under another route's name, with that route's scope rules",
    ),
    Mutant(
        name="status-scope-unchecked",
        path="gateway/proxy/status.py",
        old="    if not _scope_matches(route, record, headers):\n",
        new="    if False:\n",
        tests=(WRONG + "[memory]",),
        breaks="a header-scoped route shows one tenant's delivery to another who has its URL",
    ),
    Mutant(
        name="status-token-logged",
        path="gateway/logs.py",
        old='    at = path.find(status_prefix + "/")\n',
        new="    at = -1\n",
        tests=(S + "test_access_log_shows_the_token_as_stars[memory]",),
        breaks="the access log holds every status URL's token, so anyone reading logs reads them",
    ),
    Mutant(
        name="status-token-32-bits",
        path="gateway/engine/accept.py",
        old="base64.urlsafe_b64encode(drawn[8:])",
        new="base64.urlsafe_b64encode(drawn[8:12] * 4)",
        tests=(S + "test_the_token_is_all_128_bits_of_its_own_draw",),
        breaks="status URLs carry 32 random bits in 22 characters: guessable by brute force",
    ),
    Mutant(
        name="status-token-is-the-run-id",
        path="gateway/engine/accept.py",
        old="return drawn[:8].hex(), base64",
        new="return drawn[8:16].hex(), base64",
        tests=(S + "test_the_token_is_all_128_bits_of_its_own_draw",),
        breaks="the run id the access log and admin API show gives away half the status token",
    ),
]
