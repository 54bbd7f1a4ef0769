"""Headless Chromium for the tests that look at a page: the attention viewer, the docs site.

Debian's `chromium` driven through `chromedriver` with Selenium; a test that needs it is marked
slow and skipped only where no Chromium (or no chromedriver) is installed. The `browser` fixture
(conftest.py) is one session per test module.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile

import pytest


def _find_chromium() -> tuple[str, str] | None:
    browser = next(
        (
            shutil.which(n)
            for n in ("chromium", "chromium-browser", "google-chrome")
            if shutil.which(n)
        ),
        None,
    )
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


CHROMIUM = _find_chromium()


def needs_chromium(test):
    """A browser test: slow, and skipped where Chromium is not installed."""
    return pytest.mark.slow(
        pytest.mark.skipif(CHROMIUM is None, reason="Chromium/chromedriver not installed")(test)
    )


@contextlib.contextmanager
def chromium():
    """A headless Chromium session, closed (and its profile removed) on leaving."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = CHROMIUM
    profile = tempfile.mkdtemp(prefix="llmcli-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(driver_path))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def open_page(browser, path) -> None:
    browser.get(path.resolve().as_uri())
    browser.get_log("browser")  # drain: the caller reads only this page's messages


def severe_messages(browser) -> list[dict]:
    return [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
