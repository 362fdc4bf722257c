"""``handformer serve`` latency and throughput, against the direct Python call.

The server runs in its own process (``python -m handformer serve --port 0``, the bundled
all-MiniLM-L6-v2); requests go through httpx over 127.0.0.1. The reference, measured in this
process interleaved with the requests, is the direct call a Python user makes for the same
attention maps: ``model(**tokenizer([text]), need_weights=True)``, timed both in the main
thread and in a worker thread (where the server runs it); the faster of the two is the
reference. (On a loaded 2-core machine torch's two intra-op threads can make the main-thread
call several times slower than the same call in a worker thread.)

* 15-token ``/api/run`` (the seed sentence, JSON answer): p50 and p95; target p50 <= 1.5 x
  direct + 10 ms. The page's request (``?weights=binary``) is timed beside it.
* Requests per second with 8 concurrent clients (and with 1, for scale).
* A 512-token ``/api/run?weights=binary``, the page's request (the answer read into a dict
  with the weights as a uint8 array): target <= 2 x its direct call. The same request with
  the weights as base64 inside the JSON (the default answer) is timed beside it.
* An LLM (SmolLM2-135M-Instruct, the shipped GGUF, 30 layers x 9 heads): a 512-token
  ``/api/run?weights=binary`` (sent as token ids) against the direct forward with weights plus
  the export of the viewer's 8-bit weights (``viewer_payload``), in the main thread and in a
  worker thread (the faster is the reference): target <= 1.5 x. Beside it, the page's model
  switch to Gemma 3 270M: the first request naming it (it loads) and the next one (already
  loaded: no reload). Skipped, with a note, where SmolLM2 cannot be loaded.

Usage: ``python benchmarks/bench_serve.py`` (``HANDFORMER_BENCH_QUICK=1`` for one quick round).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import QUICK, interleaved_runs, machine, machine_line, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEED = "The animal didn't cross the street because it was too tired"


def start_server() -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "handformer", "serve", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT)
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        raise RuntimeError(f"the server did not start: {line!r} {proc.stderr.read()[-1000:]}")
    return proc, "http://" + line.split("http://", 1)[1].split()[0].rstrip("/")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def throughput(url: str, clients: int, per_client: int) -> float:
    import httpx

    errors: list[str] = []

    def work() -> None:
        with httpx.Client(base_url=url, timeout=300) as c:
            for _ in range(per_client):
                r = c.post("/api/run", json={"text": SEED})
                if r.status_code != 200:
                    errors.append(r.text)

    threads = [threading.Thread(target=work) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0][:200]}")
    return clients * per_client / seconds


LLM = "smollm2-135m-instruct"
SECOND = "gemma3-270m"  # the model the page switches to (loaded by its first request)


def bench_llm() -> dict[str, object]:
    """The 512-token request on SmolLM2 vs the direct forward + export (see the docstring)."""
    import httpx
    import torch

    from handformer.tokenizers.labels import token_labels
    from handformer.viz.html import viewer_payload

    try:
        from handformer.pretrained import load_lm

        model, tokenizer = load_lm(LLM)
    except Exception as exc:  # noqa: BLE001 - report why, keep the encoder results
        return {"skipped": f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"}
    text = " ".join([SEED + "."] * 60)
    ids = list(tokenizer.encode(text))[:512]
    assert len(ids) == 512
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "handformer", "serve", "--port", "0",
                             "--model", LLM, "--model", SECOND],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        raise RuntimeError(f"the server did not start: {line!r} {proc.stderr.read()[-1000:]}")
    url = "http://" + line.split("http://", 1)[1].split()[0].rstrip("/")
    from handformer.serve.wire import read_binary

    try:
        client = httpx.Client(base_url=url, timeout=600)

        def request() -> None:
            r = client.post("/api/run?weights=binary", json={"ids": ids})
            r.raise_for_status()
            read_binary(r.content)

        def direct() -> None:
            with torch.inference_mode():
                out = model(torch.tensor([ids]), need_weights=True)
            viewer_payload(out.attentions, token_labels(tokenizer, ids), binary=True,
                           compress=False)

        worker = ThreadPoolExecutor(1)  # where the server runs it (see the module docstring)

        def direct_in_thread() -> None:
            worker.submit(direct).result()

        got = read_binary(client.post("/api/run?weights=binary", json={"ids": ids}).content)
        assert got["viewer"]["data"].shape == (model.config.num_layers,
                                               model.config.num_heads, 512, 512)
        runs = interleaved_runs({"http": request, "direct_main": direct,
                                 "direct_thread": direct_in_thread},
                                repeats=1 if QUICK else 5, warmup=1)
        worker.shutdown()
        ref = min(("direct_main", "direct_thread"), key=lambda k: statistics.median(runs[k]))
        result: dict[str, object] = {
            "model": LLM, "tokens": 512, "layers": model.config.num_layers,
            "heads": model.config.num_heads,
            "http_s": statistics.median(runs["http"]), "reference": ref,
            "direct_s": statistics.median(runs[ref]), "runs_s": runs}
        result["ratio"] = result["http_s"] / result["direct_s"]
        result["within_target"] = result["ratio"] <= 1.5
        switch: dict[str, object] = {"model": SECOND}
        for label in ("first_s", "again_s"):  # a second model: loaded by the first request
            start = time.perf_counter()
            client.post("/api/run", json={"model": SECOND, "text": SEED}).raise_for_status()
            switch[label] = time.perf_counter() - start
        result["switch"] = switch
        client.close()
    finally:
        proc.terminate()
        proc.wait(30)
    return result


def main() -> int:
    import httpx
    import torch

    from handformer.pretrained import load_bert
    from handformer.serve.wire import read_binary

    warnings.simplefilter("ignore")  # the 512-token text is truncated on purpose
    load_start = os.getloadavg()[0]
    model, tokenizer = load_bert()
    long_text = " ".join([SEED + "."] * 50)
    proc, url = start_server()
    try:
        client = httpx.Client(base_url=url, timeout=300)

        def direct(text: str) -> None:
            with torch.inference_mode():
                model(**tokenizer([text]), need_weights=True)

        worker = ThreadPoolExecutor(1)

        def direct_in_thread(text: str) -> None:
            worker.submit(direct, text).result()

        def request(text: str) -> None:
            r = client.post("/api/run", json={"text": text})
            r.raise_for_status()
            r.json()

        def request_binary(text: str) -> None:  # what the page does
            r = client.post("/api/run?weights=binary", json={"text": text})
            r.raise_for_status()
            read_binary(r.content)

        assert len(client.post("/api/run", json={"text": SEED}).json()["tokens"]) == 15
        runs = interleaved_runs({"http": lambda: request(SEED),
                                 "http_binary": lambda: request_binary(SEED),
                                 "direct_main": lambda: direct(SEED),
                                 "direct_thread": lambda: direct_in_thread(SEED)},
                                repeats=5 if QUICK else 60, warmup=3)
        ref = min(("direct_main", "direct_thread"), key=lambda k: statistics.median(runs[k]))
        short = {"tokens": 15, "http_p50_ms": 1e3 * statistics.median(runs["http"]),
                 "http_p95_ms": 1e3 * percentile(runs["http"], 0.95),
                 "direct_p50_ms": 1e3 * statistics.median(runs[ref]),
                 "direct_p95_ms": 1e3 * percentile(runs[ref], 0.95), "reference": ref,
                 "direct_main_p50_ms": 1e3 * statistics.median(runs["direct_main"]),
                 "direct_thread_p50_ms": 1e3 * statistics.median(runs["direct_thread"]),
                 "binary_p50_ms": 1e3 * statistics.median(runs["http_binary"]),
                 "binary_p95_ms": 1e3 * percentile(runs["http_binary"], 0.95)}
        short["ratio_p50"] = short["http_p50_ms"] / short["direct_p50_ms"]
        short["budget_ms"] = 1.5 * short["direct_p50_ms"] + 10.0
        short["within_target"] = short["http_p50_ms"] <= short["budget_ms"]
        short["runs_s"] = runs

        per = 2 if QUICK else 12
        rps = {"clients_8": throughput(url, 8, per), "clients_1": throughput(url, 1, per * 2)}

        assert len(client.post("/api/run", json={"text": long_text}).json()["tokens"]) == 512
        long_runs = interleaved_runs({"http": lambda: request_binary(long_text),
                                      "http_json": lambda: request(long_text),
                                      "direct_main": lambda: direct(long_text),
                                      "direct_thread": lambda: direct_in_thread(long_text)},
                                     repeats=1 if QUICK else 9, warmup=1)
        long_ref = min(("direct_main", "direct_thread"),
                       key=lambda k: statistics.median(long_runs[k]))
        long = {"tokens": 512, "format": "binary", "http_s": statistics.median(long_runs["http"]),
                "json_http_s": statistics.median(long_runs["http_json"]),
                "direct_s": statistics.median(long_runs[long_ref]), "reference": long_ref,
                "runs_s": long_runs}
        long["ratio"] = long["http_s"] / long["direct_s"]
        long["json_ratio"] = long["json_http_s"] / long["direct_s"]
        long["within_target"] = long["ratio"] <= 2.0
        client.close()
        worker.shutdown()
    finally:
        proc.terminate()
        proc.wait(30)

    print(f"15-token /api/run: p50 {short['http_p50_ms']:.1f} ms, p95 {short['http_p95_ms']:.1f} "
          f"ms; direct call p50 {short['direct_p50_ms']:.1f} ms (main thread "
          f"{short['direct_main_p50_ms']:.1f}, worker thread {short['direct_thread_p50_ms']:.1f});"
          f" ratio {short['ratio_p50']:.2f}"
          f" (target p50 <= 1.5 x direct + 10 ms = {short['budget_ms']:.1f} ms: "
          f"{'met' if short['within_target'] else 'MISSED'}); ?weights=binary p50 "
          f"{short['binary_p50_ms']:.1f} ms")
    print(f"requests/s: {rps['clients_8']:.1f} with 8 concurrent clients, "
          f"{rps['clients_1']:.1f} with 1")
    llm = bench_llm()
    if "skipped" in llm:
        print(f"{LLM}: skipped ({llm['skipped']})")
        llm_rows = [f"| `/api/run?weights=binary`, 512 tokens on {LLM} | skipped: "
                    f"{llm['skipped']} | |"]
    else:
        print(f"{LLM} 512-token /api/run?weights=binary: {llm['http_s']:.2f} s; direct forward "
              f"+ export {llm['direct_s']:.2f} s; ratio {llm['ratio']:.2f} (target <= 1.5: "
              f"{'met' if llm['within_target'] else 'MISSED'}); switching to "
              f"{llm['switch']['model']}: first request {llm['switch']['first_s']:.2f} s "
              f"(loads it), next "
              f"{llm['switch']['again_s']:.3f} s")
        llm_rows = [
            f"| `/api/run?weights=binary`, 512 tokens on {LLM} ({llm['layers']} layers x "
            f"{llm['heads']} heads) / direct forward + export | {llm['http_s']:.2f} s / "
            f"{llm['direct_s']:.2f} s = {llm['ratio']:.2f} | <= 1.5 "
            f"({'met' if llm['within_target'] else 'missed'}) |",
            f"| switching the page to {llm['switch']['model']}: first request (loads it) / the "
            f"next (15 tokens) | "
            f"{llm['switch']['first_s']:.2f} s / {llm['switch']['again_s']:.3f} s | no reload |"]
    print(f"512-token /api/run?weights=binary: {long['http_s']:.2f} s; direct "
          f"{long['direct_s']:.2f} s; ratio {long['ratio']:.2f} (target <= 2: "
          f"{'met' if long['within_target'] else 'MISSED'}); JSON answer {long['json_http_s']:.2f}"
          f" s, ratio {long['json_ratio']:.2f}")
    markdown = "\n".join([
        "# handformer serve: latency and throughput",
        "",
        machine_line(),
        "",
        "Server in its own process (bundled all-MiniLM-L6-v2), httpx over 127.0.0.1; the "
        "reference is the direct call `model(**tokenizer([text]), need_weights=True)` in the "
        "benchmark's process, interleaved with the requests, in the main thread and in a "
        "worker thread (the reference is the faster).",
        "",
        "| measurement | value | target |",
        "|---|---|---|",
        f"| `/api/run`, 15 tokens, p50 / p95 | {short['http_p50_ms']:.1f} / "
        f"{short['http_p95_ms']:.1f} ms | p50 <= {short['budget_ms']:.1f} ms "
        f"({'met' if short['within_target'] else 'missed'}) |",
        f"| direct call, 15 tokens, p50 / p95 (faster of main / worker thread) | "
        f"{short['direct_p50_ms']:.1f} / {short['direct_p95_ms']:.1f} ms | |",
        f"| direct call p50, main thread / worker thread | {short['direct_main_p50_ms']:.1f} / "
        f"{short['direct_thread_p50_ms']:.1f} ms | |",
        f"| ratio p50 request / direct | {short['ratio_p50']:.2f} | <= 1.5 x + 10 ms |",
        f"| `/api/run?weights=binary` (the page's request), 15 tokens, p50 / p95 | "
        f"{short['binary_p50_ms']:.1f} / {short['binary_p95_ms']:.1f} ms | |",
        f"| requests/s, 8 concurrent clients | {rps['clients_8']:.1f} | |",
        f"| requests/s, 1 client | {rps['clients_1']:.1f} | |",
        f"| `/api/run?weights=binary` (the page's request), 512 tokens / direct | "
        f"{long['http_s']:.2f} s / {long['direct_s']:.2f} s = {long['ratio']:.2f} | <= 2 "
        f"({'met' if long['within_target'] else 'missed'}) |",
        f"| `/api/run` (JSON, weights as base64), 512 tokens / direct | "
        f"{long['json_http_s']:.2f} s / {long['direct_s']:.2f} s = {long['json_ratio']:.2f} | |",
        *llm_rows,
        "",
        "A request includes tokenization, the forward pass with weights, the viewer data "
        "(8-bit weights, 18.9 MB at 512 tokens) and the answer read by the client. "
        "`?weights=binary` sends the weights as raw bytes after a JSON header (the client gets "
        "the JSON as a dict and the weights as a uint8 array without a copy); the default "
        "JSON answer carries them as base64 (a third larger, encoded and parsed). Other "
        "processes may share the CPU while this runs (load average "
        f"{load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on "
        f"{os.cpu_count()} CPUs); see the individual runs in the JSON file.",
        "",
    ])
    write_results("serve", {"machine": machine(), "run_15": short, "requests_per_s": rps,
                            "run_512": long, "run_512_llm": llm,
                            "load_average": [load_start, os.getloadavg()[0]]}, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
