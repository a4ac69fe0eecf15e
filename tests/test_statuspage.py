"""The status page in a real browser (headless Chromium through selenium), on the real
stack with the bundled model: the workers table shows the live worker, a playground
completion streams into the page, and the worker's state changes after
`python -m dispatcher drain`. Skipped, with the reason, where Chromium, its driver or
selenium is missing (`.ci/run` installs them). The page's screenshot is written to
$COMPLETIONS_SCREENSHOT (docs/images/status-page.png is one such)."""
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT, ServerProcess

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
try:
    import selenium  # noqa: F401
    SELENIUM = True
except ImportError:
    SELENIUM = False


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and DRIVER and SELENIUM):
        pytest.skip("needs Chromium, chromedriver and selenium (apt-get install chromium "
                    "chromium-driver; pip install selenium): .ci/run installs them")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--window-size=1400,900"):
        options.add_argument(argument)
    options.binary_location = CHROMIUM
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server():
    server = ServerProcess("--api-key", "sk-page", "--slots", "2", "--nctx", "1024",
                           log_name="statuspage").start()
    yield server
    assert server.stop() == 0


def wait(driver, condition, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition(driver)
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; the page: "
                         f"{driver.find_element('tag name', 'body').text[:2000]}")


def worker_cells(driver) -> dict | None:
    """The workers table's one row, cell by class, read in one script: the page redraws
    the table at every status read, so an element found now may be gone a moment later."""
    return driver.execute_script("""
        const rows = document.querySelectorAll('#workers tbody tr');
        if (rows.length !== 1) return null;
        const cells = {};
        for (const cell of rows[0].querySelectorAll('td, span')) {
            for (const name of cell.classList) cells[name] = cell.textContent.trim();
        }
        return cells;""")


def test_the_page_shows_the_worker_runs_a_completion_and_sees_a_drain(browser, server):
    from selenium.webdriver.common.by import By
    browser.get(server.url + "/")
    cells = wait(browser, worker_cells, "the workers table")
    name = cells["name"]
    assert name.startswith("w0") and cells["state"] in ("idle", "busy"), cells
    assert cells["slots"].endswith("/ 2"), cells

    # the playground: a greedy completion streamed into the page, its figures shown
    browser.find_element(By.ID, "key").send_keys("sk-page")
    prefix = browser.find_element(By.ID, "prefix")
    prefix.clear()
    prefix.send_keys("def add(a, b):\n    return")
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("12")
    browser.find_element(By.ID, "complete").click()
    figures = wait(browser, lambda d: d.find_element(By.ID, "figures").text
                   or d.find_element(By.ID, "error").text, "the completion's figures")
    assert browser.find_element(By.ID, "error").text == ""
    assert figures.startswith("TTFT") and "tokens/s" in figures, figures
    middle = browser.find_element(By.ID, "middle").text
    assert middle.strip(), "no text streamed into the page"
    raw = browser.execute_script("return document.getElementById('raw-events').textContent")
    assert raw.count("data: ") >= 2 and '"stop": true' in raw.replace('"stop":true',
                                                                        '"stop": true')
    # the page's figures follow the traffic (tokens/s over the last minute)
    wait(browser, lambda d: (c := worker_cells(d)) and c["tokens"] not in ("–", "0.0"),
         "the worker's tokens/s")
    shot = os.environ.get("COMPLETIONS_SCREENSHOT")
    if shot:
        browser.save_screenshot(shot)

    # an error from the server is shown as its message
    browser.find_element(By.ID, "temperature").clear()
    browser.find_element(By.ID, "temperature").send_keys("9")
    browser.find_element(By.ID, "complete").click()
    error = wait(browser, lambda d: d.find_element(By.ID, "error").text, "the error")
    assert "temperature" in error

    # drained by the ops tool: the page shows it
    done = subprocess.run([sys.executable, "-m", "dispatcher", "drain", name,
                           "--dispatcher", server.dispatcher], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    wait(browser, lambda d: (c := worker_cells(d)) and c["state"] in ("drained", "draining"),
         "the worker's state to change after the drain")
    table = browser.execute_script("return document.getElementById('workers').textContent")
    page = browser.execute_script("return document.body.textContent")
    assert "sk-page" not in page and "def add" not in table   # no key; no content there


def test_the_page_sends_a_key_once_it_is_applied_and_stops_reading_when_refused(browser):
    """With `--status-access key` the status reads need a key. A read refused stops the
    reads until the key changes (an idle tab sent one a second and a half, each logged);
    the reads send the key field's value once it is applied (Enter), never a key half
    typed (each read sent the key typed so far, and each refusal logged its
    fingerprint: the key's prefixes). A read in flight when the key changes reads again
    with the new one (a read refused for the old key stopped the reads)."""
    import re

    from app.access import key_fingerprint

    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    server = ServerProcess("--api-key", "sk-page", "--status-access", "key", "--slots", "1",
                           "--nctx", "512", log_name="statuskey").start()
    try:
        def refusals() -> list[str]:
            return re.findall(r"route=/v1/status status=401 .*? key=(\S+)",
                              server.log_path.read_text())
        browser.get(server.url + "/")
        wait(browser, lambda d: "needs a key" in d.find_element(By.ID, "summary").text,
             "the page to say the status needs a key")
        time.sleep(4.0)                            # (reads every 1.5 s before)
        assert refusals() == ["-"]
        field = browser.find_element(By.ID, "key")
        field.send_keys("sk-pa")                   # typed, not applied
        time.sleep(3.5)
        assert refusals() == ["-"]
        field.send_keys("wrong" + Keys.ENTER)      # applied: one read, refused
        wait(browser, lambda d: len(refusals()) == 2, "the applied key's read", 20)
        assert refusals() == ["-", key_fingerprint("Bearer sk-pawrong")]
        field.clear()
        field.send_keys("sk-page" + Keys.ENTER)
        cells = wait(browser, worker_cells, "the workers table with the key")
        assert cells["name"].startswith("w0")
        assert key_fingerprint("Bearer sk-pa") not in server.log_path.read_text()
    finally:
        assert server.stop() == 0


def test_the_pages_latency_after_a_restart_between_two_reads_is_the_newer_reads(tmp_path):
    """The page's TTFT quantile is the difference of two reads' histograms; after the
    dispatcher restarted between them (its histogram begun again) the differences went
    negative and the quantile was wrong or empty: then the newer read alone counts.
    (status.js's own function, run by node with a stand-in document.)"""
    from test_clients import ensure_node
    script = tmp_path / "quantile.js"
    script.write_text("""
const vm = require("vm");
const fs = require("fs");
const element = { addEventListener() {}, value: "", textContent: "" };
const context = { document: { getElementById: () => element },
                  fetch: () => new Promise(() => {}), setTimeout: () => 0, console };
vm.createContext(context);
vm.runInContext(fs.readFileSync(process.argv[2], "utf8"), context);
const buckets = [0.1, 0.2, 0.4, Infinity];
const older = { buckets, counts: [50, 40, 10, 0] };        // each bucket's count
const newer = { buckets, counts: [0, 10, 0, 0] };          // begun again: 10 in 0.1-0.2
const plain = { buckets, counts: [60, 40, 10, 0] };        // 10 more, all under 0.1
console.log(JSON.stringify([context.quantile(older, newer, 0.5),
                            context.quantile(older, plain, 0.5)]));
""")
    out = subprocess.run([ensure_node(), str(script), str(ROOT / "app" / "static" / "status.js")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    after_restart, plain = __import__("json").loads(out.stdout)
    assert after_restart is not None and 0.1 <= after_restart <= 0.2
    assert plain is not None and 0 < plain <= 0.1
