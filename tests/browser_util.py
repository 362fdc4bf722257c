"""Headless Chromium for the browser tests (Debian's chromium + chromedriver, `make
browser-deps`), driven by selenium with nothing downloaded."""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def start_chromium(*, performance_log: bool = False):  # noqa: ANN201 - a selenium WebDriver
    """A headless Chromium session with the browser console log (and, on request, the
    performance log, which lists every network request) captured.

    Fails the test (never skips it) when Chromium or chromedriver is missing.
    """
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.fail("headless Chromium is missing: run `make browser-deps` (apt-get install "
                    "chromium chromium-driver)")
    os.environ["SE_OFFLINE"] = "true"  # selenium-manager must never download anything
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1300,950", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", "--disable-default-apps"):
        options.add_argument(arg)
    logs = {"browser": "ALL", **({"performance": "ALL"} if performance_log else {})}
    options.set_capability("goog:loggingPrefs", logs)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
