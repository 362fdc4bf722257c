"""The HTML viewer in a real browser: headless Chromium driven by selenium.

Uses the system's ``/usr/bin/chromium`` and ``/usr/bin/chromedriver`` (Debian packages
``chromium`` and ``chromium-driver``; ``make browser-deps`` installs them). Selenium is told
where both are, and runs offline, so it never downloads a browser or a driver.
"""

import hashlib
import io
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from handformer.masks import window_mask
from handformer.pretrained import load_bert
from handformer.viz import AttentionView, save_html

pytestmark = pytest.mark.browser

SEED = "The animal didn't cross the street because it was too tired"


@pytest.fixture(scope="module")
def bert():
    return load_bert()


def run_model(bert, text):
    model, tokenizer = bert
    enc = tokenizer.encode_batch([text])
    with torch.inference_mode():
        out = model(**tokenizer.pad(enc), need_weights=True)
    return out.attentions, enc[0].tokens


@pytest.fixture(scope="module")
def seed(bert, tmp_path_factory):
    attentions, tokens = run_model(bert, SEED)
    path = tmp_path_factory.mktemp("viewer") / "index.html"
    save_html(attentions, tokens, path, title="Seed sentence", layer=3, head=1)
    return path, tokens, attentions


def open_page(driver, path, timeout=30.0):
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get_log("browser")  # drop entries from earlier pages
    start = time.perf_counter()
    driver.get(Path(path).resolve().as_uri())
    WebDriverWait(driver, timeout).until(
        lambda d: d.execute_script("return document.body.dataset.ready || null"))
    return time.perf_counter() - start


def severe(driver):
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def canvas_hash(driver, element_id):
    url = driver.execute_script(f"return document.getElementById('{element_id}').toDataURL()")
    return hashlib.sha256(url.encode()).hexdigest()


def wait_for(driver, script, value, timeout=10.0):
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout).until(lambda d: d.execute_script(script) == value)


def screenshot_pixels(driver):
    return imread(io.BytesIO(driver.get_screenshot_as_png()), format="png")[..., :3]


def test_seed_page_tokens_click_and_screenshot(driver, seed, tmp_path):
    from selenium.webdriver.common.by import By

    path, tokens, _ = seed
    open_page(driver, path)
    assert driver.execute_script("return document.body.dataset.ready") == "1"
    spans = driver.find_elements(By.CSS_SELECTOR, "#tokens .tok")
    assert [s.text for s in spans] == tokens
    assert all(s.is_displayed() for s in spans)
    before = canvas_hash(driver, "heat")
    it = tokens.index("it")
    spans[it].click()
    wait_for(driver, "return document.body.dataset.query", str(it))
    assert canvas_hash(driver, "heat") != before  # the pinned row is drawn
    assert "query" in spans[it].get_attribute("class")
    # the sentence is coloured by where "it" looks (layer 3, head 1 looks at "animal")
    animal = spans[tokens.index("animal")].value_of_css_property("background-color")
    assert animal not in ("rgba(0, 0, 0, 0)", "transparent")
    pixels = screenshot_pixels(driver)
    assert pixels.std() > 0.1
    assert len(np.unique(np.rint(pixels * 255).reshape(-1, 3), axis=0)) > 50
    assert severe(driver) == []


def test_head_view_and_model_view(driver, seed):
    from selenium.webdriver.common.by import By

    path, tokens, attentions = seed
    open_page(driver, path)
    driver.find_element(By.ID, "tab-head").click()
    wait_for(driver, "return document.body.dataset.view", "head")
    before = canvas_hash(driver, "lines")
    spans = driver.find_elements(By.CSS_SELECTOR, "#tokens .tok")
    spans[tokens.index("animal")].click()
    wait_for(driver, "return document.body.dataset.query", str(tokens.index("animal")))
    pinned = canvas_hash(driver, "lines")
    assert pinned != before
    driver.find_element(By.CSS_SELECTOR, '#head-chips [data-set="none"]').click()
    driver.execute_script("return 0")
    wait_for(driver, "return window.hfViewer.state.heads.size", 0)
    time.sleep(0.2)  # the redraw runs on the next animation frame
    assert canvas_hash(driver, "lines") != pinned  # no head selected: no lines

    driver.find_element(By.ID, "tab-model").click()
    wait_for(driver, "return document.body.dataset.view", "model")
    thumbs = driver.find_elements(By.CSS_SELECTOR, "#grid canvas")
    N, H = len(attentions), attentions[0].shape[1]
    assert len(thumbs) == N * H
    thumbs[2 * H + 5].click()  # layer 2, head 5 opens in the heat map
    wait_for(driver, "return document.body.dataset.view", "heat")
    assert driver.execute_script("return [window.hfViewer.state.layer, "
                                 "window.hfViewer.state.head]") == [2, 5]
    assert driver.find_element(By.ID, "layer").get_attribute("value") == "2"
    assert severe(driver) == []


def test_pattern_panel(driver, bert, tmp_path):
    from selenium.webdriver.common.by import By

    attentions, tokens = run_model(bert, SEED)
    L = len(tokens)
    path = save_html(attentions, tokens, tmp_path / "p.html", pattern=window_mask(L, L, 5),
                     pattern_label="Local attention, window 5")
    open_page(driver, path)
    panel = driver.find_element(By.ID, "pattern-panel")
    assert panel.is_displayed()
    caption = driver.find_element(By.ID, "pattern-caption").text
    assert caption.startswith("Local attention, window 5.") and "instead of 15" in caption
    empty = driver.execute_script(
        "const c = document.createElement('canvas'); const p = document.getElementById('pattern');"
        "c.width = p.width; c.height = p.height; return c.toDataURL()")
    assert driver.execute_script(
        "return document.getElementById('pattern').toDataURL()") != empty
    assert severe(driver) == []


def test_broken_data_is_reported(driver, seed, tmp_path):
    # The JS-error check above can fail: a corrupt page logs SEVERE and shows the error.
    page = seed[0].read_text(encoding="utf-8").replace('"encoding":"raw"', '"encoding":"zip"')
    broken = tmp_path / "broken.html"
    broken.write_text(page, encoding="utf-8")
    open_page(driver, broken)
    assert driver.execute_script("return document.body.dataset.ready") == "error"
    assert severe(driver) != []


def test_notebook_iframe(driver, seed, tmp_path):
    path, tokens, attentions = seed
    view = AttentionView(attentions, tokens, height=600)
    wrapper = tmp_path / "notebook.html"
    wrapper.write_text(f"<!DOCTYPE html><html><body>{view._repr_html_()}</body></html>",
                       encoding="utf-8")
    driver.get(wrapper.resolve().as_uri())
    driver.switch_to.frame(0)
    try:
        wait_for(driver, "return document.body.dataset.ready || null", "1", timeout=30)
        assert driver.execute_script(
            "return Array.from(document.querySelectorAll('#tokens .tok'))"
            ".map(e => e.textContent)") == tokens
    finally:
        driver.switch_to.default_content()
    assert severe(driver) == []


def test_512_tokens_size_and_open_time(driver, bert, tmp_path, capsys):
    from selenium.webdriver.common.by import By

    text = " ".join([SEED + "."] * 50)  # far more than 512 tokens: the tokenizer truncates
    with pytest.warns(UserWarning, match="truncated to 512"):
        attentions, tokens = run_model(bert, text)
    assert len(tokens) == 512
    path = save_html(attentions, tokens, tmp_path / "long.html")
    size = path.stat().st_size
    assert size < 10 * 1024 * 1024
    seconds = open_page(driver, path)
    in_page_ms = int(driver.execute_script("return document.body.dataset.openMs"))
    with capsys.disabled():
        print(f"\n[viewer] 512 tokens x {len(attentions)} layers x {attentions[0].shape[1]} "
              f"heads: {size / 1e6:.2f} MB, opened in {seconds:.2f} s "
              f"(ready {in_page_ms} ms after navigation start)")
    spans = driver.find_elements(By.CSS_SELECTOR, "#tokens .tok")
    assert len(spans) == 512
    before = canvas_hash(driver, "heat")
    spans[100].click()
    wait_for(driver, "return document.body.dataset.query", "100")
    assert canvas_hash(driver, "heat") != before
    assert severe(driver) == []


def test_controls_and_hover_tooltip(driver, seed):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    path, tokens, _ = seed
    open_page(driver, path)
    seen = {canvas_hash(driver, "heat")}
    steps = [
        ("layer", lambda: Select(driver.find_element(By.ID, "layer")).select_by_value("0"),
         "return window.hfViewer.state.layer", 0),
        ("mean", lambda: Select(driver.find_element(By.ID, "head")).select_by_value("-1"),
         "return window.hfViewer.state.head", -1),
        ("boost", lambda: driver.find_element(By.ID, "boost").click(),
         "return window.hfViewer.state.boost", True),
    ]
    for _, act, script, value in steps:
        act()
        wait_for(driver, script, value)
        time.sleep(0.2)  # the redraw runs on the next animation frame
        h = canvas_hash(driver, "heat")
        assert h not in seen  # every control changes the picture
        seen.add(h)
    # hover over a cell (selenium offsets are from the canvas centre, which lies inside the
    # matrix: the labels take less room than the 15 rows and columns)
    heat = driver.find_element(By.ID, "heat")
    ActionChains(driver).move_to_element_with_offset(heat, 20, 20).perform()
    tip = driver.find_element(By.ID, "tooltip")
    wait_for(driver, "return document.getElementById('tooltip').hidden", False)
    assert "query" in tip.text and "mean over heads" in tip.text
    assert any(t in tip.text for t in tokens)
    assert severe(driver) == []


def test_cross_attention_page(driver, tmp_path):
    from selenium.webdriver.common.by import By

    weights = torch.softmax(torch.randn(2, 1, 3, 5, 7), dim=-1)  # 2 layers, (B, H, L_q, L_k)
    path = save_html(list(weights), ["q0", "q1", "q2", "q3", "q4"], tmp_path / "x.html",
                     key_tokens=[f"k{j}" for j in range(7)], view="head")
    open_page(driver, path)
    assert driver.execute_script("return document.body.dataset.view") == "head"
    before = canvas_hash(driver, "lines")
    driver.find_elements(By.CSS_SELECTOR, "#tokens .tok")[2].click()
    wait_for(driver, "return document.body.dataset.query", "2")
    assert canvas_hash(driver, "lines") != before
    driver.find_element(By.ID, "tab-heat").click()
    wait_for(driver, "return document.body.dataset.view", "heat")
    size = driver.execute_script("const c = document.getElementById('heat');"
                                 "return [c.getBoundingClientRect().width, "
                                 "c.getBoundingClientRect().height]")
    assert size[0] > size[1]  # 7 key columns, 5 query rows
    assert severe(driver) == []


def test_first_token_sink_checkbox_and_opening_head(driver, tmp_path):
    """Issue 33: the page opens on the head ``choose_head`` picks, the sink left out; the
    first token (an attention sink) is left out of each head's colour scale unless the
    "first token in the colour scale" box is ticked (or the page was saved with
    include_sink=True)."""
    from selenium.webdriver.common.by import By

    from handformer.viz.head_choice import choose_head

    N, H, L = 4, 3, 9
    x = []
    for _ in range(N):
        a = torch.full((1, H, L, L), 0.1 / (L - 1))
        a[..., 0] = 0.9  # every query parks 0.9 on the first token
        x.append(a)
    x[3][0, 2, 7, 1:] = 0.6 / (L - 2)
    x[3][0, 2, 7, 3] = 0.3  # the one real link: layer 3, head 2
    tokens = [f"w{i}" for i in range(L)]
    layer, head = choose_head(x, tokens)
    assert (layer, head) == (3, 2)
    path = save_html(x, tokens, tmp_path / "sink.html", layer=layer, head=head)
    open_page(driver, path)
    state = "return [window.hfViewer.state.layer, window.hfViewer.state.head]"
    assert driver.execute_script(state) == [3, 2]
    assert driver.find_element(By.ID, "layer").get_attribute("value") == "3"

    def top():
        return float(driver.find_element(By.ID, "cb-hi").text)

    assert not driver.find_element(By.ID, "sink").is_selected()
    assert top() == pytest.approx(0.3, abs=0.003)  # the link, not the sink, sets the scale
    before = canvas_hash(driver, "heat")
    driver.find_element(By.ID, "sink").click()
    wait_for(driver, "return window.hfViewer.state.sink", True)
    time.sleep(0.2)  # the redraw runs on the next animation frame
    assert top() == pytest.approx(0.9, abs=0.003)
    assert canvas_hash(driver, "heat") != before

    path = save_html(x, tokens, tmp_path / "with-sink.html", layer=3, head=2, include_sink=True)
    open_page(driver, path)
    assert driver.find_element(By.ID, "sink").is_selected()
    assert top() == pytest.approx(0.9, abs=0.003)
    assert severe(driver) == []
