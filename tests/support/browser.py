"""A real headless Chromium for the console's tests: Debian's, driven by Playwright.

`scripts/setup` installs `chromium` with apt-get; nothing here downloads a browser
(Playwright is pointed at /usr/bin/chromium, or at $CONSOLE_CHROMIUM). One browser per
test module; each `Tab` is a page in a browser context of its own (its own cookies,
as two people at two screens), which records every dialog the page opened (an
injected `alert()` would be one), every uncaught script error, and every console
error, CSP violations among them.

Playwright's sync API runs its own event loop for as long as the browser is up, so a
module that uses this fixture has no `async def` tests (their loop could not start).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from playwright.sync_api import (
    Browser,
    BrowserContext,
    ConsoleMessage,
    Dialog,
    Page,
    Response,
    sync_playwright,
)

CHROMIUM = os.environ.get("CONSOLE_CHROMIUM", "/usr/bin/chromium")
DESKTOP = {"width": 1280, "height": 800}
#: A phone's width (an iPhone 12/13/14's CSS pixels)
PHONE = {"width": 390, "height": 844}
#: How long a page may take to show what a test waits for (the live refresh is 3 s).
WAIT_MS = 15_000


@dataclass
class Tab:
    """A page in a context of its own, and what it saw."""

    context: BrowserContext
    page: Page
    dialogs: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def on_dialog(self, dialog: Dialog) -> None:
        self.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    def on_console(self, message: ConsoleMessage) -> None:
        # A page answered 4xx (a refusal is a page too) is logged as "Failed to load
        # resource"; what matters of those is on_response's: no part of a page failed.
        if message.type == "error" and not message.text.startswith("Failed to load resource"):
            self.errors.append(f"console: {message.text}")

    def on_response(self, response: Response) -> None:
        if response.status >= 400 and response.request.resource_type != "document":
            self.errors.append(f"{response.status} for {response.url}")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not os.access(CHROMIUM, os.X_OK):
        raise RuntimeError(f"no Chromium at {CHROMIUM}: run scripts/setup, which installs it")
    with sync_playwright() as playwright:
        # --no-sandbox: the tests run as root in CI, where Chromium's sandbox refuses to.
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        yield launched
        launched.close()


@pytest.fixture
def tabs(browser: Browser) -> Iterator[Callable[..., Tab]]:
    """`tabs(viewport=DESKTOP)`: a new Tab; every one is closed after the test."""
    opened: list[Tab] = []

    def open_tab(viewport: dict[str, int] | None = None) -> Tab:
        context = browser.new_context(viewport=viewport or DESKTOP)  # type: ignore[arg-type]
        context.set_default_timeout(WAIT_MS)
        tab = Tab(context, context.new_page())
        tab.page.on("dialog", tab.on_dialog)
        tab.page.on("pageerror", lambda error: tab.errors.append(f"pageerror: {error}"))
        tab.page.on("console", tab.on_console)
        tab.page.on("response", tab.on_response)
        opened.append(tab)
        return tab

    yield open_tab
    for tab in opened:
        tab.context.close()
