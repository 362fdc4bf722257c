"""The ``handformer serve`` page on the shipped LLMs, in headless Chromium: SmolLM2-135M-Instruct
(30 layers x 9 query heads sharing 3 key/value heads, a chat template) and Gemma 3 270M
(reads Chinese). A chat turn streams and stops, the head grid shows GQA and detector bars, the
picker switches to Gemma 3 and Chinese shows as Chinese tokens; screenshots are artefacts.
"""

from __future__ import annotations

import time

import pytest

from serve_util import Server
from test_page_browser import js, open_app, pick_model, save_screenshot, set_text, shown_tokens
from test_viewer_browser import severe, wait_for
from zh_util import ZH

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("gguf")
    s = Server("--model", "smollm2-135m-instruct", "--model", "gemma3-270m", timeout=600)
    yield s
    s.close()


def test_chat_turn_with_smollm2_streams_and_stops(driver, server, capsys):
    from selenium.webdriver.common.by import By

    open_app(driver, server.url)
    assert js(driver, "return document.body.dataset.svModel") == "smollm2-135m-instruct"
    assert len(driver.find_elements(By.CSS_SELECTOR, "#sv-grid button")) == 270
    legend = driver.find_element(By.ID, "sv-legend").text
    assert "9 query heads share 3 key/value heads" in legend
    wait_for(driver, "return document.body.dataset.svScores || null", "1", timeout=120)
    assert len(driver.find_elements(By.CSS_SELECTOR, "#sv-grid button .bars i")) == 270 * 3
    tip = driver.find_element(By.CSS_SELECTOR, '#sv-grid button[data-l="0"][data-h="4"]'
                              ).get_attribute("title")
    assert "key/value head 1" in tip and "induction" in tip
    # first paint after an answer (reported, not asserted)
    paint = js(driver, """return new Promise(resolve => {
        const t0 = performance.now();
        window.hfViewer.render(window.hfViewer.data).then(() =>
          requestAnimationFrame(() => resolve(performance.now() - t0)));});""")
    with capsys.disabled():
        print(f"\n[page] SmolLM2, {js(driver, 'return window.hfViewer.data.tokens.length')} "
              f"tokens x 270 heads: first paint {paint:.0f} ms after the answer arrived")

    driver.find_element(By.ID, "sv-mode-chat").click()
    assert driver.find_element(By.ID, "sv-chat-box").is_displayed()
    assert driver.find_element(By.ID, "sv-generate").text == "Send"
    assert js(driver, "return document.body.dataset.view") == "heat"  # the viewer kept its view
    set_text(driver, "Tell me a long story about a cat who could not cross a street.",
             submit=False)
    js(driver, "document.getElementById('sv-max-new').value = 300;")
    driver.find_element(By.ID, "sv-generate").click()
    wait_for(driver, "return Number(document.body.dataset.svGenerated || 0) >= 3", True,
             timeout=120)
    reply = driver.find_element(By.CSS_SELECTOR, "#sv-chat .sv-msg.assistant .body")
    # Read the reply and the count together, then wait for both to grow: a fixed token count
    # races with the model, which may already be past it when the first read comes back.
    first, count = js(driver, """const body = document.querySelector(
        '#sv-chat .sv-msg.assistant .body');
        return [body.textContent, Number(document.body.dataset.svGenerated || 0)];""")
    assert len(first) > 0 and count >= 3
    wait_for(driver, f"""return document.querySelector('#sv-chat .sv-msg.assistant .body')
        .textContent.length > {len(first)}
        && Number(document.body.dataset.svGenerated || 0) > {count}""", True, timeout=120)
    now = js(driver, "return document.querySelector('#sv-chat .sv-msg.assistant .body')"
                     ".textContent")
    assert now.startswith(first) and len(now) > len(first)  # it streams, appending
    driver.find_element(By.ID, "sv-stop").click()
    wait_for(driver, "return document.body.dataset.svStopped", "1", timeout=60)
    assert int(js(driver, "return document.body.dataset.svGenerated")) < 300
    wait_for(driver, "return document.getElementById('sv-status').textContent"
                     ".startsWith('stopped after')", True, timeout=120)
    messages = driver.find_elements(By.CSS_SELECTOR, "#sv-chat .sv-msg")
    assert [m.get_attribute("class").split()[-1] for m in messages] == ["user", "assistant"]
    template = js(driver, "return document.getElementById('sv-template').textContent")
    assert "<|im_start|>user" in template and "cross a street" in template
    assert "\ufffd" not in reply.text
    # the viewer shows the conversation's tokens, template included
    tokens = shown_tokens(driver)
    assert tokens[0] == "<|im_start|>" and "\ufffd" not in "".join(tokens)
    save_screenshot(driver, "smollm2-chat")
    assert severe(driver) == []


def test_picker_switches_to_gemma3_for_chinese(driver, server):
    from selenium.webdriver.common.by import By

    open_app(driver, server.url)
    set_text(driver, ZH)
    pick_model(driver, "gemma3-270m")
    assert len(driver.find_elements(By.CSS_SELECTOR, "#sv-grid button")) == 72
    assert "4 query heads share 1 key/value heads" in driver.find_element(By.ID,
                                                                          "sv-legend").text
    assert not driver.find_element(By.ID, "sv-mode-box").is_displayed()  # no chat template
    tokens = shown_tokens(driver)
    assert tokens[0] == "<bos>" and "动物" in tokens and "\ufffd" not in "".join(tokens)
    assert not driver.find_element(By.ID, "sv-notices").is_displayed()
    start = time.perf_counter()
    pick_model(driver, "smollm2-135m-instruct")  # already loaded: no reload
    assert time.perf_counter() - start < 30
    tokens = shown_tokens(driver)
    assert "动·1/2" in tokens and "\ufffd" not in "".join(tokens)
    save_screenshot(driver, "smollm2-chinese")
    assert severe(driver) == []


def test_long_text_first_paint_on_smollm2(driver, server, capsys):
    open_app(driver, server.url)
    start = time.perf_counter()
    set_text(driver, " ".join(["The animal didn't cross the street because it was too tired."]
                              * 45))
    answered = time.perf_counter() - start
    n = len(shown_tokens(driver))
    assert n == 544  # the page's limit for 30 x 9 heads (notice shown)
    assert "this page shows for a model of 30 x 9 heads" in js(
        driver, "return document.getElementById('sv-notices').textContent")
    paint = js(driver, """return new Promise(resolve => {
        const t0 = performance.now();
        window.hfViewer.render(window.hfViewer.data).then(() =>
          requestAnimationFrame(() => resolve(performance.now() - t0)));});""")
    with capsys.disabled():
        print(f"\n[page] SmolLM2, {n} tokens x 270 heads: answer {answered:.1f} s, first paint "
              f"{paint:.0f} ms after it arrived")
    assert severe(driver) == []
