"""The Features view in headless Chromium: ``handformer serve --model DIR --dictionary SAE``
(a tiny causal LM and SAE the test writes). Hovering a token lists its features, a click opens
the card, and Steer shows the continuation the API gives for the same request."""

from __future__ import annotations

import httpx
import pytest

from handformer.features import save_dictionary
from serve_util import Server, causal_folder
from test_serve_features import tiny_sae
from test_viewer_browser import severe, wait_for

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("featpage")
    folder = causal_folder(root / "model")
    save_dictionary(tiny_sae(32), root / "sae_a")
    s = Server("--model", str(folder), "--dictionary", str(root / "sae_a"))
    yield s
    s.close()


def test_hover_card_and_steer(driver, server):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    driver.get_log("browser")
    driver.get(server.url + "/")
    wait_for(driver, "return document.body.dataset.svFeatureRuns || null", "1", timeout=60)
    assert driver.find_element(By.ID, "sv-feat-box").is_displayed()
    tokens = driver.find_elements(By.CSS_SELECTOR, "#sv-feat-tokens [data-pos]")
    text = driver.execute_script("return document.getElementById('sv-text').value")
    with httpx.Client(base_url=server.url, timeout=60) as client:
        active = client.post("/api/features/active", json={"text": text}).json()
    assert [t.text for t in tokens] == active["tokens"]
    pos = next(i for i, a in enumerate(active["active"]) if a and i > 0)
    ActionChains(driver).move_to_element(tokens[pos]).perform()
    wait_for(driver, "return document.getElementById('sv-feat-list').dataset.pos", str(pos))
    buttons = driver.find_elements(By.CSS_SELECTOR, "#sv-feat-list button[data-feature]")
    assert [int(b.get_attribute("data-feature")) for b in buttons] == [
        a["feature"] for a in active["active"][pos]]
    buttons[0].click()
    wait_for(driver, "return document.body.dataset.svFeatureCards || null", "1", timeout=30)
    f = active["active"][pos][0]["feature"]
    coef = driver.find_element(By.ID, "sv-feat-coef")
    coef.clear()
    coef.send_keys("40")
    driver.find_element(By.ID, "sv-feat-steer").click()
    wait_for(driver, "return document.body.dataset.svFeatureChanges || null", "1", timeout=30)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        want = client.post("/api/features/intervene", json={
            "text": text, "feature": f, "mode": "steer", "coefficient": 40,
            "new_tokens": 12}).json()
    assert driver.find_element(By.ID, "sv-feat-changed").text == want["changed_text"].strip()
    assert not severe(driver)
