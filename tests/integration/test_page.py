"""The page at ``/`` in real headless Chromium (Debian's ``chromium`` and ``chromedriver``, via selenium).

It draws one ribbon cell per step (per rank in mixed mode) of the API's first
page, its bucket table is the API's, it follows the ranks while trainers run,
it switches from the preview to the first job, and the console stays clean.
A screenshot is kept in the test's tmp_path.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ladle.client import BatchClient
from ladle.service.report import bucket_cells
from ladle.service.schedule.stats import BucketRow

from .conftest import ServerProcess

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1300,1400",
]


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    """Headless Chromium with a fresh profile, quit at the end whatever happens."""
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("chromium and chromedriver are not installed (make unit installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    try:
        driver.set_page_load_timeout(60)
        yield driver
    finally:
        driver.quit()


def api(server: ServerProcess, path: str) -> Any:
    with urllib.request.urlopen(server.http_url + path, timeout=30) as response:
        return json.loads(response.read())


def wait_until(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def cells(driver: Any, ribbon: str) -> int:
    return len(driver.find_elements("css selector", f"#{ribbon} rect.cell"))


def text(driver: Any, selector: str) -> str:
    return str(driver.find_element("css selector", selector).text)


def take(client: BatchClient, n: int) -> None:
    it = iter(client)
    for _ in range(n):
        next(it)
    client.state_dict()  # the held batch counts as consumed


def test_the_page_in_chromium(
    browser: Any, server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    server = server_factory()
    # no job yet: a preview of the schedule for 8 ranks, which switches to the first job that appears
    browser.get(server.http_url + "/")
    assert browser.find_element("css selector", "#preview").is_displayed()
    steps = int(browser.find_element("css selector", "#ribbon-ladle").get_attribute("data-steps"))
    assert cells(browser, "ribbon-ladle") == steps * 8, "the preview is not one row per rank"

    job, world = "page-run", 2
    clients = [BatchClient(r, world, server.address, job, timeout=30) for r in range(world)]
    try:
        take(clients[0], 12)
        take(clients[1], 5)
        wait_until(lambda: browser.title == f"ladle: {job}", "the preview to switch to the job")
        wait_until(lambda: text(browser, "#rank-1 .pos") == "0:5", "the ranks' positions")

        first = api(server, f"/v1/jobs/{job}/schedule")
        page_steps = {b["step"] for b in first["batches"]}
        assert int(browser.find_element("css selector", "#ribbon-ladle").get_attribute("data-steps")) == len(
            page_steps
        )
        assert cells(browser, "ribbon-ladle") == len(page_steps) * world, "not one cell per step and rank"
        assert cells(browser, "ribbon-random") == len(page_steps) * world
        colours = [
            e.get_attribute("class") for e in browser.find_elements("css selector", "#ribbon-ladle rect.cell")
        ]
        assert colours == [f"cell b{b['bucket']}" for b in first["batches"]], "cells not coloured by bucket"

        buckets = api(server, f"/v1/jobs/{job}/buckets")["buckets"]
        rows = browser.find_elements("css selector", "#bucket-table tbody tr")
        shown = [[td.text for td in row.find_elements("css selector", "td")] for row in rows]
        assert shown == [bucket_cells(BucketRow(**b)) for b in buckets], (
            "the bucket table differs from /buckets"
        )

        assert text(browser, "#rank-0 .pos") == "0:12"
        assert text(browser, "#rank-1 .lag") == "7"
        # refreshed while the job runs (the page polls /cursor, no reload)
        take(clients[1], 4)
        wait_until(lambda: text(browser, "#rank-1 .pos") == "0:9", "the page to follow rank 1")
        assert text(browser, "#rank-1 .lag") == "3"
        marker = browser.find_element("css selector", '#ribbon-ladle .marker[data-rank="1"]')
        assert marker.get_attribute("visibility") == "visible"

        shot = tmp_path / "page.png"
        assert browser.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        for client in clients:
            client.close()
    errors = [entry for entry in browser.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]
    assert not errors, f"the browser console shows errors: {errors}"


def test_the_page_opened_with_the_token_in_its_url_keeps_refreshing(
    browser: Any, server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """http://ladle:TOKEN@host/ (a kiosk, a dashboard): its refreshes fetch no URL with credentials."""
    token = "page-token-" + "K3y9Lm2Qx7Vb5Nw8"
    (tmp_path / "tokens").write_text(token + "\n")
    server = server_factory(["--token-file", str(tmp_path / "tokens")])
    job = "page-auth"
    client = BatchClient(0, 1, server.address, job, timeout=30, token=token)
    try:
        take(client, 3)
        browser.get(f"http://ladle:{token}@127.0.0.1:{server.http_port}/?job={job}")
        assert browser.title == f"ladle: {job}", "the page did not open with the token in its URL"
        wait_until(lambda: text(browser, "#rank-0 .pos") == "0:3", "the rank's position")
        take(client, 4)
        wait_until(lambda: text(browser, "#rank-0 .pos") == "0:7", "the page to refresh the rank's position")
        assert text(browser, "#status").startswith("updated"), text(browser, "#status")
    finally:
        client.close()
    errors = [entry for entry in browser.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]
    assert not errors, f"the browser console shows errors: {errors}"
