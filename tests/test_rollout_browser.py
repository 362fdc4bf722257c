"""The rollout view of index.html (rollout.js) in headless Chromium (see test_viewer_browser)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handformer.inspect import attention_flow, attention_rollout
from handformer.pretrained import load_bert
from handformer.viz import rollout_payload, save_html

pytestmark = pytest.mark.browser

SEED = "The animal didn't cross the street because it was too tired"


def test_rollout_view_draws_and_follows_clicks(driver, tmp_path: Path) -> None:  # noqa: ANN001
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    model, tokenizer = load_bert()
    enc = tokenizer.encode_batch([SEED])
    with torch.inference_mode():
        att = model(**tokenizer.pad(enc), need_weights=True).attentions
    tokens = enc[0].tokens
    R = attention_rollout(att)
    view = rollout_payload(R, raw=att[-1][0].mean(0)[0], flow=attention_flow(att)[0, 0])
    path = save_html(att, tokens, tmp_path / "index.html", rollout=view)
    driver.get_log("browser")
    driver.get(path.resolve().as_uri())
    WebDriverWait(driver, 30).until(
        lambda d: d.execute_script("return document.body.dataset.ready || null"))
    section = driver.find_element(By.ID, "view-rollout")
    assert section.is_displayed()
    rows = driver.find_elements(By.CSS_SELECTOR, "#rollout-bars tr")
    assert len(rows) == len(tokens) + 1  # header + one per token
    assert [r.find_element(By.CSS_SELECTOR, "td.tok").text for r in rows[1:]] == tokens
    assert len(rows[1].find_elements(By.CSS_SELECTOR, ".bar")) == 3  # raw, rollout, flow
    title = driver.find_element(By.ID, "rollout-title")
    assert title.text.startswith("Output position 0 ([CLS])")
    canvas = driver.find_element(By.ID, "rollout-heat")
    before = driver.execute_script("return arguments[0].toDataURL()", canvas)
    cell = canvas.size["height"] / len(tokens)
    it = tokens.index("it")
    ActionChains(driver).move_to_element_with_offset(
        canvas, 0, int((it + 0.5) * cell - canvas.size["height"] / 2)).click().perform()
    WebDriverWait(driver, 10).until(lambda d: title.text.startswith(f"Output position {it}"))
    assert driver.execute_script("return arguments[0].toDataURL()", canvas) != before
    # the bars now show the rollout row of "it" only (flow was computed for [CLS])
    bars = driver.find_elements(By.CSS_SELECTOR, "#rollout-bars tr")[1]
    assert len(bars.find_elements(By.CSS_SELECTOR, ".bar")) == 1
    assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
