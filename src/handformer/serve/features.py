"""The page's Features view: sparse autoencoders on the served model, read, explained and
changed live.

``handformer serve --model M --dictionary PATH`` loads dictionaries
(:func:`~handformer.features.load_dictionary`) for the first model. For a text, the view asks
which features are most active at each token; a click on one opens its card (the contexts where
it fired most, in the texts this server has seen and a small built-in sample, and the tokens its
decoder row promotes and suppresses through the unembedding), and ablates it (zeroed) or steers
with it (``coefficient · W_dec[f]`` added at every position), showing the next-token
distribution and a short greedy continuation with and without the change.

Nothing here changes the model's modules: activations are read and edited with
:func:`~handformer.inspect.hooks`, which live for one call in the calling thread only, so
concurrent requests each get their own answer (:func:`~handformer.features.attach` would swap
modules every thread sees). The dictionary is never spliced: the model runs on its own
activation, and ablating feature ``f`` subtracts exactly its contribution
``acts[f] · W_dec[f] / s`` (what zeroing ``hook_sae_acts_post[f]`` does with the error term
spliced in).

Shape letters: ``L`` tokens, ``E`` the hook's width, ``F`` features, ``K`` kept per token,
``V`` vocabulary.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from handformer.features.dictionary import Dictionary, Transcoder

__all__ = ["FeatureSet", "Record", "SAMPLES", "load_feature_set", "active_features",
           "feature_card", "records_card", "logit_rows", "sparse_top", "intervene", "KEEP",
           "MAX_SEEN"]

KEEP = 32  # features kept per token for the cards (the largest; TopK SAEs have k of them)
MAX_SEEN = 32  # texts remembered per dictionary for the cards' contexts
AROUND = 10  # tokens shown each side of a context's activating token
# The built-in sample every card also looks in: prose, code, Chinese, numbers, markup.
SAMPLES = (
    "The river rose through the night, and by morning the bridge was gone. The villagers "
    "gathered on the hill and watched the water carry away fences, boats and a red door.",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n\nprint(mean([1, 2, 3]))",
    "今天天气很好，我们去公园散步。孩子们在草地上跑来跑去，老人坐在长椅上聊天。",
    "这本书的内容很丰富，但是翻译有些问题：有的句子读起来不通顺。总的来说，还是值得一读！",
    "On 12 March 2024 the price rose from 3.50 to 4.25 dollars, an increase of 21 percent; "
    "by June it was 4.80, and by December 5.10.",
    "<ul>\n  <li><a href=\"/home\">Home</a></li>\n  <li><a href=\"/about\">About us</a></li>\n"
    "</ul>",
    "Dear Anna, thank you for your letter. I was so happy to hear about the new job! "
    "Write again soon. With love, Maria",
    "import torch\nx = torch.randn(3, 4)\ny = x @ x.T  # (3, 3)\nassert y.shape == (3, 3)",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It happens "
    "in the chloroplasts of plant cells.",
    "他说：“明天见。”她笑了笑，没有回答。窗外的雨一直下着，街上几乎没有人。",
)


@dataclass
class Record:
    """One text's sparse feature activations, for the cards.

    Attributes:
        ids: the token ids; source: ``"sample"`` or ``"seen"``.
        indices, values: ``(L, K)`` the ``K`` largest activations at each token (zeros where
            fewer are active).
    """

    ids: list[int]
    source: str
    indices: Tensor
    values: Tensor


class FeatureSet:
    """The dictionaries a server offers, for one model, and what they have seen.

    Args:
        model_name: the served model they belong to (the first ``--model``).
        dictionaries: ``{name: sparse autoencoder}`` in the order given; each has a
            ``hook_name``.

    Raises:
        ValueError: for no dictionaries, a transcoder or a dictionary without a hook name.
    """

    def __init__(self, model_name: str, dictionaries: dict[str, Dictionary]) -> None:
        if not dictionaries:
            raise ValueError("give at least one dictionary")
        for name, d in dictionaries.items():
            if isinstance(d, Transcoder) or not isinstance(d, Dictionary):
                raise ValueError(f"{name}: the Features view takes sparse autoencoders; this is "
                                 f"a {type(d).__name__} (a transcoder reads one hook and "
                                 "writes another: splice it in Python with attach)")
            if d.hook_name is None:
                raise ValueError(f"{name}: the dictionary does not say which hook it reads "
                                 "(hook_name is None); save it with hook_name set")
        self.model_name = model_name
        self.dictionaries = dict(dictionaries)
        self._seen: dict[str, deque[Record]] = {n: deque(maxlen=MAX_SEEN) for n in dictionaries}
        self._samples: dict[str, list[Record]] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        """The dictionaries' names, the default first."""
        return list(self.dictionaries)

    def describe(self) -> list[dict[str, object]]:
        """What ``GET /api/features`` lists for each dictionary."""
        return [{"name": n, "hook": d.hook_name, "d_in": d.d_in, "d_sae": d.d_sae,
                 "activation": d.activation, "k": d.k} for n, d in self.dictionaries.items()]

    def check_fits(self, model: torch.nn.Module) -> None:
        """Run ``model`` on two tokens and check every dictionary's hook exists and has its
        width.

        Args:
            model: the served model.

        Raises:
            ValueError: naming the dictionary, the hook and both widths.
        """
        from handformer.inspect.points import hook_points

        points = hook_points(model)
        ids = torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device)
        for name, d in self.dictionaries.items():
            if d.hook_name not in points:
                raise ValueError(f"{name}: the model has no hook point {d.hook_name!r} (the "
                                 "dictionary's hook_name); run handformer's inspect hook_points "
                                 "for the names")
            x, _ = read_hook(model, d.hook_name, ids)
            if x.shape[-1] != d.d_in:
                raise ValueError(f"{name}: the dictionary reads d_in = {d.d_in} at "
                                 f"{d.hook_name}, the model's activation there has width "
                                 f"{x.shape[-1]}: a dictionary of another model")

    def remember(self, name: str, record: Record) -> None:
        """Keep ``record`` among the texts seen (the oldest goes past :data:`MAX_SEEN`).

        Args:
            name: the dictionary.
            record: the text's ids and sparse activations.
        """
        with self._lock:
            seen = self._seen[name]
            if all(r.ids != record.ids for r in seen):
                seen.append(record)

    def records(self, name: str, state: object) -> list[Record]:
        """The built-in samples' records (computed once per dictionary) and the texts seen.

        Args:
            name: the dictionary.
            state: the served model (:class:`~handformer.serve.state.ModelState`).

        Returns:
            The samples' records, then the texts seen, oldest first.
        """
        with self._lock:
            samples = self._samples.get(name)
        if samples is None:
            samples = [r for r in (_sample_record(state, self.dictionaries[name], text)
                                   for text in SAMPLES) if r is not None]
            with self._lock:
                self._samples[name] = samples
        with self._lock:
            return samples + list(self._seen[name])


def load_feature_set(paths: Sequence[str], state: object) -> FeatureSet:
    """Load ``paths`` (``--dictionary``) for the served model ``state`` and check they fit.

    Args:
        paths: dictionary folders or files, as :func:`~handformer.features.load_dictionary`
            reads them.
        state: the served model (:class:`~handformer.serve.state.ModelState`, causal).

    Returns:
        The :class:`FeatureSet`, named by the folders (or files) given.

    Raises:
        ValueError: naming the path: an encoder model, a file that is no dictionary, a
            transcoder, two dictionaries of one name, or one that does not fit the model.
    """
    from handformer.features import load_dictionary

    if not state.causal:
        raise ValueError(f"the Features view needs a causal language model; {state.name} is an "
                         "encoder")
    dictionaries: dict[str, Dictionary] = {}
    for path in paths:
        p = Path(path)
        name = p.stem if p.is_file() else (p.resolve().name or str(p))
        if name in dictionaries:
            raise ValueError(f"{path}: two dictionaries are named {name!r}; give each once")
        try:
            d = load_dictionary(p)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: {' '.join(str(exc).split())}") from None
        if isinstance(d, list):
            raise ValueError(f"{path}: a transcoder set; the Features view takes sparse "
                             "autoencoders")
        dictionaries[name] = d.to(state.device).eval()
    try:
        features = FeatureSet(state.name, dictionaries)
        features.check_fits(state.model)
    except ValueError as exc:
        raise ValueError(f"{exc} (model {state.name})") from None
    return features


def read_hook(model: torch.nn.Module, hook: str, ids: Tensor, *,
              edit: object = None) -> tuple[Tensor, Tensor]:
    """Run ``model`` on ``ids``; the activation at ``hook`` and the logits.

    Args:
        model: a handformer causal LM.
        hook: the hook point to read.
        ids: ``(1, L)`` token ids.
        edit: a hook function ``edit(tensor, name)`` that replaces the activation there (the
            value returned is the one read before it), or None.

    Returns:
        ``(activation (L, E), logits (L, V))``.
    """
    from handformer.inspect import hooks

    kept: list[Tensor] = []

    def keep(t: Tensor, name: str) -> Tensor | None:
        kept.append(t.detach())
        return edit(t, name) if edit is not None else None

    with torch.inference_mode(), hooks(model, {hook: keep}):
        logits = model(input_ids=ids).logits
    return kept[0][0], logits[0]


def sparse_top(acts: Tensor) -> tuple[Tensor, Tensor]:
    """The :data:`KEEP` largest activations at each token: ``(L, K)`` indices and values.

    Args:
        acts: ``(L, F)`` feature activations.
    """
    top = acts.float().topk(min(KEEP, acts.shape[-1]), dim=-1)
    values = top.values.clamp(min=0)
    return top.indices.to(torch.int32), values


def _sample_record(state: object, d: Dictionary, text: str) -> Record | None:
    try:
        ids = state.tokenizer.encode(text)
    except ValueError:  # a character vocabulary without these letters
        return None
    ids = ids[:state.max_tokens]
    if len(ids) < 2:
        return None
    x, _ = read_hook(state.model, d.hook_name,
                     torch.tensor([ids], device=state.device))  # (L, E)
    with torch.inference_mode():
        indices, values = sparse_top(d.encode(x))
    return Record(ids, "sample", indices.cpu(), values.cpu())


def active_features(state: object, features: FeatureSet, name: str, ids: list[int],
                    top: int) -> dict[str, object]:
    """The ``top`` most active features at each token of ``ids`` (remembered for the cards).

    Args:
        state: the served model.
        features: the dictionaries.
        name: which dictionary.
        ids: the token ids.
        top: features listed per token.

    Returns:
        ``{"active": [[{"feature", "value"}, ...] per token], "l0": [per token],
        "next_token": [...]}``: only active (positive) features are listed.
    """
    from handformer.serve.compute import _top_tokens

    d = features.dictionaries[name]
    t = torch.tensor([ids], device=state.device)  # (1, L)
    x, logits = read_hook(state.model, d.hook_name, t)
    with torch.inference_mode():
        acts = d.encode(x).float()  # (L, F)
    indices, values = sparse_top(acts)
    features.remember(name, Record(list(ids), "seen", indices.cpu(), values.cpu()))
    shown = acts.topk(min(top, acts.shape[-1]), dim=-1)  # (L, top)
    active = [[{"feature": int(f), "value": round(float(v), 4)}
               for f, v in zip(row_i, row_v, strict=True) if v > 0]
              for row_i, row_v in zip(shown.indices.tolist(), shown.values.tolist(),
                                      strict=True)]
    return {"active": active, "l0": (acts > 0).sum(-1).tolist(),
            "next_token": _top_tokens(state, logits[-1], t)}


def feature_card(state: object, features: FeatureSet, name: str, feature: int, *,
                 contexts: int = 8, tokens: int = 10) -> dict[str, object]:
    """Feature ``feature``'s card: its top-activating contexts (position 0, the sink, left
    out), its density over those tokens, and the tokens its decoder row promotes and
    suppresses through the final norm's weight and the unembedding.

    Args:
        state: the served model.
        features: the dictionaries.
        name: which dictionary.
        feature: the feature index.
        contexts: contexts shown, largest first.
        tokens: tokens listed each way (promoted, suppressed).

    Returns:
        ``{"contexts": [{"before", "token", "after", "activation", "source"}], "density",
        "tokens_seen", "texts_seen", "promoted", "suppressed"}`` (``promoted`` /
        ``suppressed`` None where the dictionary's width is not the residual stream's).
    """
    d = features.dictionaries[name]
    return records_card(state, features.records(name, state), feature,
                        contexts=contexts) | logit_rows(state, d, feature, tokens=tokens)


def records_card(state: object, records: Sequence[Record], feature: int, *,
                 contexts: int = 8) -> dict[str, object]:
    """The contexts part of a card, from sparse activation records: where ``feature`` fired
    most (position 0 left out), and its density over the records' tokens.

    Args:
        state: the served model (its tokenizer).
        records: the texts' sparse activations.
        feature: the feature index.
        contexts: contexts shown, largest first.

    Returns:
        ``{"contexts", "density", "tokens_seen", "texts_seen"}``.
    """
    from handformer.tokenizers.labels import token_labels

    found: list[tuple[float, Record, int]] = []
    fired = seen_tokens = seen_texts = 0
    for record in records:
        hit = (record.indices[1:] == feature) & (record.values[1:] > 0)  # (L-1, K)
        where = hit.any(-1).nonzero().flatten()
        fired += len(where)
        seen_tokens += len(record.ids) - 1
        seen_texts += record.source == "seen"
        for pos in where.tolist():
            value = float((record.values[pos + 1] * hit[pos]).sum())
            found.append((value, record, pos + 1))
    found.sort(key=lambda item: -item[0])
    tok = state.tokenizer
    shown = []
    for value, record, pos in found[:contexts]:
        lo = max(pos - AROUND, 1)
        # The marked token as the page labels tokens: a byte of a character says so
        # ("读·2/3", "<0x83>"), where decoding it alone would give U+FFFD.
        label = token_labels(tok, record.ids[lo:pos + 1 + AROUND])[pos - lo]
        shown.append({"before": tok.decode(record.ids[lo:pos]), "token": label,
                      "after": tok.decode(record.ids[pos + 1:pos + 1 + AROUND]),
                      "activation": round(value, 4), "source": record.source})
    return {"contexts": shown, "density": fired / seen_tokens if seen_tokens else 0.0,
            "tokens_seen": seen_tokens, "texts_seen": seen_texts}


def logit_rows(state: object, d: Dictionary, feature: int, *, tokens: int = 10
               ) -> dict[str, object]:
    """The tokens feature ``feature``'s decoder row promotes and suppresses
    (:func:`~handformer.features.feature_logit_effects`).

    Args:
        state: the served model.
        d: the dictionary (an SAE or a transcoder).
        feature: the feature index.
        tokens: tokens listed each way.

    Returns:
        ``{"promoted", "suppressed"}``: lists of ``{"token", "value"}``, or None where the
        dictionary's width is not the residual stream's.
    """
    from handformer.features.analysis import feature_logit_effects

    lm_head = getattr(state.model, "lm_head", None)
    if lm_head is None or d.d_out != lm_head.weight.shape[1]:
        return {"promoted": None, "suppressed": None}
    effects = feature_logit_effects(state.model, d, feature, k=tokens, tokenizer=state.tokenizer)
    return {"promoted": [{"token": t, "value": round(float(v), 4)} for t, v in
                         zip(effects.top_tokens, effects.top_values, strict=True)],
            "suppressed": [{"token": t, "value": round(float(v), 4)} for t, v in
                           zip(effects.bottom_tokens, effects.bottom_values, strict=True)]}


def ablation_hook(d: Dictionary, feature: int) -> object:
    """A hook function that removes feature ``feature``'s contribution
    ``acts[f] · W_dec[f] / s`` from the activation it is given.

    Args:
        d: the sparse autoencoder.
        feature: the feature index.
    """
    def ablate(x: Tensor, name: str) -> Tensor:
        s = d.scale(x.to(d.dtype))
        acts = d.encode(x)  # (..., F)
        part = acts[..., feature, None] * d.W_dec[feature]  # (..., E)
        if s is not None:
            part = part / s
        return x - part.to(x.dtype)
    return ablate


def steering_hook(d: Dictionary, feature: int, coefficient: float) -> object:
    """A hook function that adds ``coefficient · W_dec[feature]`` at every position.

    Args:
        d: the dictionary.
        feature: the feature index.
        coefficient: how much of its decoder row.
    """
    direction = (float(coefficient) * d.W_dec[feature]).detach()  # (E,)

    def steer(x: Tensor, name: str) -> Tensor:
        return x + direction.to(device=x.device, dtype=x.dtype)
    return steer


def _greedy(state: object, ids: list[int], hook: str, edit: object, n: int) -> list[int]:
    """``n`` greedy tokens after ``ids`` with ``edit`` at ``hook`` (every step, every position)."""
    out = list(ids)
    for _ in range(n):
        _, logits = read_hook(state.model, hook, torch.tensor([out], device=state.device),
                              edit=edit)
        out.append(int(logits[-1].argmax()))
    return out[len(ids):]


def intervene(state: object, features: FeatureSet, name: str, ids: list[int], feature: int,
              *, mode: str, coefficient: float, new_tokens: int) -> dict[str, object]:
    """The next token (and ``new_tokens`` greedy tokens) with and without the change:
    feature ``feature`` ablated (``mode="ablate"``) or ``coefficient · W_dec[f]`` added
    (``mode="steer"``) at the dictionary's hook, every position.

    Args:
        state: the served model.
        features: the dictionaries.
        name: which dictionary.
        ids: the token ids.
        feature: the feature index.
        mode: ``"ablate"`` or ``"steer"``.
        coefficient: steering's coefficient (unused when ablating).
        new_tokens: greedy tokens generated each way (fewer where the context ends).

    Returns:
        ``{"clean", "changed"}`` (top next tokens), ``"kl_divergence"`` (clean ‖ changed),
        ``"clean_text"``, ``"changed_text"`` (the continuations), ``"notices"``.
    """
    from handformer.serve.compute import _top_tokens

    d = features.dictionaries[name]
    edit = ablation_hook(d, feature) if mode == "ablate" else steering_hook(
        d, feature, coefficient)
    t = torch.tensor([ids], device=state.device)  # (1, L)
    _, clean = read_hook(state.model, d.hook_name, t)
    _, changed = read_hook(state.model, d.hook_name, t, edit=edit)
    p, q = torch.log_softmax(clean[-1].double(), -1), torch.log_softmax(changed[-1].double(), -1)
    notices = []
    room = state.context - len(ids)
    if new_tokens > room:
        notices.append(f"new_tokens: the text has {len(ids)} tokens of the model's "
                       f"{state.context}; {max(room, 0)} continue it")
        new_tokens = max(room, 0)
    tok = state.tokenizer
    return {"clean": _top_tokens(state, clean[-1], t),
            "changed": _top_tokens(state, changed[-1], t),
            "kl_divergence": float((p.exp() * (p - q)).sum()),
            "clean_text": tok.decode(_greedy(state, ids, d.hook_name, None, new_tokens)),
            "changed_text": tok.decode(_greedy(state, ids, d.hook_name, edit, new_tokens)),
            "notices": notices}
