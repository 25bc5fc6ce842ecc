"""The dashboard in a real headless browser (Debian's chromium, driven by selenium): it loads,
shows the registered nodes and updates after a request."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from pdproxy.testing import MockEngine
from servers import chat_body, eventually, pdproxy_serve

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser():  # type: ignore[no-untyped-def]
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.fail(
            "the dashboard test needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(20)
    yield driver
    driver.quit()


#: `make screenshot` regenerates docs/dashboard.png through it.
SCREENSHOT_TO = os.environ.get("SCREENSHOT_TO")


async def test_dashboard_shows_nodes_and_updates(tmp_path: Path, browser, http: aiohttp.ClientSession) -> None:  # type: ignore[no-untyped-def]
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    async with (
        MockEngine(model="m") as a,
        MockEngine(model="m") as b,
        pdproxy_serve(
            tmp_path, "--node", f"{a.url},model=m", "--node", f"{b.url},model=m", "--admin-keys", "dash-key"
        ) as proxy,
    ):
        # The browser blocks, so it runs in a thread while this loop serves the mock engines.
        await asyncio.to_thread(browser.get, proxy.url + "/dashboard#key=dash-key")

        def rows() -> dict[str, int]:
            # The page rebuilds its table every second: a row read mid-rebuild is stale, read again.
            for _ in range(10):
                try:
                    return {
                        row.get_attribute("data-node"): int(row.find_element(By.CLASS_NAME, "requests").text)
                        for row in browser.find_elements(By.CSS_SELECTOR, "#nodes-table tbody tr")
                    }
                except StaleElementReferenceException:
                    continue
            return {}

        def shows(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
            """The page checked off the event loop (selenium blocks)."""
            return lambda: asyncio.to_thread(check)

        await eventually(shows(lambda: set(rows()) == {a.url, b.url}), "the page to show it", timeout=30)
        assert await asyncio.to_thread(lambda: browser.find_element(By.ID, "nodes").text) == "2"
        before = sum((await asyncio.to_thread(rows)).values())
        async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m")) as r:
            assert r.status == 200
        await eventually(shows(lambda: sum(rows().values()) == before + 1), "the page to show it", timeout=30)
        assert await asyncio.to_thread(lambda: browser.find_element(By.ID, "error").text) == ""

        def engine_cells() -> list[tuple[str, str]]:
            # What each engine's /metrics said, once pdproxy has read them ("-" before).
            for _ in range(10):
                try:
                    return [
                        (
                            row.find_element(By.CLASS_NAME, "engine-running").text,
                            row.find_element(By.CLASS_NAME, "engine-kv").text,
                        )
                        for row in browser.find_elements(By.CSS_SELECTOR, "#nodes-table tbody tr")
                    ]
                except StaleElementReferenceException:
                    continue
            return []

        await eventually(shows(lambda: engine_cells() == [("0", "0%"), ("0", "0%")]), "the page to show it", timeout=30)

        # The whole table fits a 1400 px window: no column hidden past a scroll bar.
        await asyncio.to_thread(browser.set_window_size, 1400, 700)
        inner, wide = await asyncio.to_thread(
            browser.execute_script,
            "return [window.innerWidth, document.documentElement.scrollWidth]",
        )
        assert wide <= inner, f"the page is {wide} px wide in a {inner} px window"
        if SCREENSHOT_TO:
            await asyncio.to_thread(browser.save_screenshot, SCREENSHOT_TO)
