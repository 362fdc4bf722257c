"""Helpers for the ``handformer serve`` tests: the real server in a subprocess, a tiny causal
LM folder, and references computed directly in Python."""

from __future__ import annotations

import base64
import copy
import os
import signal
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
SEED = "The animal didn't cross the street because it was too tired"
CHARS = list("abcdefghijklmnopqrstuvwxyz .,'T")


class Server:
    """``handformer serve`` running in a subprocess; ``url`` is what it printed."""

    def __init__(self, *args: str, timeout: float = 120.0) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "handformer", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        line = self.proc.stdout.readline()  # blocks until the URL is printed (or exit)
        if "http://" not in line:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r} {self.proc.stderr.read()[-2000:]}")
        self.banner = line
        self.url = line.split("http://", 1)[1].split()[0].rstrip("/")
        self.url = "http://" + self.url
        self.host, port = self.url[len("http://"):].rsplit(":", 1)
        self.port = int(port)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> tuple[int, float]:
        """Send ``sig``; the exit code and the seconds until the process ended."""
        start = time.perf_counter()
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        return code, time.perf_counter() - start

    def close(self) -> None:
        if self.proc.poll() is None:
            self.stop()
        for stream in (self.proc.stdout, self.proc.stderr):
            stream.close()


def raw_request(port: int, request: bytes) -> tuple[int, bytes]:
    """Send bytes as they are (no client-side path clean-up); the status and the body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def viewer_weights(payload: dict) -> np.ndarray:
    """The ``(N, H, L_q, L_k)`` weights a viewer payload holds (8-bit, de-quantised)."""
    raw = base64.b64decode(payload["data"])
    if payload["encoding"] == "deflate":
        raw = zlib.decompress(raw)
    N, H, L = payload["layers"], payload["heads"], len(payload["tokens"])
    q = np.frombuffer(raw, dtype=np.uint8).reshape(N, H, L, L).astype(np.float64)
    scale = np.asarray(payload["scale"], dtype=np.float64).reshape(N, H, 2)
    lo, hi = scale[..., :1, None], scale[..., 1:, None]
    return lo + q / payload["levels"] * (hi - lo)


def zero_heads(model: torch.nn.Module, heads: list[tuple[int, int]]) -> torch.nn.Module:
    """A copy of ``model`` whose ``heads`` are removed by zeroing their columns of the output
    projection: the same as zeroing the heads' outputs, computed without any hook."""
    model = copy.deepcopy(model)
    layers = model.blocks
    with torch.no_grad():
        for layer, head in heads:
            attn = layers[layer].attn
            D = attn.out_proj.weight.shape[1] // attn.num_heads
            attn.out_proj.weight[:, head * D:(head + 1) * D] = 0
    return model


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double()[None], b.double()[None])[0])


def causal_folder(path: Path, *, attention: str = "full", **options: object) -> Path:
    """A tiny random CausalLM with a character vocabulary, saved like a training run."""
    import handformer as hf
    from handformer.train.data import CharVocab

    torch.manual_seed(0)
    vocab = CharVocab(CHARS)
    model = hf.CausalLM(hf.CausalLMConfig(vocab_size=len(vocab), max_len=48, d_model=32,
                                          num_heads=4, num_layers=2, d_ff=64,
                                          attention=attention, **options))
    with torch.no_grad():  # larger weights than the init: heads matter, outputs differ
        for p in model.parameters():
            p.mul_(4.0)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    vocab.save(path / "vocab.json")
    return path
