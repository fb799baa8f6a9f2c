"""The playground page at `/` of a real `ragkv serve` (default model, with an API key), driven in headless Chromium
(Debian's `chromium` and `chromium-driver`, installed by scripts/setup.sh) through selenium.

The screenshot goes to the test's tmp folder; to refresh the one in the README, run
`RAGKV_PLAYGROUND_SCREENSHOT=docs/playground.png .venv/bin/python -m pytest -q tests/test_playground.py`
(that run shows all five modes)."""

import http.client
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

from ragkv.bench.serve import ServerProcess
from ragkv.serve.playground import STATIC_DIR
from tiny import default_model_available

KEY = "playground-key-0001"
DOCS = [("Lintwick Tower", "Lintwick Tower was built in 1893 from red sandstone by Ada Morrow."),
        ("Alpaca Farm", "The Alpaca Farm in Lintwick keeps forty-two alpacas named after rivers.")]
QUESTION = "Who built Lintwick Tower?"
SCREENSHOT = os.environ.get("RAGKV_PLAYGROUND_SCREENSHOT")
MODES = ("full", "prefix", "reuse", "ape", "blend") if SCREENSHOT else ("full", "reuse")
MAX_TOKENS = 16 if SCREENSHOT else 8  # whole short answers for the picture; fewer tokens for a fast test
MS = re.compile(r"^\d+ ms$")

needs_model = pytest.mark.skipif(not default_model_available(), reason="default model not converted")


def test_static_files_fetch_nothing_from_elsewhere():
    """No CDN: every URL in the page's files is one of the server's own paths (the SVG namespace aside)."""
    files = sorted(STATIC_DIR.iterdir())
    assert {f.name for f in files} >= {"index.html", "playground.js", "playground.css", "examples.json"}
    for f in files:
        urls = set(re.findall(r"(?:https?:)?//[\w.-]+\.\w+[^\s\"')]*", f.read_text()))
        assert urls <= {"http://www.w3.org/2000/svg"}, (f.name, urls)
    html = (STATIC_DIR / "index.html").read_text()
    assert set(re.findall(r'(?:src|href)="([^"]+)"', html)) == {"/static/playground.js", "/static/playground.css"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(dtype="float32", device="cpu", store="memory:256MiB", startup_s=180,
                       cache_dir=tmp_path_factory.mktemp("playground"),
                       extra=("--api-key", f"{KEY}:playground", "--timeout", "300")) as s:
        yield s


def raw_get(server, path: str) -> int:
    """A GET sent as written (httpx would fold `..` away before sending)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.mark.model
@needs_model
def test_page_and_its_files_load_without_a_key_the_api_needs_one(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/static/playground.js" in page.text
    for name, kind in (("playground.js", "javascript"), ("playground.css", "text/css"),
                       ("examples.json", "application/json")):
        r = httpx.get(f"{server.url}/static/{name}")
        assert r.status_code == 200 and kind in r.headers["content-type"], (name, r.headers)
    assert httpx.get(server.url + "/static/missing.js").status_code == 404
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    # the open prefix does not open the API, nor files outside the static folder
    for path in ("/static/../v1/models", "/static/%2e%2e/v1/models", "/static/..%2f..%2fapp.py",
                 "/static/../../serve/app.py"):
        assert raw_get(server, path) in (400, 404), path


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e .[test])")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        pytest.skip("Debian's chromium and chromium-driver are not installed (bash scripts/install_chromium.sh)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    yield driver
    driver.quit()


def run_and_wait(driver, timeout_s: float = 600) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.find_element(By.ID, "run").click()
    WebDriverWait(driver, timeout_s, poll_frequency=0.2).until(
        lambda d: d.find_element(By.ID, "status").get_attribute("data-state") == "done")


def figures(driver, mode: str) -> dict:
    from selenium.webdriver.common.by import By

    column = driver.find_element(By.CSS_SELECTOR, f'.column[data-mode="{mode}"]')
    out = {dd.get_attribute("data-figure"): dd.text for dd in column.find_elements(By.CSS_SELECTOR, "dd")}
    out.update(state=column.get_attribute("data-state"), answer=column.find_element(By.CLASS_NAME, "answer").text,
               error=column.find_element(By.CLASS_NAME, "error").get_attribute("textContent"))
    return out


@pytest.mark.model
@needs_model
def test_two_modes_side_by_side_in_headless_chromium(server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    d = browser
    d.get(server.url + "/")
    wait = WebDriverWait(d, 60)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#documents .document"))  # the examples loaded
    wait.until(lambda d: "smollm2" in d.find_element(By.ID, "server-info").text)

    # the user's own documents and question, in place of the examples
    d.find_element(By.ID, "clear-documents").click()
    for title, text in DOCS:
        d.find_element(By.ID, "add-document").click()
        doc = d.find_elements(By.CSS_SELECTOR, "#documents .document")[-1]
        doc.find_element(By.CLASS_NAME, "doc-title").send_keys(title)
        doc.find_element(By.CLASS_NAME, "doc-text").send_keys(text)
    question = d.find_element(By.ID, "question")
    question.clear()
    question.send_keys(QUESTION)
    for box in d.find_elements(By.CSS_SELECTOR, "#modes input"):
        if box.is_selected() != (box.get_attribute("value") in MODES):
            box.click()
    tokens = d.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys(str(MAX_TOKENS))

    # without the key: each mode says so, readably
    run_and_wait(d, 60)
    for mode in MODES:
        f = figures(d, mode)
        assert f["state"] == "error" and "401" in f["error"] and "API key" in f["error"], f

    d.find_element(By.ID, "api-key").send_keys(KEY)
    run_and_wait(d)  # the first run computes the documents' blocks
    first = {mode: figures(d, mode) for mode in MODES}
    run_and_wait(d)  # the second finds them in the cache
    second = {mode: figures(d, mode) for mode in MODES}

    for run in (first, second):
        for mode, f in run.items():
            assert f["state"] == "done" and not f["error"], (mode, f)
            assert f["answer"].strip(), (mode, f)
            assert MS.match(f["ttft-client"]) and MS.match(f["ttft-server"]), (mode, f)
            assert int(f["recomputed"]) > 0, (mode, f)  # at least the question
    assert int(first["full"]["reused"]) == 0 and int(second["full"]["reused"]) == 0
    assert int(second["reuse"]["reused"]) > 0
    hits, misses = map(int, second["reuse"]["blocks"].split(" / "))
    assert hits >= len(DOCS) and misses == 0
    assert int(second["reuse"]["recomputed"]) < int(second["full"]["recomputed"])
    assert second["reuse"]["same"] in ("yes", "no") and second["full"]["same"] == "yes"

    # the time split: one bar per mode, each at least its decode and prefill parts
    labels = [t.text for t in d.find_elements(By.CSS_SELECTOR, "#chart svg text.bar-label")]
    assert labels == list(MODES)
    assert len(d.find_elements(By.CSS_SELECTOR, "#chart svg rect title")) >= 2 * len(MODES)

    # the whole page in one picture: a viewport as tall as the page (headless windows stop at the screen's size)
    height = d.execute_script("return document.documentElement.scrollHeight")
    d.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                      {"width": 1400, "height": height, "deviceScaleFactor": 1, "mobile": False})
    shot = Path(SCREENSHOT) if SCREENSHOT else tmp_path / "playground.png"
    assert d.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


def send_and_wait(driver, text: str, timeout_s: float = 300) -> dict:
    """Send one chat message; the reply's transcript entry once its figures are there."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    box = driver.find_element(By.ID, "chat-input")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "chat-send").click()
    WebDriverWait(driver, timeout_s, poll_frequency=0.2).until(
        lambda d: d.find_element(By.ID, "chat-status").get_attribute("data-state") == "done"
        and not d.find_element(By.ID, "chat-send").get_attribute("disabled"))
    status = driver.find_element(By.ID, "chat-status").text
    assert not status, status
    last = driver.find_elements(By.CSS_SELECTOR, "#transcript .message")[-1]
    return {"role": last.get_attribute("data-role"), "exact": last.get_attribute("data-exact"),
            "fused": last.get_attribute("data-fused"),
            "figures": last.find_element(By.CLASS_NAME, "turn-figures").text}


@pytest.mark.model
@needs_model
def test_a_multi_turn_chat_shows_per_turn_reuse_and_an_edit_in_headless_chromium(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    d = browser
    d.get(server.url + "/")
    WebDriverWait(d, 60).until(lambda d: "smollm2" in d.find_element(By.ID, "server-info").text)
    key = d.find_element(By.ID, "api-key")
    key.clear()
    key.send_keys(KEY)
    tokens = d.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys("6")
    first = send_and_wait(d, "My cat is called Tom. " * 12)
    assert first["role"] == "assistant" and "mode prefix" in first["figures"] and first["exact"] == "true"
    second = send_and_wait(d, "I live in Lisbon by the river. " * 30)
    assert "of 2 earlier turns exact" in second["figures"] and second["exact"] == "true", second
    assert "from the cache" in second["figures"]
    third = send_and_wait(d, "What is my cat called?")
    assert "4 of 4 earlier turns exact" in third["figures"], third
    # drop the first exchange: the history no longer starts as before, and the turns after it (encoded as blocks
    # while the server was idle) are fused by the server's history mode
    deadline = time.monotonic() + 120
    while httpx.get(server.url + "/health").json()["background_jobs"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    for _ in range(2):
        d.find_elements(By.CSS_SELECTOR, "#transcript .message .remove")[0].click()
    assert len(d.find_elements(By.CSS_SELECTOR, "#transcript .message")) == 4
    after = send_and_wait(d, "And where do I live?")
    # the last answer, new to the store, is computed with the question: 1 exact, the 3 stored turns fused
    assert "1 of 4 earlier turns exact, 3 fused by blend" in after["figures"], after
    assert after["fused"] == "3" and after["exact"] == "false" and "approximate" in after["figures"]
