from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import Route
from gateway.routes import Router, compile_path

# Keep hypothesis from writing an example database into the working tree.
no_db = settings(database=None, deadline=None)


def route(name: str, path: str, methods: set[str] | None = None) -> Route:
    return Route(
        name=name,
        path=path,
        upstream="http://up",
        methods=frozenset(methods) if methods is not None else None,
    )


def matched(router: Router, method: str, path: str) -> str | None:
    m = router.match(method, path)
    return None if m is None else m.route.name


def test_exact_path_matches_only_itself() -> None:
    router = Router((route("a", "/jobs/run"),))
    assert matched(router, "POST", "/jobs/run") == "a"
    assert matched(router, "POST", "/jobs/run/x") is None
    assert matched(router, "POST", "/jobs") is None
    assert router.match("POST", "/jobs/run") is not None
    assert router.match("POST", "/jobs/run").params == {}  # type: ignore[union-attr]


def test_trailing_slash_is_significant() -> None:
    router = Router((route("a", "/jobs/run"), route("b", "/items/{id}")))
    assert matched(router, "GET", "/jobs/run/") is None
    assert matched(router, "GET", "/items/1/") is None
    assert matched(router, "GET", "/items/1") == "b"


def test_segment_placeholder_matches_one_segment() -> None:
    router = Router((route("a", "/jobs/{name}/run"),))
    m = router.match("POST", "/jobs/nightly/run")
    assert m is not None and m.params == {"name": "nightly"}
    assert router.match("POST", "/jobs/a/b/run") is None
    assert router.match("POST", "/jobs//run") is None


def test_path_placeholder_matches_the_rest_with_slashes() -> None:
    router = Router((route("a", "/files/{rest:path}"),))
    m = router.match("PUT", "/files/a/b/c.txt")
    assert m is not None and m.params == {"rest": "a/b/c.txt"}


def test_several_params() -> None:
    router = Router((route("a", "/t/{tenant}/jobs/{job}"),))
    m = router.match("POST", "/t/acme/jobs/42")
    assert m is not None and m.params == {"tenant": "acme", "job": "42"}


def test_regex_characters_in_paths_are_literal() -> None:
    router = Router((route("a", "/v1.0/jobs"), route("b", "/x+/{id}")))
    assert matched(router, "GET", "/v1.0/jobs") == "a"
    assert matched(router, "GET", "/v1x0/jobs") is None
    assert matched(router, "GET", "/x+/1") == "b"
    assert matched(router, "GET", "/xx/1") is None


def test_methods_filter_and_none_means_any() -> None:
    router = Router((route("post", "/j", {"POST"}), route("any", "/j")))
    assert matched(router, "POST", "/j") == "post"
    assert matched(router, "post", "/j") == "post"
    assert matched(router, "DELETE", "/j") == "any"
    only = Router((route("post", "/j", {"POST"}),))
    assert matched(only, "GET", "/j") is None


def test_first_route_in_config_order_wins_pattern_before_exact() -> None:
    router = Router((route("pattern", "/jobs/{name}"), route("exact", "/jobs/special")))
    assert matched(router, "POST", "/jobs/special") == "pattern"


def test_first_route_in_config_order_wins_exact_before_pattern() -> None:
    router = Router((route("exact", "/jobs/special"), route("pattern", "/jobs/{name}")))
    assert matched(router, "POST", "/jobs/special") == "exact"
    assert matched(router, "POST", "/jobs/other") == "pattern"


def test_exact_with_wrong_method_falls_through_to_later_pattern() -> None:
    router = Router((route("exact", "/jobs/special", {"GET"}), route("pattern", "/jobs/{n}")))
    assert matched(router, "POST", "/jobs/special") == "pattern"
    assert matched(router, "GET", "/jobs/special") == "exact"


def test_pattern_with_wrong_method_does_not_shadow_later_exact() -> None:
    router = Router((route("pattern", "/jobs/{n}", {"GET"}), route("exact", "/jobs/special")))
    assert matched(router, "POST", "/jobs/special") == "exact"


def test_duplicate_exact_paths_split_by_method_keep_order() -> None:
    router = Router(
        (
            route("get", "/j", {"GET"}),
            route("pattern", "/{x}", {"POST"}),
            route("post", "/j", {"POST"}),
        )
    )
    assert matched(router, "GET", "/j") == "get"
    assert matched(router, "POST", "/j") == "pattern"


def test_no_routes_matches_nothing() -> None:
    assert Router(()).match("GET", "/") is None


@pytest.mark.parametrize("bad", ["/jobs/{name", "/jobs/{na-me}", "/jobs/name}", "/{a}/{a}"])
def test_malformed_patterns_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        compile_path(bad)
    with pytest.raises(ValueError):
        Router((route("a", bad),))


paths = st.lists(st.sampled_from(["/a", "/b", "/a/b", "/{x}", "/a/{x}", "/{x}/b"]), max_size=6)
segments = st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3)


@no_db
@given(paths, segments, st.sampled_from(["GET", "POST"]))
def test_router_agrees_with_linear_scan(
    route_paths: list[str], segs: list[str], method: str
) -> None:
    routes = tuple(route(str(i), p, {"GET"} if i % 2 else None) for i, p in enumerate(route_paths))
    path = "/" + "/".join(segs)
    expected = next(
        (
            r.name
            for r in routes
            if (r.methods is None or method in r.methods)
            and compile_path(r.path).fullmatch(path) is not None
        ),
        None,
    )
    assert matched(Router(routes), method, path) == expected
