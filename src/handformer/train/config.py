"""The training configuration: one validated dataclass, saved as ``train.json`` in the run."""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, fields

from handformer.checks import check_dropout, check_positive_int, check_seed
from handformer.models.causal_lm_config import CausalLMConfig
from handformer.train.schedule import Schedule
from handformer.train.tasks import SYNTHETIC, TASKS

__all__ = ["TrainConfig", "PRECISIONS", "RESUME_OVERRIDABLE"]

PRECISIONS = ("fp32", "bf16", "fp16")
# Options that may change when a run is resumed (they do not change what is computed).
RESUME_OVERRIDABLE = ("steps", "eval_every", "log_every", "ckpt_every", "keep", "progress",
                      "stop_after", "device", "threads")


@dataclass
class TrainConfig:
    """Everything that defines a training run.

    The defaults train ``reverse`` (8 symbols from 10, 2 layers, d_model 64) to >= 99%
    exact-match on held-out sequences in about half a minute on 2 CPU cores.

    Attributes:
        task: ``copy``, ``reverse``, ``sort`` or ``lm``.
        text: the UTF-8 text file of ``lm``.
        length: symbols per sequence (synthetic tasks).
        num_symbols: alphabet size (synthetic tasks, 2-36).
        block_size: characters per window (``lm``).
        val_fraction: validation share of the text (``lm``).
        num_layers, d_model, num_heads, d_ff: the model's size, as in
            :class:`~handformer.models.causal_lm.CausalLMConfig`.
        dropout, activation, positional, attention, window_size, stride: the same
            :class:`~handformer.models.causal_lm.CausalLMConfig` options.
        steps: optimiser steps.
        batch_size: global batch (rows per optimiser step, over all ranks and micro-steps).
        grad_accum: micro-steps per optimiser step.
        lr, weight_decay, beta1, beta2: AdamW (weight decay on matrices only).
        schedule, warmup, min_lr_ratio: learning-rate schedule (:class:`Schedule`).
        clip_grad: max global gradient norm (0 = no clipping).
        label_smoothing: cross-entropy label smoothing in [0, 1).
        precision: ``fp32``, ``bf16`` (autocast) or ``fp16`` (autocast + loss scaling, CUDA).
        eval_every, eval_size, log_every, ckpt_every, keep: evaluation, logging and
            checkpointing cadence (steps); ``keep`` = checkpoints kept.
        seed: seed of the weights, the data stream and the held-out set.
        device: ``auto``, ``cpu`` or ``cuda``.
        threads: CPU threads of this process (``torch.set_num_threads``). Default: 1 for
            models under 2M parameters on CPU (several times faster on a busy machine, no
            slower on a quiet one), torch's default otherwise.
        progress: show a tqdm progress bar (rank 0).
        stop_after: stop (with a checkpoint) after this many steps of this invocation; the
            run continues with ``--resume``.
    """

    task: str
    text: str | None = None
    length: int = 8
    num_symbols: int = 10
    block_size: int = 64
    val_fraction: float = 0.1
    num_layers: int = 2
    d_model: int = 64
    num_heads: int = 4
    d_ff: int = 256
    dropout: float = 0.0
    activation: str = "gelu"
    positional: str = "learned"
    attention: str = "full"
    window_size: int | None = None
    stride: int | None = None
    steps: int = 600
    batch_size: int = 64
    grad_accum: int = 1
    lr: float = 3e-3
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.98
    schedule: str = "cosine"
    warmup: int = 100
    min_lr_ratio: float = 0.05
    clip_grad: float = 1.0
    label_smoothing: float = 0.0
    precision: str = "fp32"
    eval_every: int = 100
    eval_size: int = 1000
    log_every: int = 10
    ckpt_every: int = 200
    keep: int = 3
    seed: int = 0
    device: str = "auto"
    threads: int | None = None
    progress: bool = True
    stop_after: int | None = None

    def validate(self) -> None:
        """Check every field (names the option in the message).

        Raises:
            ValueError: for any invalid value or combination.
        """
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose one of {list(TASKS)}")
        if self.task == "lm" and not self.text:
            raise ValueError("task 'lm' needs --text FILE (a UTF-8 text file)")
        if self.task in SYNTHETIC and self.text:
            raise ValueError(f"--text is only used by task 'lm', not {self.task!r}")
        for name in ("length", "num_symbols", "block_size", "steps", "batch_size",
                     "grad_accum", "eval_every", "eval_size", "log_every", "ckpt_every",
                     "keep"):
            check_positive_int(name, getattr(self, name))
        for name in ("stop_after", "threads"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        check_seed(self.seed)  # 0 .. 2**63 - 1, as everywhere
        Schedule(self.schedule, self.lr, self.warmup, self.steps, self.min_lr_ratio)
        for name in ("weight_decay", "clip_grad"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        check_dropout("label_smoothing", self.label_smoothing)
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, "
                             f"got {self.precision!r}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size={self.batch_size} is not divisible by "
                             f"grad_accum={self.grad_accum}")
        for kind, name in (("local", "window_size"), ("strided", "stride")):
            if self.attention == kind and getattr(self, name) is None:
                raise ValueError(f"--attention {kind} needs --{name.replace('_', '-')} N "
                                 f"({name} must be a positive integer)")
        self.model_config(vocab_size=1, max_len=1)  # the model's own checks

    def model_config(self, *, vocab_size: int, max_len: int) -> CausalLMConfig:
        """The model configuration for a vocabulary and context length."""
        return CausalLMConfig(
            vocab_size=vocab_size, max_len=max_len, d_model=self.d_model,
            num_heads=self.num_heads, num_layers=self.num_layers, d_ff=self.d_ff,
            dropout=self.dropout, activation=self.activation, positional=self.positional,
            attention=self.attention, window_size=self.window_size, stride=self.stride)

    def to_dict(self) -> dict[str, object]:
        """The fields as a JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> TrainConfig:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: for unknown or missing fields.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown training options {unknown}")
        missing = sorted(f.name for f in fields(cls)
                         if f.default is MISSING and f.name not in data)
        if missing:
            raise ValueError(f"training options {missing} are missing")
        return cls(**data)
