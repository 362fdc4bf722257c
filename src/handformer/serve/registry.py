"""The models a server offers: ``handformer serve --model A --model B ...``.

The first model is loaded at start-up (the page is built around it); the others when a
request first names them (``"model": NAME`` in the body, ``?model=NAME`` on ``/api/model``),
each at most once at a time, in the worker thread of that request. A model that fails to
load is reported in that request's answer (and in ``/api/models``), and the server keeps
serving the others. At most :data:`MAX_LOADED` models stay in memory; the one used least
recently (never the first) is dropped when another is loaded. Switching to a loaded model
costs nothing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from handformer.serve.state import ModelState
from handformer.serve.validation import RequestError

__all__ = ["ModelRegistry", "ModelLoadError", "MAX_LOADED", "BUNDLED", "display_name"]

MAX_LOADED = 3  # models held in memory at once
BUNDLED = "all-MiniLM-L6-v2"  # the bundled encoder: ``--model all-MiniLM-L6-v2`` (or none)


class ModelLoadError(RuntimeError):
    """A model named by a request could not be loaded (the message says why)."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        super().__init__(f"model {name!r} could not be loaded: {' '.join(reason.split())}")


def display_name(source: str | None) -> str:
    """The name a model is offered under (and answers with): the bundled model's name, a
    folder's or file's name, or a shipped name as given."""
    if source is None or source in ("", BUNDLED):
        return BUNDLED
    path = Path(source)
    if path.exists():
        return path.resolve().name or str(source)
    return str(source)


class ModelRegistry:
    """The server's models, by name, loaded on first use.

    Args:
        sources: what ``--model`` named, in order (None = the bundled encoder); the first is
            the default.
        device: where models run.
        loader: ``loader(source, device=...) -> ModelState`` (tests pass their own).
        first: the first model, already loaded (else it is loaded here).

    Raises:
        ValueError: for no sources, or two sources with the same name.
        FileNotFoundError, ValueError: from loading the first model.
    """

    def __init__(self, sources: Sequence[str | None], *, device: str = "cpu",
                 loader: Callable[..., ModelState] = ModelState,
                 first: ModelState | None = None) -> None:
        if not sources:
            raise ValueError("give at least one model")
        self.sources: dict[str, str | None] = {}
        sources = [None if s in ("", BUNDLED) else s for s in sources]
        for source in sources:
            name = display_name(source)
            if name in self.sources:
                raise ValueError(f"two models are named {name!r} ({self.sources[name]} and "
                                 f"{source}); give each model only once")
            self.sources[name] = source
        self.device, self.loader = device, loader
        self.default = next(iter(self.sources))
        self._loaded: OrderedDict[str, ModelState] = OrderedDict()
        self._errors: dict[str, str] = {}
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {name: threading.Lock()
                                                    for name in self.sources}
        state = first if first is not None else loader(sources[0], device=device)
        state.name = self.default  # answers name the model as the picker does
        self._loaded[self.default] = state

    @classmethod
    def single(cls, state: ModelState) -> ModelRegistry:
        """A registry of one model that is already loaded."""
        registry = cls.__new__(cls)
        registry.sources = {state.name: None}
        registry.device, registry.loader = str(state.device), ModelState
        registry.default = state.name
        registry._loaded = OrderedDict({state.name: state})
        registry._errors = {}
        registry._lock = threading.Lock()
        registry._loading = {state.name: threading.Lock()}
        return registry

    @property
    def first(self) -> ModelState:
        """The default model (always loaded)."""
        return self._loaded[self.default]

    def names(self) -> list[str]:
        """Every model's name, the default first."""
        return list(self.sources)

    def check_name(self, name: object) -> str:
        """``name`` as a model name of this server (None: the default).

        Raises:
            RequestError: for a name that is not one of the server's models.
        """
        if name is None:
            return self.default
        if not isinstance(name, str) or name not in self.sources:
            shown = name if isinstance(name, str) else type(name).__name__
            raise RequestError("model", f"{str(shown)[:60]!r} is not served here; models: "
                                        f"{', '.join(self.sources)}")
        return name

    def get(self, name: object = None) -> ModelState:
        """The model ``name`` (None: the default), loaded now if it is not yet.

        Raises:
            RequestError: for an unknown name.
            ModelLoadError: if loading fails (now or before).
        """
        name = self.check_name(name)
        with self._lock:
            if name in self._loaded:
                self._loaded.move_to_end(name)
                return self._loaded[name]
            if name in self._errors:
                raise ModelLoadError(name, self._errors[name])
        with self._loading[name]:  # one load of a model at a time; others wait for it
            with self._lock:
                if name in self._loaded:
                    return self._loaded[name]
            try:
                state = self.loader(self.sources[name], device=self.device)
            except Exception as exc:  # noqa: BLE001 - any failure is reported, not fatal
                reason = f"{type(exc).__name__}: {exc}"
                with self._lock:
                    self._errors[name] = reason
                raise ModelLoadError(name, reason) from None
            state.name = name
            with self._lock:
                self._loaded[name] = state
                self._evict()
            return state

    def _evict(self) -> None:
        while len(self._loaded) > MAX_LOADED:
            for name in self._loaded:
                if name != self.default:
                    del self._loaded[name]
                    break

    def status(self) -> list[dict[str, object]]:
        """Per model: its name, whether it is loaded, and its load error, if any."""
        with self._lock:
            return [{"name": name, "default": name == self.default,
                     "loaded": name in self._loaded, "error": self._errors.get(name)}
                    for name in self.sources]
