"""``handformer serve``: the live web app on a model (the viewer page + a JSON API).

Binds ``--host`` (default 127.0.0.1: only this machine can connect; any other host prints a
warning) and ``--port`` (default 8000; 0 picks a free port), prints the URL, and serves until
Ctrl+C / SIGTERM, which stop it within about a second. A port in use is a one-line error
with exit code 2. Needs ``pip install handformer[serve]`` (Starlette and uvicorn).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from functools import partial

from handformer.commands.common import (
    UsageError,
    add_device_argument,
    is_causal_model,
    resolve_device,
)

NAME = "serve"
HELP = "Serve a live web app: type text, see the attention, ablate heads, generate."

LOOPBACK = ("127.0.0.1", "localhost", "::1")
GRACE_S = 0.5  # seconds open connections get at shutdown


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="MODEL", action="append", default=None,
                        help="BERT-family folder (default: the bundled all-MiniLM-L6-v2), or a "
                             "causal LM (adds generation): a GPT-2 / Llama / Mistral / Qwen / "
                             "Gemma / handformer train folder, a .gguf file or a shipped name; "
                             "give it several times to offer several models (the first is "
                             "loaded at start, the others when the page picks them; "
                             "all-MiniLM-L6-v2 names the bundled encoder)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8000,
                        help="port to listen on (default 8000; 0 = any free port)")
    parser.add_argument("--dictionary", "--sae", metavar="PATH", action="append", default=None,
                        help="a sparse autoencoder of the first model (a folder or file "
                             "load_dictionary reads: SAELens, Gemma Scope, sparsify, "
                             "handformer train-sae); adds the page's Features view; give it "
                             "several times for several")
    parser.add_argument("--graph", metavar="FILE.json", action="append", default=None,
                        help="an attribution graph to explore on the page (the JSON "
                             "save_graph_json or circuit-tracer writes); give it several times "
                             "for several")
    parser.add_argument("--transcoders", metavar="PATH", default=None,
                        help="one transcoder per layer of the first model (a circuit-tracer "
                             "config.yaml, a handformer train-sae --transcoder run folder, or "
                             "a folder of one transcoder per layer): the page computes the "
                             "attribution graph of the text typed in, with feature cards")
    add_device_argument(parser)
    parser.add_argument("--quantize", choices=["int8", "int4"], default=None,
                        help="int8 or 4-bit weights for the causal LMs' linear layers (CPU)")


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (so a port in use fails before the model loads)."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this: a response's header and body writes leave at once
    # instead of the body waiting for the client's delayed ACK (up to 40 ms, Nagle).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UsageError(f"port {port} on {host} is in use; stop the other server or pass "
                             "another --port (0 picks a free one)") from None
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    from handformer.serve.app import require_starlette

    try:
        require_starlette()
    except ImportError as exc:
        raise UsageError(str(exc)) from None
    device = str(resolve_device(args.device))
    from handformer.serve.registry import BUNDLED

    for model in args.model or [None]:  # another model_type: one line naming what is read
        is_causal_model(None if model in ("", BUNDLED) else model, "serve")
    files = _graph_files(args)
    loopback = args.host in LOOPBACK
    if not loopback:
        sys.stderr.write(f"warning: --host {args.host} lets other machines reach this server "
                         "(no authentication); use the default 127.0.0.1 unless you mean it\n")
    sock = _bind(args.host, args.port)
    try:
        import uvicorn

        from handformer.serve import create_app
        from handformer.serve.registry import ModelRegistry
        from handformer.serve.state import ModelState

        port = sock.getsockname()[1]
        try:
            registry = ModelRegistry(args.model or [None], device=device, loader=partial(
                ModelState, quantize=args.quantize))
        except ValueError as exc:
            if "give each model only once" not in str(exc):
                raise
            raise UsageError(f"--model: {exc}") from None
        state = registry.first
        features = None
        if args.dictionary:
            from handformer.serve.features import load_feature_set

            try:
                features = load_feature_set(args.dictionary, state)
            except ValueError as exc:
                raise UsageError(f"--dictionary {exc}") from None
        graphs = _graph_set(args, state, files)
        hosts = None
        if loopback:
            hosts = {f"{h}:{port}" for h in ("127.0.0.1", "localhost", "[::1]")}
        app = create_app(registry, allowed_hosts=hosts, features=features, graphs=graphs)
        config = uvicorn.Config(app, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=GRACE_S, access_log=False)
        server = _server_class(uvicorn)(config)
        # From the moment the URL is printed, a signal stops the server cleanly.
        old = {sig: signal.signal(sig, server.stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        shown = f"[{args.host}]" if ":" in args.host else args.host
        print(f"handformer serve: {state.name} ({'causal LM' if state.causal else 'encoder'}, "
              f"{state.num_layers} layers x {state.num_heads} heads) at "
              f"http://{shown}:{port}/  (Ctrl+C stops it)", flush=True)
        if len(registry.names()) > 1:
            print(f"handformer serve: models {', '.join(registry.names())} (loaded when "
                  "picked on the page)", flush=True)
        try:
            server.run(sockets=[sock])
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
    finally:
        sock.close()
    print(f"handformer serve: stopped{server.stop_reason}", flush=True)
    if server.stop_reason:
        # Stopped by a signal: the socket is closed and the output flushed; nothing is left
        # to clean up. Skip the interpreter's teardown, which with torch loaded alone takes
        # 1-2 s on a busy machine, so the process ends as soon as it said it stopped.
        sys.stderr.flush()
        os._exit(0)
    return 0


def _graph_files(args: argparse.Namespace) -> list[tuple[str, object]]:
    """``--graph``'s files, read before any model loads (a file that is not a graph is a
    UsageError naming the file and the field)."""
    from handformer.features import load_graph_json

    files = []
    for path in args.graph or []:
        try:
            files.append((os.path.basename(path), load_graph_json(path)))
        except ValueError as exc:  # GraphFileError names the file and the field
            raise UsageError(f"--graph {' '.join(str(exc).split())}") from None
    return files


def _graph_set(args: argparse.Namespace, state: object, files: list[tuple[str, object]]
               ) -> object:
    """The graphs of ``--graph`` and the transcoders of ``--transcoders`` (None without
    either); transcoders that do not fit the model (or a graph that does not fit them) are a
    UsageError."""
    if not files and not args.transcoders:
        return None
    from handformer.features.transcoder_set import load_transcoder_set
    from handformer.serve.graph import GraphSet

    transcoders = None
    if args.transcoders:
        try:
            transcoders = load_transcoder_set(args.transcoders, n_layers=state.num_layers
                                              if state.causal else None)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--transcoders {' '.join(str(exc).split())}") from None
    try:
        return GraphSet(state, transcoders, files)
    except ValueError as exc:
        flag = "--graph" if transcoders is not None and str(exc).split(":")[0] in {
            name for name, _ in files} else "--transcoders"
        raise UsageError(f"{flag} {' '.join(str(exc).split())} (model {state.name})") from None


def _server_class(uvicorn: object) -> type:
    """uvicorn's server, stopping on SIGINT / SIGTERM without re-raising the signal after the
    shutdown (uvicorn does, which would turn a clean stop into a KeyboardInterrupt)."""

    class Server(uvicorn.Server):
        stop_reason = ""

        def stop(self, sig: int, frame: object) -> None:
            """The SIGINT / SIGTERM handler: shut down (at once on a second signal)."""
            self.stop_reason = f" ({signal.Signals(sig).name})"
            self.force_exit = self.should_exit
            self.should_exit = True

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {sig: signal.signal(sig, self.stop) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    return Server
