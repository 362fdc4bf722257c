"""``handformer serve`` in a real browser: headless Chromium (the Debian packages the viewer's
browser test uses, see tests/test_viewer_browser.py) against the real server in a subprocess.

A user types a sentence and submits it, the heat map redraws for the new tokens, a click on a
head changes the similarity shown (checked against a direct Python call), hostile text stays
text, the console stays clean, and every request the page makes goes to the server itself
(Chrome's performance log lists them all).
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from handformer.pretrained import embed, load_bert
from handformer.serve.wire import read_binary
from serve_util import Server, causal_folder, cosine, zero_heads
from test_viewer_browser import canvas_hash, severe, wait_for

pytestmark = pytest.mark.browser

TEXT = "A quick brown fox jumps over the lazy dog"
PAIR = "A fast fox leaps over a sleepy hound"


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


def requested_urls(driver) -> list[str]:
    """Every URL the page asked for since the last call (Chrome's performance log)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def open_app(driver, url):
    driver.get_log("browser")
    driver.get_log("performance")
    driver.get(url + "/")
    wait_for(driver, "return document.body.dataset.svRuns || null", "1", timeout=60)


def submit(driver, text, pair=None):
    from selenium.webdriver.common.by import By

    runs = int(driver.execute_script("return document.body.dataset.svRuns"))
    box = driver.find_element(By.ID, "sv-text")
    box.clear()
    box.send_keys(text)
    if pair is not None:
        other = driver.find_element(By.ID, "sv-pair")
        other.clear()
        other.send_keys(pair)
    driver.find_element(By.ID, "sv-run").click()
    wait_for(driver, "return document.body.dataset.svRuns", str(runs + 1), timeout=60)


def shown_tokens(driver):
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('#tokens .tok')).map(e => e.textContent)")


def test_type_submit_ablate_restore(driver, server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    model, tokenizer = load_bert()
    open_app(driver, server.url)
    assert driver.execute_script("return document.body.dataset.ready") == "1"
    first = shown_tokens(driver)
    assert first == tokenizer.encode_batch(["The animal didn't cross the street because it was "
                                      "too tired"])[0].tokens
    before = canvas_hash(driver, "heat")

    submit(driver, TEXT, PAIR)
    assert shown_tokens(driver) == tokenizer.encode_batch([TEXT])[0].tokens
    assert canvas_hash(driver, "heat") != before  # redrawn for the new tokens
    e = embed([TEXT, PAIR], model=model, tokenizer=tokenizer)
    shown = driver.find_element(By.ID, "sv-similarity").text
    assert float(shown) == pytest.approx(cosine(e[0], e[1]), abs=1e-4)
    assert "all-MiniLM-L6-v2" in driver.find_element(By.ID, "sv-status").text
    # the viewer drew the codes of the binary answer, handed over as a Uint8Array
    drawn = driver.execute_script(
        "const d = window.hfViewer.data.data; if (!(d instanceof Uint8Array)) return null;"
        "let s = 0; for (let i = 0; i < d.length; i++) s += d[i]; return [d.length, s];")
    with httpx.Client(base_url=server.url, timeout=120) as c:
        sent = read_binary(c.post("/api/run?weights=binary",
                                  json={"text": TEXT, "text_pair": PAIR}).content)
    codes = sent["viewer"]["data"]
    assert drawn == [codes.size, int(codes.sum(dtype=np.int64))]

    # click a head: ablated, the similarity shown changes to the ablated model's
    driver.find_element(By.CSS_SELECTOR, '#sv-grid button[data-l="0"][data-h="3"]').click()
    wait_for(driver, "return document.body.dataset.svAblations", "1", timeout=60)
    cut = embed([TEXT, PAIR], model=zero_heads(model, [(0, 3)]), tokenizer=tokenizer)
    text = driver.find_element(By.ID, "sv-similarity").text
    assert text.endswith("(ablated)") and text != shown
    assert float(text.split()[0]) == pytest.approx(cosine(cut[0], cut[1]), abs=1e-4)
    assert "1 head ablated" in driver.find_element(By.ID, "sv-effect").text
    button = driver.find_element(By.CSS_SELECTOR, '#sv-grid button[data-l="0"][data-h="3"]')
    assert "off" in button.get_attribute("class")
    button.click()  # again: restored
    wait_for(driver, "return document.body.dataset.svAblations", "2", timeout=60)
    assert driver.find_element(By.ID, "sv-similarity").text == shown
    assert driver.find_element(By.ID, "sv-effect").text == ""

    # another attention kind: the run repeats with it, the pattern panel appears
    runs = int(driver.execute_script("return document.body.dataset.svRuns"))
    heat = canvas_hash(driver, "heat")
    Select(driver.find_element(By.ID, "sv-kind")).select_by_value("local")
    wait_for(driver, "return document.body.dataset.svRuns", str(runs + 1), timeout=60)
    assert "local attention" in driver.find_element(By.ID, "sv-status").text
    assert driver.find_element(By.ID, "pattern-panel").is_displayed()
    assert canvas_hash(driver, "heat") != heat

    # the rollout view: the viewer draws rollout through each layer instead
    runs = int(driver.execute_script("return document.body.dataset.svRuns"))
    heat = canvas_hash(driver, "heat")
    driver.find_element(By.ID, "sv-rollout").click()
    wait_for(driver, "return document.body.dataset.svRuns", str(runs + 1), timeout=60)
    assert "attention rollout" in driver.find_element(By.ID, "sv-status").text
    assert "attention rollout" in driver.find_element(By.ID, "info").text
    assert driver.execute_script("return window.hfViewer.data.heads") == 1
    assert canvas_hash(driver, "heat") != heat
    driver.find_element(By.ID, "sv-rollout").click()
    wait_for(driver, "return document.body.dataset.svRuns", str(runs + 2), timeout=60)
    assert driver.execute_script("return window.hfViewer.data.heads") == 12

    assert severe(driver) == []
    urls = requested_urls(driver)
    assert any(u.endswith("/api/rollout?weights=binary") for u in urls)
    assert any(u.endswith("/api/run?weights=binary") for u in urls)
    assert any(u.endswith("/api/ablate") for u in urls)
    assert all(u.startswith(server.url + "/") or u.startswith("data:") for u in urls), urls


def test_hostile_text_stays_text(driver, server):
    open_app(driver, server.url)
    hostile = '<script>window.__pwned = 1</script> "><img src=x onerror="window.__pwned=2">'
    submit(driver, hostile)
    assert driver.execute_script("return window.__pwned === undefined")
    assert driver.execute_script("return document.querySelectorAll('img, #tokens script')"
                                 ".length") == 0
    tokens = shown_tokens(driver)
    assert tokens == load_bert()[1].encode_batch([hostile])[0].tokens
    assert tokens[1:4] == ["<", "script", ">"]
    assert severe(driver) == []
    assert all(u.startswith(server.url + "/") or u.startswith("data:")
               for u in requested_urls(driver))


def test_causal_generate_streams_tokens(driver, tmp_path):
    from selenium.webdriver.common.by import By

    s = Server("--model", str(causal_folder(tmp_path / "lm")))
    try:
        open_app(driver, s.url)
        assert driver.find_element(By.ID, "sv-generate").is_displayed()
        assert not driver.find_element(By.ID, "sv-pair").is_displayed()
        assert "next token:" in driver.find_element(By.ID, "sv-answer").text
        box = driver.find_element(By.ID, "sv-text")
        box.clear()
        box.send_keys("the cat")
        new = driver.find_element(By.ID, "sv-max-new")
        new.clear()
        new.send_keys("6")
        runs = int(driver.execute_script("return document.body.dataset.svRuns"))
        driver.find_element(By.ID, "sv-generate").click()
        wait_for(driver, "return document.body.dataset.svGenerated", "6", timeout=60)
        wait_for(driver, "return document.body.dataset.svRuns", str(runs + 1), timeout=60)
        spans = driver.find_elements(By.CSS_SELECTOR, "#sv-gen-out .tok")
        assert len(spans) == len("the cat") + 6
        # the earlier tokens are coloured by the last token's attention (in the head shown)
        colours = [sp.value_of_css_property("background-color") for sp in spans[:-1]]
        assert any(c not in ("rgba(0, 0, 0, 0)", "transparent") for c in colours)
        assert len(shown_tokens(driver)) == 13  # the viewer shows prompt + generated text
        assert severe(driver) == []
        assert all(u.startswith(s.url + "/") or u.startswith("data:")
                   for u in requested_urls(driver))
    finally:
        s.close()
