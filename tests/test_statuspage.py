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
