"""The ``handformer serve`` page as a person uses it, in headless Chromium: ablation changes the
heat map, a 400-token text shows labels after zooming, Chinese text shows Chinese tokens (never
U+FFFD), generation stops on the Stop button, the model picker switches models, and
screenshots at 420 px and 1920 px (written as test artefacts) have content where the page has.

Artefacts go to ``$HANDFORMER_ARTIFACTS`` (default ``build/test-artifacts/``).
"""

from __future__ import annotations

import io
import os
import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import transformers
from matplotlib.image import imread

from handformer.serve.wire import read_binary
from serve_util import Server, causal_folder
from test_viewer_browser import canvas_hash, severe, wait_for
from zh_util import ZH, byte_level_bpe

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("HANDFORMER_ARTIFACTS", ROOT / "build" / "test-artifacts"))
LONG = " ".join(["The animal didn't cross the street because it was too tired."] * 30)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("page")
    lm = causal_folder(root / "lm")
    zh = root / "gpt2-zh"
    tok = byte_level_bpe()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=128,
                                     n_embd=16, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(zh, safe_serialization=True)
    tok.save(str(zh / "tokenizer.json"))
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "gpt2"}', encoding="utf-8")
    return {"lm": lm, "zh": zh, "broken": broken, "long": long_context_folder(root / "long")}


def long_context_folder(path):
    """A random character LM with a 1024-token context: a 500-token generation takes long
    enough to be stopped half-way."""
    import handformer as hf
    from handformer.train.data import CharVocab
    from serve_util import CHARS

    torch.manual_seed(0)
    vocab = CharVocab(CHARS)
    model = hf.CausalLM(hf.CausalLMConfig(vocab_size=len(vocab), max_len=1024, d_model=64,
                                          num_heads=4, num_layers=4, d_ff=128))
    path.mkdir(parents=True)
    model.save_pretrained(path)
    vocab.save(path / "vocab.json")
    return path


@pytest.fixture(scope="module")
def server(folders):
    s = Server("--model", "all-MiniLM-L6-v2", "--model", str(folders["lm"]),
               "--model", str(folders["zh"]), "--model", str(folders["broken"]),
               "--model", str(folders["long"]))
    yield s
    s.close()


def open_app(driver, url, width=1300):
    driver.set_window_size(width, 950)
    driver.get_log("browser")
    driver.get(url + "/")
    wait_for(driver, "return document.body.dataset.svRuns || null", "1", timeout=60)


def js(driver, script):
    return driver.execute_script(script)


def runs(driver):
    return int(js(driver, "return document.body.dataset.svRuns"))


def set_text(driver, text, *, submit=True):
    from selenium.webdriver.common.by import By

    n = runs(driver)
    js(driver, f"const b = document.getElementById('sv-text'); b.value = {text!r};"
               "b.dispatchEvent(new Event('input'));")
    if submit:
        driver.find_element(By.ID, "sv-run").click()
        wait_for(driver, "return document.body.dataset.svRuns", str(n + 1), timeout=90)


def pick_model(driver, name):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    n = runs(driver)
    Select(driver.find_element(By.ID, "sv-model")).select_by_value(name)
    wait_for(driver, "return document.body.dataset.svRuns", str(n + 1), timeout=120)
    assert js(driver, "return document.body.dataset.svModel") == name


def shown_tokens(driver):
    return js(driver, "return Array.from(document.querySelectorAll('#tokens .tok'))"
                      ".map(e => e.textContent)")


def test_ablation_changes_the_heat_map(driver, server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    open_app(driver, server.url)
    assert js(driver, "return document.body.dataset.svModel") == "all-MiniLM-L6-v2"
    Select(driver.find_element(By.ID, "layer")).select_by_value("5")
    Select(driver.find_element(By.ID, "head")).select_by_value("0")
    time.sleep(0.3)
    before = canvas_hash(driver, "heat")
    status = driver.find_element(By.ID, "sv-status").text
    assert "15 tokens" in status and "heat map" in status
    driver.find_element(By.CSS_SELECTOR, '#sv-grid button[data-l="0"][data-h="3"]').click()
    wait_for(driver, "return document.body.dataset.svAblations", "1", timeout=60)
    time.sleep(0.3)
    assert canvas_hash(driver, "heat") != before  # later layers see the ablated head
    assert js(driver, "return window.hfViewer.data.ablated") == [[0, 3]]
    # What the page drew is the server's ablated answer, byte for byte.
    drawn = js(driver, "const d = window.hfViewer.data.data; let s = 0;"
                       "for (let i = 0; i < d.length; i++) s += d[i]; return s;")
    with httpx.Client(base_url=server.url, timeout=120) as c:
        text = js(driver, "return document.getElementById('sv-text').value")
        sent = read_binary(c.post("/api/run?weights=binary",
                                  json={"text": text, "heads": [[0, 3]]}).content)
        clean = read_binary(c.post("/api/run?weights=binary", json={"text": text}).content)
    assert drawn == int(sent["viewer"]["data"].sum(dtype=np.int64))
    assert drawn != int(clean["viewer"]["data"].sum(dtype=np.int64))
    status = driver.find_element(By.ID, "sv-status").text
    assert "15 tokens" in status and "heat map" in status and "1 head ablated" in status
    assert "1 head ablated" in driver.find_element(By.ID, "sv-effect").text
    # marked in the grid and in the model view
    button = driver.find_element(By.CSS_SELECTOR, '#sv-grid button[data-l="0"][data-h="3"]')
    assert "off" in button.get_attribute("class")
    assert button.get_attribute("aria-pressed") == "true"
    driver.find_element(By.ID, "tab-model").click()
    wait_for(driver, "return document.body.dataset.view", "model")
    thumb = driver.find_element(By.CSS_SELECTOR, '#grid canvas[data-l="0"][data-h="3"]')
    assert "ablated" in thumb.get_attribute("class")
    assert "model view" in driver.find_element(By.ID, "sv-status").text
    # keyboard: a thumbnail opens in the heat map with Enter
    thumb.send_keys("\n")
    wait_for(driver, "return document.body.dataset.view", "heat")
    assert js(driver, "return [window.hfViewer.state.layer, window.hfViewer.state.head]") == [0, 3]
    assert "ablated" in driver.find_element(By.ID, "heat-note").text
    # typing clears the effect line
    set_text(driver, "The cat sat on the mat", submit=False)
    assert driver.find_element(By.ID, "sv-effect").text == ""
    assert severe(driver) == []


def test_long_text_labels_after_zooming(driver, server):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    open_app(driver, server.url)
    set_text(driver, LONG)
    n = len(shown_tokens(driver))
    assert n > 400
    assert js(driver, "return document.body.dataset.heatLabels") == "0"  # fit: too small
    driver.find_element(By.ID, "zoom-in").click()  # from the whole matrix: its start
    time.sleep(0.2)
    assert js(driver, "return document.body.dataset.heatLabels") == "1"
    assert float(js(driver, "return document.body.dataset.heatCell")) >= 9
    y0, x0, rows, cols = map(int, js(driver, "return document.body.dataset.heatWindow")
                             .split(","))
    assert (y0, x0) == (0, 0) and rows < n and cols < n
    # The labels are drawn: the strip left of the matrix has dark pixels.
    ink = js(driver, """const c = document.getElementById('heat');
        const g = c.getContext('2d').getImageData(0, 200, 40, 200).data; let k = 0;
        for (let i = 0; i < g.length; i += 4) if (g[i] < 120) k++; return k;""")
    assert ink > 50
    # Pan with the keyboard: moving the query past the window scrolls the rows.
    heat = driver.find_element(By.ID, "heat")
    heat.click()
    before = canvas_hash(driver, "heat")
    for _ in range(rows + 3):
        ActionChains(driver).send_keys("\ue015").perform()  # arrow down
    time.sleep(0.3)
    y1 = int(js(driver, "return document.body.dataset.heatWindow").split(",")[0])
    assert y1 > y0 and canvas_hash(driver, "heat") != before
    # the row/column cursor: hover shows the tooltip with query and key
    ActionChains(driver).move_to_element_with_offset(heat, 10, 10).perform()
    wait_for(driver, "return document.getElementById('tooltip').hidden", False)
    assert "query" in driver.find_element(By.ID, "tooltip").text
    driver.find_element(By.ID, "zoom-fit").click()
    time.sleep(0.2)
    assert js(driver, "return document.body.dataset.heatLabels") == "0"
    save_screenshot(driver, "long-text-zoomed")
    assert severe(driver) == []


def test_chinese_text_without_replacement_characters(driver, server):
    from selenium.webdriver.common.by import By

    open_app(driver, server.url)
    set_text(driver, ZH)  # the English encoder: [UNK]s and one notice naming Gemma 3
    notice = driver.find_element(By.ID, "sv-notices").text
    assert "are the unknown token" in notice and "--model gemma3-270m" in notice
    pick_model(driver, "gpt2-zh")
    set_text(driver, ZH)
    tokens = shown_tokens(driver)
    assert not any("\ufffd" in t for t in tokens)
    assert "动·1/3" in tokens and "马·1/2" in tokens
    assert not driver.find_element(By.ID, "sv-notices").is_displayed()
    # generated text: whole characters only, labels relabelled once complete
    n = runs(driver)
    js(driver, "document.getElementById('sv-max-new').value = 12;"
               "document.getElementById('sv-temperature').value = 1;")
    driver.find_element(By.ID, "sv-generate").click()
    wait_for(driver, "return document.body.dataset.svRuns", str(n + 1), timeout=90)
    out = [s.text for s in driver.find_elements(By.CSS_SELECTOR, "#sv-gen-out .tok")]
    assert out and not any("\ufffd" in t for t in out)
    assert not any("\ufffd" in t for t in shown_tokens(driver))
    assert js(driver, "return document.getElementById('sv-text').value") == ZH  # kept
    save_screenshot(driver, "chinese")
    assert severe(driver) == []


def test_generation_stops_on_the_stop_button(driver, server):
    from selenium.webdriver.common.by import By

    open_app(driver, server.url)
    pick_model(driver, "long")
    set_text(driver, "the cat", submit=False)
    js(driver, "document.getElementById('sv-max-new').value = 500;")
    assert driver.find_element(By.ID, "sv-gen-box").is_displayed()
    driver.find_element(By.ID, "sv-generate").click()
    wait_for(driver, "return Number(document.body.dataset.svGenerated || 0) >= 3", True,
             timeout=60)
    driver.find_element(By.ID, "sv-stop").click()
    wait_for(driver, "return document.body.dataset.svStopped", "1", timeout=30)
    assert js(driver, "return document.body.dataset.svGenerating") == ""
    assert int(js(driver, "return document.body.dataset.svGenerated")) < 500
    wait_for(driver, "return document.getElementById('sv-status').textContent"
                     ".startsWith('stopped after')", True, timeout=120)
    assert js(driver, "return document.getElementById('sv-text').value") == "the cat"
    # the server freed this client's generation slot: a new one runs to the end
    js(driver, "document.body.dataset.svGenerated = '0';"
               "document.getElementById('sv-max-new').value = 3;")
    driver.find_element(By.ID, "sv-generate").click()
    wait_for(driver, "return document.body.dataset.svGenerated", "3", timeout=60)
    assert severe(driver) == []


def test_model_picker_switches_and_reports_a_failed_load(driver, server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    open_app(driver, server.url)
    names = [o.get_attribute("value")
             for o in driver.find_elements(By.CSS_SELECTOR, "#sv-model option")]
    assert names == ["all-MiniLM-L6-v2", "lm", "gpt2-zh", "broken", "long"]
    assert len(driver.find_elements(By.CSS_SELECTOR, "#sv-grid button")) == 72
    pick_model(driver, "lm")
    assert len(driver.find_elements(By.CSS_SELECTOR, "#sv-grid button")) == 8
    assert js(driver, "return window.hfViewer.data.layers") == 2
    assert driver.find_element(By.ID, "sv-gen-box").is_displayed()
    assert not driver.find_element(By.ID, "sv-pair").is_displayed()
    assert "lm" in driver.find_element(By.ID, "sv-status").text
    wait_for(driver, "return document.body.dataset.svScores || null", "1", timeout=60)
    bars = driver.find_elements(By.CSS_SELECTOR, '#sv-grid button[data-l="1"] .bars i')
    assert len(bars) == 8 * 3 // 2  # three detector bars per head of layer 1
    tip = driver.find_element(By.CSS_SELECTOR, '#sv-grid button[data-l="1"][data-h="0"]'
                              ).get_attribute("title")  # detect_heads' number, and its ceiling
    assert re.search(r"induction: [01]\.\d\d \(a perfect head: 0\.\d\d\)", tip), tip
    # a model that cannot be loaded: the error is shown, the page stays on lm
    Select(driver.find_element(By.ID, "sv-model")).select_by_value("broken")
    wait_for(driver, "return document.body.dataset.svError.includes('could not be loaded')",
             True, timeout=60)
    assert js(driver, "return document.getElementById('sv-model').value") == "lm"
    assert "failed to load" in driver.find_element(By.CSS_SELECTOR,
                                                   '#sv-model option[value="broken"]').text
    # back to the encoder: instant (already loaded), the grid is 6 x 12 again
    start = time.perf_counter()
    pick_model(driver, "all-MiniLM-L6-v2")
    switch = time.perf_counter() - start
    assert len(driver.find_elements(By.CSS_SELECTOR, "#sv-grid button")) == 72
    print(f"\n[page] switching to an already-loaded model: {switch:.2f} s")
    assert severe(driver) == [] or all("503" in e["message"] for e in severe(driver))


def save_screenshot(driver, name):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"serve-{name}.png"
    path.write_bytes(driver.get_screenshot_as_png())
    return path


def region_std(png, box):
    """The pixel spread inside ``box`` = (x, y, w, h) of a screenshot."""
    img = imread(io.BytesIO(png), format="png")[..., :3]
    x, y, w, h = (int(v) for v in box)
    return float(img[y:y + h, x:x + w].std())


@pytest.mark.parametrize("width", [420, 1920])
def test_screenshots_at_two_widths(driver, server, width, capsys):
    open_app(driver, server.url, width=width)
    # The whole page in one picture: the window as tall as the page.
    height = min(4000, js(driver, "return document.documentElement.scrollHeight"))
    driver.set_window_size(width, height + 120)
    time.sleep(0.5)
    png = driver.get_screenshot_as_png()
    path = save_screenshot(driver, f"{width}px")
    assert path.stat().st_size > 10_000
    dpr = js(driver, "return window.devicePixelRatio") or 1
    for element in ("sv", "sv-grid", "tokens", "heat"):
        r = js(driver, f"const r = document.getElementById('{element}')"
                       ".getBoundingClientRect(); return [r.x, r.y, Math.min(r.width, "
                       "innerWidth - r.x), Math.min(r.height, innerHeight - r.y)]")
        assert r[2] > 0 and r[3] > 0, element
        assert region_std(png, [v * dpr for v in r]) > 0.02, f"{element} is blank at {width} px"
    # The page fits the width: no horizontal scroll of the whole page.
    assert js(driver, "return document.documentElement.scrollWidth") <= width + 1
    # first paint after the answer (reported, not asserted)
    paint = js(driver, """return new Promise(resolve => {
        const t0 = performance.now();
        window.hfViewer.render(window.hfViewer.data).then(() =>
          requestAnimationFrame(() => resolve(performance.now() - t0)));});""")
    with capsys.disabled():
        print(f"\n[page] {width} px: first paint {paint:.0f} ms after the answer arrived")
    assert severe(driver) == []


def test_logit_attribution_view(driver, server):
    from selenium.webdriver.common.by import By

    open_app(driver, server.url)
    assert not driver.find_element(By.ID, "sv-attr-box").is_displayed()  # an encoder
    pick_model(driver, "lm")
    box = driver.find_element(By.ID, "sv-attr-box")
    assert box.is_displayed()
    box.find_element(By.TAG_NAME, "summary").click()
    wait_for(driver, "return document.body.dataset.svAttribution || null", "1", timeout=60)
    text = driver.find_element(By.ID, "sv-attr").text
    assert text.startswith("Answer token ") and "Largest heads" in text
    rows = driver.find_elements(By.CSS_SELECTOR, "#sv-attr table tr")
    assert len(rows) >= 2 + 8  # two header rows, parts and heads
    with httpx.Client(base_url=server.url, timeout=120) as c:
        body = {"model": "lm", "text": js(driver, "return document.getElementById('sv-text')"
                                                  ".value")}
        r = c.post("/api/attribution", json=body).json()
    assert f"logit {r['logit']:.3f}" in text
    # ablating a head recomputes it
    n = int(js(driver, "return document.body.dataset.svAttribution"))
    driver.find_element(By.CSS_SELECTOR, '#sv-grid button[data-l="1"][data-h="0"]').click()
    wait_for(driver, "return document.body.dataset.svAttribution", str(n + 1), timeout=60)
    assert "with 1 head(s) ablated" in driver.find_element(By.ID, "sv-attr").text
    assert severe(driver) == []
