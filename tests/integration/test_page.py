"""The page at ``/`` in real headless Chromium (Debian's ``chromium`` and ``chromedriver``, via selenium).

It draws one ribbon cell per step (per rank in mixed mode) of the API's first
page, its bucket table is the API's, it follows the ranks while trainers run
and the leader into the next window of steps, it switches from the preview
to the first job, a job of 1,000 ranks stays small and quick (its figures
printed), and the console stays clean. A screenshot is kept in the test's tmp_path.
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
from ladle.service.http.page import RIBBON_RANKS, TABLE_RANKS
from ladle.service.report import bucket_cells
from ladle.service.schedule.stats import BucketRow
from ladle.service.store import EmbeddedStore, JobSpec, Position
from ladle.service.synth import make_dataset
from tests.contract.store_contract import ManualClock

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
    """The element's text, read again if a refresh replaced it meanwhile (the rank table is redrawn)."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(5):
        try:
            return str(driver.find_element("css selector", selector).text)
        except StaleElementReferenceException:
            continue
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


@pytest.fixture(scope="module")
def wide_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200,000 rows: 200 steps an epoch for 1,000 ranks of one row a batch, a full window of the page."""
    out = tmp_path_factory.mktemp("page-ds") / "ds"
    make_dataset(out, 200_000, seed=3, scale=1 / 16)
    return out


def ribbon_start(driver: Any) -> int:
    """The first step the ribbon shows (-1 while a page loads)."""
    ribbon = "var r = document.getElementById('ribbon-ladle'); return r && r.dataset.start"
    start = driver.execute_script(ribbon)
    return int(start) if start is not None else -1


def test_the_page_follows_the_leader_into_the_next_window_unless_told_where(
    browser: Any, server_factory: Callable[..., ServerProcess], wide_dataset: Path
) -> None:
    server = server_factory(dataset=wide_dataset)
    job = "page-follow"
    client = BatchClient(0, 1, server.address, job, timeout=30)
    try:
        take(client, 5)
        browser.get(f"{server.http_url}/?job={job}")
        assert ribbon_start(browser) == 0
        window = int(browser.find_element("css selector", "#ribbon-ladle").get_attribute("data-steps"))
        assert api(server, f"/v1/jobs/{job}")["steps_per_epoch"] > window + 10, "the epoch is one window"
        take(client, window + 5)  # the leader leaves the first window
        wait_until(lambda: ribbon_start(browser) == window, "the page to move to the leader's window")
        assert text(browser, "h2").startswith(f"Epoch 0: steps {window}"), text(browser, "h2")
        wait_until(lambda: text(browser, "#rank-0 .pos") == f"0:{window + 10}", "the rank's position")
        marker = browser.find_element("css selector", '#ribbon-ladle .marker[data-rank="0"]')
        assert marker.get_attribute("visibility") == "visible", "the leader's outline is not in view"
        assert "start=" not in browser.current_url, "the page stopped following after moving"

        # a window the user asked for stays while the job runs
        browser.get(f"{server.http_url}/?job={job}&start=0")
        assert browser.find_elements("css selector", "#follow"), "no link back to following"
        take(client, 3)
        wait_until(lambda: text(browser, "#rank-0 .pos") == f"0:{window + 13}", "the rank's position")
        assert ribbon_start(browser) == 0, "a page opened at start=0 moved by itself"
        browser.find_element("css selector", "#follow").click()
        wait_until(lambda: ribbon_start(browser) == window, "the follow link to open the leader's window")
    finally:
        client.close()
    errors = [entry for entry in browser.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]
    assert not errors, f"the browser console shows errors: {errors}"


def stored_job(
    server: ServerProcess, job: str, world: int, step: Callable[[int], int], clock: ManualClock
) -> EmbeddedStore:
    """A job of ``world`` ranks written into the server's own store file, every rank joined at ``step(rank)``.

    The store's clock is ``clock``, so a test can make a rank last seen long ago.
    """
    listing = api(server, "/v1/jobs")
    store = EmbeddedStore(server.state, clock=clock)
    store.open_job(JobSpec(job, listing["dataset"]["fingerprint"], listing["config_fingerprint"], world))
    for rank in range(world):
        joined = store.join(job, rank, world)
        store.advance(job, rank, joined.generation, Position(0, step(rank)))
    return store


def page_figures(browser: Any, server: ServerProcess, job: str) -> str:
    """Opens the job's page; what it weighs and how long it took: bytes, elements, load, one refresh."""
    with urllib.request.urlopen(f"{server.http_url}/?job={job}", timeout=60) as response:
        size = len(response.read())
    browser.get(f"{server.http_url}/?job={job}")
    load_ms = browser.execute_script(
        "var n = performance.getEntriesByType('navigation')[0]; return n.loadEventEnd - n.startTime;"
    )
    refreshed = "return window.ladleUpdateMs !== undefined;"
    wait_until(lambda: browser.execute_script(refreshed), "the first refresh")  # as the page opens
    browser.execute_script("window.ladleUpdateMs = undefined;")
    wait_until(lambda: browser.execute_script(refreshed), "a refresh")  # the next one, 2 s later
    update_ms = browser.execute_script("return window.ladleUpdateMs;")
    elements = browser.execute_script("return document.getElementsByTagName('*').length;")
    assert size < 1_000_000, f"the page of {job} is {size:,} bytes"
    return (
        f"{size:,} bytes, {elements:,} elements, load {load_ms:.0f} ms in Chromium, "
        f"a refresh of /cursor drawn in {update_ms:.1f} ms"
    )


def test_the_page_of_a_thousand_ranks_stays_small_and_quick(
    browser: Any, server_factory: Callable[..., ServerProcess], wide_dataset: Path
) -> None:
    """Figures printed beside an 8-rank job's (pytest -s): bytes, elements, load time, one refresh."""
    server = server_factory(["--max-batch-size", "1"], dataset=wide_dataset)
    job, world = "page-wide", 1000
    clock = ManualClock(time.time())
    stored_job(server, "page-narrow", 8, lambda rank: 6, clock).close()
    store = stored_job(server, job, world, lambda rank: 3 if rank == 700 else 6, clock)
    try:
        clock.now -= 1000  # rank 700 was last seen 1000 s ago
        joined = store.join(job, 700, world)
        store.advance(job, 700, joined.generation, Position(0, 4))

        narrow = page_figures(browser, server, "page-narrow")
        wide = page_figures(browser, server, job)
        print(f"\npage of {world} ranks: {wide}\npage of 8 ranks: {narrow}")
        rows = browser.find_elements("css selector", "#ribbon-ladle text")
        assert len(rows) == RIBBON_RANKS, f"the ribbon draws {len(rows)} rank rows of {world}"
        steps = int(browser.find_element("css selector", "#ribbon-ladle").get_attribute("data-steps"))
        assert cells(browser, "ribbon-ladle") == RIBBON_RANKS * steps
        listed = browser.execute_script(
            "return Array.from(document.querySelectorAll('#rank-table tbody tr'), function (r) {"
            " return r.id })"
        )
        assert len(listed) == TABLE_RANKS
        assert listed[0] == "rank-700", f"the stalled rank is not listed first: {listed[:3]}"
        assert text(browser, "#rank-700 .lag") == "2"
        assert "of 1000 ranks to look at first" in text(browser, "#rank-note")

        # the next refresh re-sorts: rank 700 caught up and was seen now, rank 5 stalls behind
        clock.now += 1000
        joined = store.join(job, 700, world)
        store.advance(job, 700, joined.generation, Position(0, 6))
        clock.now -= 500
        joined = store.join(job, 5, world)
        store.rewind(job, 5, joined.generation, Position(0, 1))
        first = "#rank-table tbody tr:first-child td"
        wait_until(lambda: text(browser, first) == "5", "the table to re-sort")
        assert text(browser, "#rank-5 .lag") == "5"
    finally:
        store.close()
    errors = [entry for entry in browser.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]
    assert not errors, f"the browser console shows errors: {errors}"
