"""Broken builds for the hostile-input guards (tests/test_hostile.py, tests/test_fuzz.py)."""

from tests.mutants import Mutant

HOSTILE = "tests/test_hostile.py"
KEYS = f"{HOSTILE}::test_bad_keys_get_a_clear_answer_for_every_source_kind"


def case(*ids: str) -> tuple[str, ...]:
    return tuple(f"{KEYS}[{i}-memory]" for i in ids)


MUTANTS = [
    Mutant(
        name="key-length-unchecked",
        path="gateway/keying.py",
        old="        if len(key) > spec.max_length:",
        new="        if False:",
        tests=case(
            "header-over-255", "header-over-route-limit", "query-over-255", "body-key-over-255"
        ),
        breaks="a key over the route's max_length is accepted",
    ),
    Mutant(
        name="control-characters-allowed",
        path="gateway/keying.py",
        old="        if _CONTROL.search(key):",
        new="        if False:",
        tests=case("header-tab", "header-c1-as-utf8", "query-nul", "query-newline", "body-control"),
        breaks="a key with control characters is stored and forwarded",
    ),
    Mutant(
        name="surrogates-allowed",
        path="gateway/keying.py",
        old="        if _SURROGATE.search(key):",
        new="        if False:",
        tests=case("body-lone-surrogate", "query-not-utf8", "template-body-surrogate"),
        breaks='a JSON "\\ud800" key is a 500; bytes that are not UTF-8 become keys',
    ),
    Mutant(
        name="namespace-unhashed",
        path="gateway/keying.py",
        old="    return _frame(s.encode() for s in (route_name, scope, key))[:32]",
        new="    return key",
        tests=(f"{HOSTILE}::test_escaping_keys_stay_in_their_namespace_on_redis",),
        breaks="user keys reach Redis names and share records across routes and scopes",
    ),
    Mutant(
        name="query-decoded-lossily",
        path="gateway/keying.py",
        old='keep_blank_values=True, errors="surrogateescape")',
        new='keep_blank_values=True, errors="replace")',
        tests=case("query-not-utf8", "query-cut-utf8", "query-overlong-utf8"),
        breaks="?k=%FF and ?k=%FE become the same key (U+FFFD): a wrong replay",
    ),
    Mutant(
        name="header-read-as-latin1",
        path="gateway/keying.py",
        old='    return raw.decode("utf-8", "surrogateescape")',
        new="    return value",
        tests=case("header-not-utf8", "header-utf8", "template-header-not-utf8"),
        breaks="header bytes that are not UTF-8 become keys; UTF-8 keys read as control characters",
    ),
    Mutant(
        name="header-unicode-stripped",
        path="gateway/keying.py",
        old='    value = _header_text(values[0]).strip(" \\t")',
        new="    value = _header_text(values[0]).strip()",
        tests=(f"{HOSTILE}::test_different_bytes_never_share_a_key_or_a_response",),
        breaks='"k\\u00a0" gets the record of "k": a wrong replay',
    ),
    Mutant(
        name="infinite-number-key",
        path="gateway/keying.py",
        old="    if isinstance(value, float) and not math.isfinite(value):",
        new="    if False:",
        tests=case("body-overflowing-number"),
        breaks='1e999 and 2e999 share the key "Infinity"',
    ),
    Mutant(
        name="control-header-forwarded",
        path="gateway/http/request.py",
        old="        if not bad and _FORBIDDEN_IN_HEADER.search(text):",
        new="        if False:",
        tests=case("control-in-another-header"),
        breaks="a header with control characters reaches the upstream client: a 500",
    ),
    Mutant(
        name="body-limit-removed",
        path="gateway/http/request.py",
        old="        size += len(chunk)\n        if size > limit:",
        new="        size += len(chunk)\n        if False:",
        tests=(f"{HOSTILE}::test_chunked_body_growing_past_the_limit_is_cut_off_while_streaming",),
        breaks="a chunked body with no length is buffered without bound",
    ),
    Mutant(
        name="truncated-body-forwarded",
        path="gateway/http/request.py",
        old='        if message["type"] == "http.disconnect":\n',
        new='        if message["type"] == "http.disconnect":\n            break\n',
        tests=(f"{HOSTILE}::test_truncated_body_is_never_forwarded",),
        breaks="the part of a body that arrived before a hang-up runs upstream",
    ),
    Mutant(
        name="decoded-path-forwarded",
        path="gateway/proxy/app.py",
        old="                path=raw_path,",
        new='                path=scope["path"],',
        tests=(
            f"{HOSTILE}::test_encoded_paths_are_forwarded_as_sent",
            f"{HOSTILE}::test_two_paths_that_decode_alike_do_not_share_a_response",
        ),
        breaks="%3F becomes a query and %0D%0A a line break upstream; %2F and / share a response",
    ),
    Mutant(
        name="other-transfer-codings",
        path="gateway/http/request.py",
        old='    if codings and codings != ["chunked"]:',
        new="    if False:",
        tests=(f"{HOSTILE}::test_transfer_codings_other_than_chunked_are_refused",),
        breaks="a gzip-coded body reaches the upstream without its coding",
    ),
    Mutant(
        name="head-unbounded",
        path="gateway/http/protocol.py",
        old="            if self._head_bytes > self._limit + READ_SLACK:",
        new="            if False:",
        tests=(f"{HOSTILE}::test_endless_header_line_is_cut_off_while_it_streams",),
        breaks="a header line that never ends is buffered without bound",
    ),
    Mutant(
        name="header-size-unchecked",
        path="gateway/http/protocol.py",
        old="        if self._header_bytes > self._limit:",
        new="        if False:",
        tests=(f"{HOSTILE}::test_oversized_headers_get_431_and_target_414",),
        breaks="oversized headers are buffered whole before any 431",
    ),
    Mutant(
        name="framing-errors-plain-text",
        path="gateway/http/protocol.py",
        old="    def send_400_response(self, msg: str) -> None:",
        new="    def _unused_send_400_response(self, msg: str) -> None:",
        tests=(f"{HOSTILE}::test_ambiguous_framing_is_refused_and_nothing_is_forwarded",),
        breaks="unparseable requests get uvicorn's text/plain 400, not problem+json",
    ),
    Mutant(
        name="log-line-forged",
        path="gateway/logs.py",
        old="            if not path.isprintable():",
        new="            if False:",
        tests=(f"{HOSTILE}::test_text_access_log_line_cannot_be_forged_by_the_path",),
        breaks="a %0D%0A in the path writes a forged line into the text access log",
    ),
    Mutant(
        name="continue-held",
        path="gateway/http/cycle.py",
        old="            self.transport.write(CONTINUE)\n",
        new="            self._head = CONTINUE  # held with the answer's head\n",
        tests=(f"{HOSTILE}::test_expect_continue_and_head_answers_are_not_held",),
        breaks="a 100 Continue waits for the final answer: the client never sends its body",
    ),
    Mutant(
        name="head-answer-held",
        path="gateway/http/protocol.py",
        old='        hold = method != "HEAD"',
        new="        hold = True",
        tests=(f"{HOSTILE}::test_expect_continue_and_head_answers_are_not_held",),
        breaks="the answer to a HEAD is held for a body write that never comes",
    ),
    Mutant(
        name="access-json-differs",
        path="gateway/logs.py",
        old="""f'"route": {_maybe(trace.route)}, "key": {_maybe(key)}, """,
        new="""f'"route": {_maybe(trace.route)}, "key": "{key}", """,
        tests=(f"{HOSTILE}::test_access_log_line_is_json_dumps",),
        breaks="the hand-written JSON access line stops being valid JSON for some keys",
    ),
]
