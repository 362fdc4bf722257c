"""Training tasks: three synthetic sequence tasks and a character-level language model.

All tasks train a **decoder-only** model (:class:`~handformer.models.causal_lm.CausalLM`) on
next-token prediction over a character vocabulary:

* ``copy``, ``reverse``, ``sort``: a random sequence ``x`` of ``length`` symbols from
  ``0-9a-z`` (the first ``num_symbols``), a separator ``>``, then the target ``y``:
  ``"31415926>62951413"`` for ``reverse``. The model reads ``x>`` and the loss is taken on
  the ``y`` tokens only. With teacher forcing, "every ``y`` token is the arg-max" is exactly
  "greedy decoding from ``x>`` reproduces ``y``", so exact-match accuracy needs one forward
  pass. Evaluation uses ``eval_size`` held-out sequences that training never draws (training
  rows that hit the held-out set are redrawn).
* ``lm``: any UTF-8 text; the vocabulary is its characters; the first ``1 - val_fraction`` of
  the text trains, the rest validates; examples are random ``block_size`` windows.

Shape letters: ``B`` batch, ``L`` length (model input), ``n`` sequence length of ``x``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from handformer.checks import check_positive_int
from handformer.train.data import CharVocab, batch_generator, read_text

__all__ = ["Batch", "Task", "SequenceTask", "LMTask", "SYMBOLS", "SEPARATOR", "SYNTHETIC",
           "TASKS", "IGNORE", "MAX_SEQUENCE_LENGTH"]

SYMBOLS = "0123456789abcdefghijklmnopqrstuvwxyz"
SEPARATOR = ">"
# Longest sequence of the synthetic tasks: the model reads 2 * length + 1 tokens, and one
# training step at the default batch of 64 already holds about 1 GB of activations at 4096.
MAX_SEQUENCE_LENGTH = 4096
SYNTHETIC = ("copy", "reverse", "sort")
TASKS = (*SYNTHETIC, "lm")
IGNORE = -100  # target id that carries no loss (torch's cross-entropy ignore_index)


@dataclass
class Batch:
    """Model inputs and next-token targets.

    Attributes:
        input_ids: ``(B, L)`` token ids.
        targets: ``(B, L)`` next-token ids, :data:`IGNORE` where no loss is taken.
    """

    input_ids: Tensor
    targets: Tensor


class Task:
    """What the trainer needs from a task.

    Attributes:
        name: the task name.
        vocab: the :class:`CharVocab` (saved as ``vocab.json`` in the run folder).
        seq_len: model input length ``L``.
        max_len: the model's context (``L``, plus one for the synthetic tasks so that
            ``generate`` can produce the whole target after the prompt ``x>``).
        has_accuracy: whether :meth:`evaluate` reports exact-match accuracy.
    """

    name: str
    vocab: CharVocab
    seq_len: int
    max_len: int
    has_accuracy: bool = False

    def batch(self, seed: int, step: int, micro_step: int, size: int) -> Batch:
        """The global training batch of ``size`` rows for ``(seed, step, micro_step)``."""
        raise NotImplementedError

    def eval_batches(self, batch_size: int) -> list[Batch]:
        """The fixed evaluation set, in batches of at most ``batch_size`` rows."""
        raise NotImplementedError

    def example(self) -> str:
        """A short held-out input for the attention plot (text over the vocabulary)."""
        raise NotImplementedError


class SequenceTask(Task):
    """``copy``, ``reverse`` or ``sort`` a random symbol sequence (see the module docstring).

    Args:
        name: ``"copy"``, ``"reverse"`` or ``"sort"``.
        length: symbols per sequence ``n`` (the model input is ``2n`` long), at most
            :data:`MAX_SEQUENCE_LENGTH`.
        num_symbols: alphabet size, 2 to 36 (``0-9`` then ``a-z``).
        eval_size: held-out sequences for evaluation.
        seed: seed of the held-out set.

    Raises:
        ValueError: for an unknown name or invalid sizes (or an ``eval_size`` too large for
            the number of distinct sequences).
    """

    has_accuracy = True

    def __init__(self, name: str, *, length: int = 8, num_symbols: int = 10,
                 eval_size: int = 1000, seed: int = 0) -> None:
        if name not in SYNTHETIC:
            raise ValueError(f"unknown synthetic task {name!r}; choose one of {list(SYNTHETIC)}")
        self.name = name
        self.length = check_positive_int("length", length)
        if length > MAX_SEQUENCE_LENGTH:
            raise ValueError(f"length must be at most {MAX_SEQUENCE_LENGTH} for the synthetic "
                             f"tasks (the model reads 2 * length + 1 tokens), got {length}; "
                             "for long inputs train task lm on a text file")
        check_positive_int("num_symbols", num_symbols)
        if not 2 <= num_symbols <= len(SYMBOLS):
            raise ValueError(f"num_symbols must be in [2, {len(SYMBOLS)}], got {num_symbols}")
        self.num_symbols = num_symbols
        check_positive_int("eval_size", eval_size)
        if eval_size > num_symbols ** length // 2:
            raise ValueError(f"eval_size={eval_size} is more than half of the "
                             f"{num_symbols}^{length} possible sequences; use a smaller "
                             "--eval-size or longer sequences")
        self.vocab = CharVocab(SEPARATOR + SYMBOLS[:num_symbols])
        self.seq_len = 2 * length
        self.max_len = 2 * length + 1
        # Held-out sequences, distinct, in lexicographic order; training never draws them.
        g = batch_generator(seed, 0, 0xFFFF)
        rows = torch.empty(0, length, dtype=torch.uint8)  # (E, n): symbols fit in a byte
        while rows.shape[0] < eval_size:
            x = torch.randint(num_symbols, (eval_size, length), generator=g)  # (B, n)
            rows = torch.unique(torch.cat([rows, x.to(torch.uint8)]), dim=0)
        picked = torch.sort(torch.randperm(rows.shape[0], generator=g)[:eval_size]).values
        self.eval_x = rows[picked]  # (E, n), still in lexicographic order
        self.eval_codes = torch.sort(self._codes(self.eval_x.long())).values  # (E,)

    def _codes(self, x: Tensor) -> Tensor:
        """``(B, n)`` symbols -> ``(B,)`` integer codes, to find held-out rows quickly.

        Exact (base ``num_symbols``) while ``s^n < 2**62``. Beyond, a hash with fixed
        pseudo-random 64-bit weights (wrapping int64 arithmetic): a collision can only make
        a training row be redrawn, never lose a held-out row (those are kept as symbols).
        """
        if self.num_symbols ** self.length >= 1 << 62:
            g = torch.Generator().manual_seed(0x5EED)
            weights = torch.randint(-(2**62), 2**62, (self.length,), generator=g) * 2 + 1
            return (x * weights).sum(-1)  # (B,), wraps around: a hash
        weights = self.num_symbols ** torch.arange(self.length - 1, -1, -1)  # (n,)
        return (x * weights).sum(-1)

    def target(self, x: Tensor) -> Tensor:
        """The target ``y`` of symbols ``x: (B, n)``."""
        if self.name == "copy":
            return x
        if self.name == "reverse":
            return x.flip(-1)
        return torch.sort(x, dim=-1).values

    def make_batch(self, x: Tensor) -> Batch:
        """Inputs and targets for symbols ``x: (B, n)``: ``x > y`` without its last token."""
        B, n = x.shape
        sep = torch.zeros(B, 1, dtype=torch.long)  # the separator is token id 0
        full = torch.cat([x + 1, sep, self.target(x) + 1], dim=1)  # (B, 2n + 1)
        targets = full[:, 1:].clone()  # (B, 2n)
        targets[:, :n] = IGNORE  # loss only on the y tokens (positions n .. 2n-1)
        return Batch(full[:, :-1].contiguous(), targets)

    def batch(self, seed: int, step: int, micro_step: int, size: int) -> Batch:
        g = batch_generator(seed, step, micro_step)
        x = torch.randint(self.num_symbols, (size, self.length), generator=g)  # (B, n)
        while True:
            held_out = torch.isin(self._codes(x), self.eval_codes)  # (B,)
            if not held_out.any():
                return self.make_batch(x)
            redraw = torch.randint(self.num_symbols, (int(held_out.sum()), self.length),
                                   generator=g)
            x[held_out] = redraw

    def eval_batches(self, batch_size: int) -> list[Batch]:
        x = self.eval_x.long()  # (eval_size, n)
        return [self.make_batch(chunk) for chunk in x.split(batch_size)]

    def example(self) -> str:
        x = self.eval_x[0].long()  # (n,)
        return self.vocab.decode((x + 1).tolist()) + SEPARATOR + self.vocab.decode(
            (self.target(x[None])[0][:-1] + 1).tolist())

    def mirrored_keys(self) -> Tensor:
        """For ``reverse``: the key each query position should read, ``(L,)`` (-1 = none).

        The query at position ``n + j`` predicts ``y[j] = x[n - 1 - j]``, which sits at key
        position ``n - 1 - j = (2n - 1) - (n + j)``: the anti-diagonal.
        """
        n = self.length
        keys = torch.full((2 * n,), -1, dtype=torch.long)
        keys[n:] = torch.arange(n - 1, -1, -1)
        return keys


class LMTask(Task):
    """Character-level language modelling on a UTF-8 text file.

    Args:
        text_path: the text file.
        block_size: characters per training window (the model's ``max_len``).
        val_fraction: share of the text (its end) kept for validation, in (0, 0.5].
        eval_size: validation windows per evaluation (evenly spaced, fixed).

    Raises:
        FileNotFoundError: for a missing file.
        ValueError: for an empty or non-UTF-8 file, or a text too short for one block in
            both splits.
    """

    def __init__(self, text_path: str, *, block_size: int = 64, val_fraction: float = 0.1,
                 eval_size: int = 256) -> None:
        self.name = "lm"
        check_positive_int("block_size", block_size)
        check_positive_int("eval_size", eval_size)
        if isinstance(val_fraction, bool) or not 0 < val_fraction <= 0.5:
            raise ValueError(f"val_fraction must be in (0, 0.5], got {val_fraction!r}")
        text = read_text(text_path)
        n_val = int(len(text) * val_fraction)
        need = max(math.ceil((block_size + 1) / val_fraction), 2 * (block_size + 1))
        if n_val < block_size + 1 or len(text) - n_val < block_size + 1:
            raise ValueError(f"text file {text_path} has {len(text)} characters, shorter than "
                             f"one block in each split: block_size={block_size} and "
                             f"val_fraction={val_fraction} need at least {need}; use a longer "
                             "text or a smaller --block-size")
        self.vocab = CharVocab(sorted(set(text)))
        data = torch.tensor(self.vocab.encode(text), dtype=torch.long)
        self.train_data, self.val_data = data[:len(text) - n_val], data[len(text) - n_val:]
        self.block_size = block_size
        self.seq_len = block_size
        self.max_len = block_size
        self.eval_size = eval_size

    def _windows(self, data: Tensor, starts: Tensor) -> Batch:
        idx = starts[:, None] + torch.arange(self.block_size + 1)  # (B, L + 1)
        chunk = data[idx]  # (B, L + 1)
        return Batch(chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous())

    def batch(self, seed: int, step: int, micro_step: int, size: int) -> Batch:
        g = batch_generator(seed, step, micro_step)
        starts = torch.randint(len(self.train_data) - self.block_size, (size,), generator=g)
        return self._windows(self.train_data, starts)

    def eval_batches(self, batch_size: int) -> list[Batch]:
        last = len(self.val_data) - self.block_size - 1
        count = min(self.eval_size, last + 1)
        starts = torch.linspace(0, last, count).round().long().unique()  # (count,)
        return [self._windows(self.val_data, s) for s in starts.split(batch_size)]

    def example(self) -> str:
        return self.vocab.decode(self.val_data[:min(self.block_size, 48)])
