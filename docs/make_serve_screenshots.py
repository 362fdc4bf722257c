"""Screenshots of the ``handformer serve`` page for docs/serve.md, taken in headless Chromium.

    .venv/bin/python docs/make_serve_screenshots.py                 # the bundled encoder
    .venv/bin/python docs/make_serve_screenshots.py --model gemma3-270m --model DIR ...
    .venv/bin/python docs/make_serve_screenshots.py --model smollm2-135m-instruct \
        --transcoders ~/.cache/handformer/transcoders/smollm2-135m-instruct   # + serve-graph.png

Needs ``make browser-deps`` (chromium, chromedriver, fonts-noto-cjk). Writes docs/img/serve-*.png:
the page with one head ablated, a long text zoomed in, a Chinese text on the English encoder
(the notice), the page at 420 px, and for each ``--model`` (causal LMs) a chat turn (models
with a chat template) or a Chinese prompt continued; with ``--transcoders`` (one per layer of
the first ``--model``) the attribution graph of "The capital of France is", a feature's card
shown (serve-graph.png).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from browser_util import start_chromium  # noqa: E402
from serve_util import Server  # noqa: E402

IMG = ROOT / "docs" / "img"
LONG = " ".join(["The animal didn't cross the street because it was too tired."] * 30)
ZH = "动物没有过马路，因为它太累了"


def wait(driver, script, value, timeout=180.0):
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout).until(lambda d: d.execute_script(script) == value)


def runs(driver):
    return int(driver.execute_script("return document.body.dataset.svRuns"))


def submit(driver, text):
    from selenium.webdriver.common.by import By

    n = runs(driver)
    driver.execute_script("const b = document.getElementById('sv-text'); b.value = arguments[0];"
                          "b.dispatchEvent(new Event('input'));", text)
    driver.find_element(By.ID, "sv-run").click()
    wait(driver, "return document.body.dataset.svRuns", str(n + 1))


def shot(driver, name, element=None):
    from selenium.webdriver.common.by import By

    path = IMG / f"serve-{name}.png"
    target = driver.find_element(By.ID, element) if element else None
    path.write_bytes(target.screenshot_as_png if target else driver.get_screenshot_as_png())
    print(f"wrote {path.relative_to(ROOT)}")


def main() -> int:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=[])
    parser.add_argument("--transcoders", default=None,
                        help="transcoders of the first --model: also take serve-graph.png")
    args = parser.parse_args()
    if args.transcoders and not args.model:
        parser.error("--transcoders needs the --model they belong to")
    models = ["all-MiniLM-L6-v2", *args.model]
    server = Server(*[a for m in models for a in ("--model", m)], timeout=600)
    driver = start_chromium()
    try:
        driver.set_window_size(1300, 1250)
        driver.get(server.url + "/")
        wait(driver, "return document.body.dataset.svRuns || null", "1")
        wait(driver, "return document.body.dataset.svScores || null", "1")
        driver.find_element(By.CSS_SELECTOR, '#sv-grid button[data-l="1"][data-h="3"]').click()
        wait(driver, "return document.body.dataset.svAblations", "1")
        time.sleep(0.5)
        shot(driver, "ablated")

        submit(driver, LONG)
        driver.find_element(By.ID, "zoom-in").click()
        driver.find_element(By.ID, "zoom-in").click()
        driver.execute_script("document.getElementById('heat').scrollIntoView()")
        time.sleep(0.5)
        shot(driver, "zoomed", "view-heat")

        submit(driver, ZH)
        time.sleep(0.3)
        driver.execute_script("window.scrollTo(0, 0)")
        shot(driver, "zh-notice", "sv")

        driver.set_window_size(420, 1400)
        driver.get(server.url + "/")
        wait(driver, "return document.body.dataset.svRuns || null", "1")
        time.sleep(0.5)
        shot(driver, "narrow")

        driver.set_window_size(1300, 1250)
        for name in models[1:]:  # each causal LM: a chat turn, or Chinese text continued
            driver.get(server.url + "/")
            wait(driver, "return document.body.dataset.svRuns || null", "1")
            n = runs(driver)
            Select(driver.find_element(By.ID, "sv-model")).select_by_value(name)
            wait(driver, "return document.body.dataset.svRuns", str(n + 1), timeout=900)
            wait(driver, "return document.body.dataset.svScores || null", "1", timeout=900)
            chat = driver.execute_script("return !document.getElementById('sv-mode-box')"
                                         ".hidden")
            if chat:
                driver.find_element(By.ID, "sv-mode-chat").click()
                driver.execute_script("document.getElementById('sv-text').value = "
                                      "'Why did the animal not cross the street?';")
            else:
                submit(driver, ZH)
            n = runs(driver)
            driver.execute_script("document.getElementById('sv-max-new').value = 24;")
            driver.find_element(By.ID, "sv-generate").click()
            wait(driver, "return document.body.dataset.svRuns", str(n + 1), timeout=900)
            time.sleep(0.5)
            shot(driver, ("chat-" if chat else "zh-") + name)
    finally:
        driver.quit()
        server.close()
    if args.transcoders:
        graph_shot(args.model[0], args.transcoders)
    return 0


def graph_shot(model: str, transcoders: str) -> None:
    """serve-graph.png: the graph of a prompt on ``model`` with ``transcoders``, a card shown."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    server = Server("--model", model, "--transcoders", transcoders, timeout=900)
    driver = start_chromium()
    try:
        driver.set_window_size(1300, 1400)
        driver.get(server.url + "/")
        wait(driver, "return document.body.dataset.svRuns || null", "1", timeout=900)
        driver.execute_script("document.getElementById('sv-text').value = "
                              "'The capital of France is';"
                              "document.getElementById('sv-graph-max').value = 400;")
        driver.find_element(By.ID, "sv-graph-run").click()
        wait(driver, "return document.body.dataset.svGraphs || null", "1", timeout=1800)
        feature = driver.find_elements(By.CSS_SELECTOR, "#sv-graph .gv-node.gv-feature")[0]
        driver.execute_script("document.getElementById('sv-graph-box').scrollIntoView()")
        ActionChains(driver).move_to_element(feature).click().perform()
        wait(driver, "return document.querySelector('#sv-graph .gv-card').dataset.state",
             "card", timeout=300)
        time.sleep(0.5)
        shot(driver, "graph", "sv-graph-box")
    finally:
        driver.quit()
        server.close()


if __name__ == "__main__":
    sys.exit(main())
