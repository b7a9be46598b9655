"""What the console says when it refuses, or has done something: in words, not codes.

A refusal from gateway/operators/actions.py carries what a program needs (`holder`,
`holder_since_ms`, `state`); the API's detail is written for a program's author
("send force: true"). The console says the same thing to the person at the screen:
who holds the key since when, what the key's state means, what to do next.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gateway.console.rendering import age, when
from gateway.errors import (
    HeldByAnother,
    InvalidText,
    InvalidTransition,
    NotTheHolder,
    OperatorRefusal,
    UnknownKey,
)


@dataclass(frozen=True, slots=True)
class Refusal:
    title: str
    words: str


_STATES = {
    "completed": "it is completed: repeats get its stored response",
    "released": "it was released: the next request runs it",
    "in_flight": "a request is running it right now",
    "queued": "it is queued for delivery: the gateway's workers deliver it",
    "retrying": "its delivery is retried by the gateway's workers",
    "unresolved": "nobody holds it: claim it first",
    "parked": "nobody holds it: claim it first",
    "claimed": "someone holds it",
}

_NOTICES = {
    "claimed": "You hold this key now. Check with the upstream, then resolve it.",
    "taken_over": "You took this key over; its history records the takeover.",
    "resolved_done": "Resolved done: repeats get the replay.",
    "resolved_retry": "Resolved retry: the next request runs it (a delivery is queued again).",
    "signed_out": "You are signed out.",
    "route_paused": "Route paused: nothing is delivered, and no probe goes out, until a resume.",
    "route_resumed": "Route resumed: its deliveries go out again.",
}


def _since(ms: object) -> str:
    if not isinstance(ms, int) or not ms:
        return ""
    return f" since {when(ms)} ({age(time.time() - ms / 1000)} ago)"


def refusal_for(exc: OperatorRefusal) -> Refusal:
    """A refused action, said to the operator who tried it."""
    extra = exc.extra
    if isinstance(exc, HeldByAnother):
        holder = extra.get("holder", "another operator")
        return Refusal(
            f"Not claimed: {holder} holds this key",
            f"{holder} holds it{_since(extra.get('holder_since_ms'))}. Nothing was changed. "
            f"Take it over only if {holder} is not working on it.",
        )
    if isinstance(exc, NotTheHolder):
        holder = extra.get("holder", "another operator")
        return Refusal(
            f"Not resolved: {holder} holds this key now",
            f"Only the operator who holds a key can resolve it, and {holder} does (they "
            "claimed it or took it over after this page was drawn). Nothing was changed.",
        )
    if isinstance(exc, InvalidTransition):
        state = str(extra.get("state", ""))
        said = _STATES.get(state, f"it is {state}")
        return Refusal(f"Not done: the key is {state}", f"Nothing was changed: {said}.")
    if isinstance(exc, UnknownKey):
        return Refusal(
            "No such key",
            f"Route {exc.route} has no record of key {exc.key}: it expired, was released "
            "and forgotten, or was never made.",
        )
    if isinstance(exc, InvalidText):
        return Refusal("Not done: the text cannot be kept", f"{exc.detail} Nothing was changed.")
    return Refusal(f"Refused: {exc.title}", exc.detail or exc.title)


def notice_for(name: str) -> str:
    return _NOTICES.get(name, "")
