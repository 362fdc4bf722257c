"""``handformer serve``: a small local web app on a real model (Starlette on uvicorn).

* :class:`ModelState` - the loaded model and its per-attention-kind views (shared weights).
* :func:`create_app` - the ASGI app: the viewer page, ``/static/`` and the JSON API.
* :mod:`handformer.serve.compute` - what each endpoint computes, callable from Python.
* :mod:`handformer.serve.wire` - the answers' formats: JSON, or ``?weights=binary`` (a JSON
  header, then the 8-bit weights as raw bytes) and :func:`~handformer.serve.wire.read_binary`.

Needs the optional extra: ``pip install handformer[serve]``.
"""

from handformer.serve.app import create_app, require_starlette
from handformer.serve.state import AttentionChoice, ModelState

__all__ = ["create_app", "require_starlette", "ModelState", "AttentionChoice"]
