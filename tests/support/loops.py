"""Tests of code that talks to transports directly run on both event loops: the
gateway runs on uvloop, whose transports differ from asyncio's. A module opts in with

    from tests.support.loops import anyio_backend  # noqa: F401
"""

from __future__ import annotations

import pytest


@pytest.fixture(params=[pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"), "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> object:
    return request.param
