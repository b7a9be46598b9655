"""Tokens and secrets the config reads from the environment or a file when it loads
(gateway.config.admin's operators and session secret), and their problems, in words
that never quote one."""

from __future__ import annotations

import os
import re

from gateway.config.text import show

#: What a Bearer token may hold (RFC 6750's b64token, and the rest of printable ASCII
#: but spaces): a token with a space or a control character cannot be sent.
_BEARER = re.compile(r"[\x21-\x7e]+")
#: The least a token or secret may be; `idempotency-gateway keygen` makes 44 characters.
MIN_TOKEN = 16
MIN_SECRET = 32
_MAKE_ONE = "make one with `idempotency-gateway keygen`"


def _is_a_value(given: str) -> bool:
    """Whether a name or path given is the value of an environment variable: written
    `${VAR}`, it is the secret itself, and a message must not repeat it."""
    return any(given == value for value in os.environ.values())


def read_secret(env: str, file: str) -> tuple[str, str]:
    """The secret in the variable `env` or the file `file`, and "" (or "" and what is
    wrong). A file's trailing newline is not part of it."""
    # Written `${VAR}`, what is given may be the secret itself: a message about a
    # name or path that does not work never repeats one that is a variable's value.
    secret = _is_a_value(env or file)
    hidden = "(not shown: it is an environment variable's value, as ${VAR} gives)"
    if env:
        value = os.environ.get(env)
        if value is not None:
            return value.strip(), ""
        if secret:
            return "", f"no variable has the name given {hidden}; write a name, e.g. ALICE_TOKEN"
        return "", f"the environment variable {env} is not set; export it"
    try:
        with open(file, encoding="utf-8") as f:
            return f.read().strip(), ""
    except FileNotFoundError:
        where = f"the path given {hidden}" if secret else show(file)
        return "", f"no file at {where}; give the path of a file holding the token"
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not text"
        return "", f"cannot read {f'the path given {hidden}' if secret else show(file)}: {reason}"


def secret_problem(value: str, least: int, what: str) -> str:
    """What is wrong with a token or secret, in words that never quote it."""
    if not value:
        return f"{what} is empty; {_MAKE_ONE}"
    if len(value) < least:
        return f"{what} is shorter than {least} characters; {_MAKE_ONE}"
    if not _BEARER.fullmatch(value):
        return f"{what} has a space or a control character, which a Bearer token cannot carry"
    return ""
