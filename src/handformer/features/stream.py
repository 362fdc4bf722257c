"""Activations streamed from a model: token windows in, one hook's rows out, nothing stored.

A corpus is tokenized once into one flat id tensor (documents joined by the end-of-text
token; ~4 bytes a token, 9 MB for 2.3 M tokens). A batch is ``B`` windows of ``L`` tokens at
offsets drawn by a generator seeded from ``(seed, step)``: the data of a step is a function of
the step alone (as in :mod:`handformer.train.data`), so a resumed run sees exactly the
windows an uninterrupted run would. Each window starts with the beginning-of-text token where
the tokenizer has one.

:class:`ActivationReader` runs the model on a batch and keeps only the hooks asked for, at
every position but the first (the attention sink: its activation's norm is many times the
others' and would dominate any reconstruction loss). It stops the forward pass after the last
block it needs (no later layers, no unembedding). For a transcoder it reads the MLP's input
(the normalised residual stream, what ``blocks[i].mlp`` receives) beside its output
(``blocks.{i}.hook_mlp_out``).

Shape letters: ``B`` windows, ``L`` window length, ``N`` rows (``B * (L - 1)``), ``E`` model
dim.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from handformer.features.corpus import as_corpus
from handformer.inspect.points import hook_points, unknown_name_message

__all__ = ["tokenize_corpus", "TokenWindows", "ActivationReader", "Site", "parse_sites",
           "mlp_output_hook", "corpus_ids", "windows_for", "split_windows", "typical_rows",
           "typical_mask"]

_MLP_OUT = re.compile(r"^blocks\.(\d+)\.hook_mlp_out$")
_LAYER = re.compile(r"^blocks\.(\d+)\.")


def mlp_output_hook(layer: int) -> str:
    """The hook a transcoder of ``layer`` is attached at: ``blocks.{layer}.hook_mlp_out``."""
    return f"blocks.{layer}.hook_mlp_out"


def typical_mask(x: Tensor, y: Tensor, factor: float) -> Tensor:
    """``(N,)`` True where the row's norms in ``x`` ``(N, E)`` and ``y`` ``(N, F)`` are both at
    most ``factor`` times their median over the rows (``factor`` 0: every row).

    The other rows carry *massive activations*: a few tokens besides the first (often the first
    newline or full stop of a window) become second attention sinks with activations ~100x the
    median norm (Sun et al. 2024, "Massive activations in large language models"); in
    SmolLM2-135M, one row in ~1,000 at layers 11 and 28. Squared, one such row outweighs the
    rest of a batch.
    """
    keep = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    if factor == 0:
        return keep
    for t in (x, y) if x is not y else (x,):
        norm = t.norm(dim=-1)  # (N,)
        keep &= norm <= factor * norm.median()
    return keep


def typical_rows(x: Tensor, y: Tensor, factor: float) -> tuple[Tensor, Tensor]:
    """The rows of ``x`` and ``y`` that :func:`typical_mask` keeps (the same tensors when it
    keeps them all)."""
    keep = typical_mask(x, y, factor)
    return (x, y) if bool(keep.all()) else (x[keep], y[keep])


def tokenize_corpus(corpus: object, tokenizer: object, *, max_tokens: int | None = None,
                    shuffle_seed: int | None = None, progress: bool = False) -> Tensor:
    """The documents' ids, joined by the end-of-text token, as one ``(T,)`` int64 tensor.

    Args:
        corpus: anything :func:`~handformer.features.corpus.as_corpus` takes.
        tokenizer: a handformer tokenizer (``encode``, ``eos_token_id``).
        max_tokens: stop once this many ids are read (None: the whole corpus).
        shuffle_seed: read the documents in an order shuffled with this seed (so that a
            ``max_tokens`` prefix samples the whole corpus; the texts are held in memory,
            ~12 MB for the offline corpora); None: in the corpus' order.
        progress: show a progress bar (documents) on stderr.

    Raises:
        ValueError: for a corpus that yields no tokens.
    """
    corpus = as_corpus(corpus)
    eos = getattr(tokenizer, "eos_token_id", None)
    chunks: list[Tensor] = []
    total = 0
    docs: object = corpus.documents()
    if shuffle_seed is not None:
        texts = list(docs)
        order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(shuffle_seed))
        docs = (texts[i] for i in order.tolist())
    if progress:
        from tqdm.auto import tqdm

        docs = tqdm(docs, desc=f"tokenizing {corpus.name}", unit="doc", mininterval=0.5)
    for doc in docs:
        ids = list(tokenizer.encode(doc, add_special_tokens=False))
        if eos is not None:
            ids.append(int(eos))
        chunks.append(torch.tensor(ids, dtype=torch.int32))
        total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            break
    if not total:
        raise ValueError(f"corpus {corpus.name!r} gave no tokens")
    return torch.cat(chunks).long()


class TokenWindows:
    """Windows of ``length`` tokens drawn from a flat id tensor, a function of the step.

    Args:
        ids: ``(T,)`` token ids.
        length: tokens per window, the BOS token included.
        bos: the id put first in every window (None: the window is ``length`` corpus tokens).
        seed: the run's seed.

    Raises:
        ValueError: for a window longer than the corpus, or shorter than 2 tokens.
    """

    def __init__(self, ids: Tensor, length: int, *, bos: int | None, seed: int) -> None:
        if not isinstance(length, int) or length < 2:
            raise ValueError(f"context must be an int >= 2 (tokens per window), got {length!r}")
        self.ids, self.length, self.bos, self.seed = ids, length, bos, seed
        self.body = length - (bos is not None)  # corpus tokens per window
        if ids.numel() < self.body:
            raise ValueError(f"the corpus has {ids.numel()} tokens, fewer than one window of "
                             f"context={length}")

    def batch(self, step: int, rows: int) -> Tensor:
        """``(rows, length)`` windows of ``step`` (the same for every call)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.ids.numel() - self.body + 1, (rows,), generator=g)
        offsets = torch.arange(self.body)  # (L',)
        windows = self.ids[starts[:, None] + offsets]  # (B, L')
        if self.bos is not None:
            windows = torch.cat([torch.full((rows, 1), self.bos, dtype=windows.dtype),
                                 windows], dim=1)  # (B, L)
        return windows


@dataclass(frozen=True)
class Site:
    """Where one dictionary reads and writes.

    Attributes:
        at: the hook the dictionary is attached at (an SAE reads and writes there; a
            transcoder writes there, ``blocks.{i}.hook_mlp_out``).
        transcoder: read the MLP's input of that block as the input.
        layer: the block index (None for a hook outside the blocks).
    """

    at: str
    transcoder: bool = False
    layer: int | None = None


def parse_sites(model: nn.Module, at: str | Sequence[str], *, transcoder: bool) -> list[Site]:
    """The sites of ``at``: a hook name, a glob (``blocks.*.hook_resid_post``), or a list;
    for transcoders the layer's MLP output hook (``blocks.3.hook_mlp_out``, or ``"all"``).

    Raises:
        KeyError: for a name that matches no hook point (the closest names listed).
        ValueError: for a transcoder at a hook that is not an MLP output.
    """
    from handformer.inspect.points import select_names

    points = hook_points(model)
    names = [at] if isinstance(at, str) else list(at)
    if transcoder and names == ["all"]:
        names = [mlp_output_hook(i) for i in range(len(model.blocks))]
    chosen = select_names(points, names, what="at")
    sites = []
    for name in chosen:
        m = _LAYER.match(name)
        layer = int(m.group(1)) if m else None
        if transcoder and not _MLP_OUT.match(name):
            raise ValueError(f"a transcoder replaces an MLP's output: at must be "
                             f"blocks.N.hook_mlp_out (or 'all'), got {name!r}")
        sites.append(Site(name, transcoder, layer))
    return sites


class _Stop(Exception):
    """Raised by the last hook a read needs, to end the forward pass there."""


class ActivationReader:
    """Run a model on token windows and keep the activations of some sites.

    Args:
        model: a handformer causal LM.
        sites: the sites to read.
        skip_first: leave position 0 out of every window (the sink).

    ``read(ids)`` returns ``{site.at: (x, y)}``: ``x`` the dictionary's input ``(N, E)`` and
    ``y`` its target (for an SAE the same tensor as ``x``), float32, detached.
    """

    def __init__(self, model: nn.Module, sites: Sequence[Site], *, skip_first: bool = True
                 ) -> None:
        self.model, self.sites, self.skip_first = model, list(sites), skip_first
        points = hook_points(model)
        for s in self.sites:
            if s.at not in points:
                raise KeyError(unknown_name_message(s.at, list(points)))
        layers = [s.layer for s in self.sites]
        # the forward may stop at the end of the deepest block read, if every site is in one
        self.stop_at = (f"blocks.{max(layers)}.hook_resid_post"
                        if layers and None not in layers else None)
        if self.stop_at is not None and self.stop_at not in points:
            self.stop_at = None

    def _rows(self, t: Tensor) -> Tensor:
        t = t[:, 1:] if self.skip_first else t  # (B, L-1, E)
        return t.detach().float().reshape(-1, t.shape[-1])  # (N, E)

    @torch.no_grad()
    def read(self, ids: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
        """The activations of every site for windows ``ids`` ``(B, L)``."""
        return self._run(ids, stop=True)[0]

    @torch.no_grad()
    def read_and_run(self, ids: Tensor) -> tuple[dict[str, tuple[Tensor, Tensor]], Tensor]:
        """:meth:`read` without stopping early: the activations and the logits ``(B, L, V)``
        of the same forward pass."""
        return self._run(ids, stop=False)

    def _run(self, ids: Tensor, *, stop: bool) -> tuple[dict, Tensor | None]:
        from handformer.inspect.run import hooks

        got: dict[str, Tensor] = {}
        inputs: dict[str, Tensor] = {}
        handles = []
        for s in self.sites:
            if s.transcoder:
                def pre(module: nn.Module, args: tuple, s: Site = s) -> None:
                    inputs[s.at] = self._rows(args[0])
                handles.append(self.model.blocks[s.layer].mlp.register_forward_pre_hook(pre))

        def keep(t: Tensor, name: str) -> None:
            got[name] = self._rows(t)

        def halt(t: Tensor, name: str) -> None:
            raise _Stop

        spec: dict[str, object] = {s.at: keep for s in self.sites}
        if self.stop_at is not None and stop:
            spec[self.stop_at] = [keep, halt] if self.stop_at in spec else halt
        logits = None
        try:
            with hooks(self.model, spec):
                logits = self.model(ids).logits
        except _Stop:
            pass
        finally:
            for h in handles:
                h.remove()
        acts = {s.at: ((inputs[s.at] if s.transcoder else got[s.at]), got[s.at])
                for s in self.sites}
        return acts, logits


def corpus_ids(model: nn.Module, corpus: object | Tensor, tokenizer: object | None, *,
               max_tokens: int | None = None, seed: int = 0,
               progress: bool = False) -> tuple[Tensor, int | None]:
    """``(ids (T,), bos id or None)`` of a text corpus (documents shuffled with ``seed``, at
    most about ``max_tokens``) or of a ready id tensor, checked against the vocabulary.

    Raises:
        ValueError: without a tokenizer for a text corpus; ids out of the model's vocabulary.
    """
    if isinstance(corpus, Tensor):
        ids, bos = corpus.reshape(-1).long(), None
    else:
        if tokenizer is None:
            raise ValueError("a text corpus needs the model's tokenizer (tokenizer=...)")
        ids = tokenize_corpus(corpus, tokenizer, max_tokens=max_tokens, shuffle_seed=seed,
                              progress=progress)
        bos = getattr(tokenizer, "bos_token_id", None)
    vocab = model.lm_head.weight.shape[0]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"corpus token ids run from {int(ids.min())} to {int(ids.max())}, "
                         f"outside the model's vocabulary [0, {vocab})")
    return ids, bos


def windows_for(model: nn.Module, corpus: object | Tensor, tokenizer: object | None, *,
                context: int, seed: int, max_tokens: int | None = None) -> TokenWindows:
    """:class:`TokenWindows` over a corpus (tokenized: see :func:`corpus_ids`) or a ready
    ``(T,)`` id tensor."""
    ids, bos = corpus_ids(model, corpus, tokenizer, max_tokens=max_tokens, seed=seed)
    return TokenWindows(ids, context, bos=bos, seed=seed)


def split_windows(ids: Tensor, bos: int | None, *, context: int, seed: int,
                  held_out: float = 0.05) -> tuple[TokenWindows, TokenWindows | None]:
    """Training windows over the first ``1 - held_out`` of ``ids``, evaluation windows over
    the rest (None when the rest is shorter than one window: then evaluate on the training
    windows' tokens, with another seed)."""
    cut = int(ids.numel() * (1 - held_out))
    body = context - (bos is not None)
    if ids.numel() - cut < body:
        return TokenWindows(ids, context, bos=bos, seed=seed), None
    return (TokenWindows(ids[:cut], context, bos=bos, seed=seed),
            TokenWindows(ids[cut:], context, bos=bos, seed=seed + 1))
