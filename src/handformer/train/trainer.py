"""The training loop: AdamW, schedule, clipping, accumulation, evaluation, checkpoints, DDP.

Run folder layout (what ``handformer generate --model RUN_DIR`` and ``handformer viz --model
RUN_DIR`` read, and what ``--resume RUN_DIR`` continues)::

    RUN_DIR/
      train.json            the TrainConfig (the run's options; --resume reads it)
      config.json           model config  } the latest weights, loadable with
      model.safetensors     model weights } CausalLM.from_pretrained(RUN_DIR)
      vocab.json            {"kind": "char", "tokens": [...]}: token id i is tokens[i]
      metrics.jsonl         one JSON object per line: {"split": "train", "step", "loss", "lr",
                            "tokens_per_s", "tokens", "elapsed_s"} and {"split": "eval",
                            "step", "loss", "accuracy"?, "elapsed_s"}
      checkpoints/step-NNNNNNNN/   the last K checkpoints (see handformer.train.checkpoint)
      summary.json          written when the run finishes: final step and evaluation
      loss.png              loss curve (end of run)
      attention.png         every head of the trained model on a held-out example
      attention_head.png    one head of it, with tokens: for copy/reverse/sort the head that
                            reads the input most (for reverse: the anti-diagonal)

Determinism: the batch of a step is a function of ``(seed, step)`` only, the learning rate a
function of the step, and the checkpoint holds the weights, the AdamW state and the RNG
states; on CPU a run stopped and resumed computes bit-for-bit the losses of an uninterrupted
run.

Shape letters: ``B`` batch, ``L`` length, ``V`` vocabulary.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from handformer.models.causal_lm import MODEL_TYPE, CausalLM
from handformer.train import checkpoint as ckpt
from handformer.train import distributed as D
from handformer.train.config import TrainConfig
from handformer.train.data import VOCAB_NAME, shard_rows
from handformer.train.schedule import Schedule
from handformer.train.tasks import IGNORE, LMTask, SequenceTask, Task

__all__ = ["train", "TrainResult", "build_task", "evaluate", "RunError", "TRAIN_NAME",
           "METRICS_NAME"]

# Below this many parameters a CPU run uses one thread unless --threads says otherwise: its
# operations are too small for intra-op threads to pay off, and on a shared machine the
# threads' spin-waits made a step of the default `reverse` model 5-7x slower.
SMALL_MODEL = 2_000_000
TRAIN_NAME = "train.json"
METRICS_NAME = "metrics.jsonl"


class RunError(ValueError):
    """A run folder that cannot be used (not a run, already a run, mismatched options)."""


@dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
        run_dir: the run folder.
        step: optimiser steps done in total.
        finished: whether the run reached ``config.steps``.
        interrupted: stopped by Ctrl-C / SIGTERM (a checkpoint was saved).
        final_eval: the last evaluation record (or None).
        losses: ``(step, loss)`` of every logged step of this invocation.
    """

    run_dir: Path
    step: int
    finished: bool
    interrupted: bool
    final_eval: dict | None = None
    losses: list[tuple[int, float]] = field(default_factory=list)


def build_task(config: TrainConfig) -> Task:
    """The task of a configuration (raises ``ValueError`` / ``FileNotFoundError``)."""
    if config.task == "lm":
        return LMTask(config.text, block_size=config.block_size,
                      val_fraction=config.val_fraction, eval_size=config.eval_size)
    return SequenceTask(config.task, length=config.length, num_symbols=config.num_symbols,
                        eval_size=config.eval_size, seed=config.seed)


class _StopRequest:
    """SIGINT/SIGTERM set a flag that the loop checks between steps (a second Ctrl-C
    interrupts at once)."""

    def __init__(self) -> None:
        self.requested = False
        self._old: dict[int, object] = {}

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _autocast(config: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    if config.precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if config.precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def _loss(logits: Tensor, targets: Tensor, smoothing: float = 0.0,
          reduction: str = "mean") -> Tensor:
    V = logits.shape[-1]
    return F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1),  # (B*L, V)
                           ignore_index=IGNORE, label_smoothing=smoothing, reduction=reduction)


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, config: TrainConfig, info: D.DistInfo,
             *, batches: list | None = None) -> dict[str, float]:
    """Loss per target token (and exact-match accuracy) on the task's held-out set.

    In a distributed run the evaluation batches are split over the ranks and the sums are
    all-reduced, so every rank returns the same numbers.

    Args:
        model: the model being trained (put back in its train/eval mode afterwards).
        task: the task whose held-out batches are scored.
        config: the run's configuration.
        info: this process's place in a distributed run (rank, world size).
        batches: the evaluation batches (default: ``task.eval_batches(256)``).
    """
    batches = task.eval_batches(256) if batches is None else batches
    was_training = model.training
    model.eval()
    loss_sum = tokens = correct = examples = 0.0
    for i, b in enumerate(batches):
        if i % info.world_size != info.rank:
            continue
        ids, tgt = b.input_ids.to(info.device), b.targets.to(info.device)
        with _autocast(config, info.device):
            logits = model(ids).logits  # (B, L, V)
        keep = tgt != IGNORE  # (B, L)
        loss_sum += float(_loss(logits, tgt, reduction="sum"))
        tokens += float(keep.sum())
        if task.has_accuracy:
            right = (logits.argmax(-1) == tgt) | ~keep  # (B, L)
            correct += float(right.all(-1).sum())
            examples += ids.shape[0]
    model.train(was_training)
    loss_sum, tokens, correct, examples = D.all_reduce_sum(
        [loss_sum, tokens, correct, examples], info)
    out = {"loss": loss_sum / max(tokens, 1.0)}
    if task.has_accuracy:
        out["accuracy"] = correct / max(examples, 1.0)
    return out


def _prepare_run_dir(run_dir: Path, resume: bool) -> None:
    if resume:
        if not (run_dir / TRAIN_NAME).is_file():
            raise RunError(f"{run_dir} is not a handformer run folder (no {TRAIN_NAME}); "
                           "--resume takes the folder a previous `handformer train` wrote")
        return
    if (run_dir / TRAIN_NAME).exists():
        raise RunError(f"{run_dir} already holds a run; continue it with --resume {run_dir} "
                       "or choose another --out")
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise RunError(f"--out {run_dir} exists and is not an empty folder")


def _write_json(path: Path, data: object) -> None:
    ckpt.atomic_write_bytes(path, (json.dumps(data, indent=2) + "\n").encode())


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop the records after ``step`` (written after the checkpoint we resume from)."""
    if not path.is_file():
        return
    lines = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                lines.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a torn last line
    ckpt.atomic_write_bytes(path, "".join(f"{x}\n" for x in lines).encode())


def train(config: TrainConfig, run_dir: str | Path, *, resume: bool = False) -> TrainResult:
    """Train (or continue) a run.

    Args:
        config: the options (for ``resume``: the run's ``train.json`` with allowed
            overrides, see :data:`handformer.train.config.RESUME_OVERRIDABLE`).
        run_dir: the run folder (created; must be new or empty unless ``resume``).
        resume: continue from the newest complete checkpoint of ``run_dir``.

    Returns:
        A :class:`TrainResult`.

    Raises:
        ValueError: for invalid options, bad data, a folder that is not a run (``resume``)
            or already a run (new run), and :class:`CheckpointError` for a corrupt or
            mismatched checkpoint.
        FileNotFoundError: for a missing text file.
    """
    config.validate()
    threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    run_dir = Path(run_dir)
    info = D.setup(config.device)
    try:
        return _train(config, run_dir, resume, info)
    finally:
        D.teardown(info)
        torch.set_num_threads(threads)


def _train(config: TrainConfig, run_dir: Path, resume: bool, info: D.DistInfo) -> TrainResult:
    """The phases of a run, in order; each is a function below."""
    run = _setup(config, run_dir, resume, info)  # checks, task, model, optimizer, schedule
    restored = _restore(run, resume)  # the newest checkpoint, or each rank's seed
    _write_run_files(run, resume, fresh=not restored)  # train.json, vocab.json, first weights
    wrapped = D.wrap(run.model, info)  # DDP over the processes (the model itself on one)
    eval_batches = run.task.eval_batches(256)
    result = _result_so_far(run, resume)
    _loop(run, wrapped, eval_batches, result)
    result.finished = result.step >= config.steps
    if result.finished and result.step > run.start and info.is_main:
        _finish(run.model, run.task, config, run_dir, result)
    return result


@dataclass
class _Run:
    """What the phases of one invocation of a run share."""

    config: TrainConfig
    run_dir: Path
    info: D.DistInfo
    task: Task
    model: CausalLM
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    scaler: torch.amp.GradScaler
    micro: int  # rows per micro-step, over all processes
    expected: dict  # the model's config.json, as a checkpoint of this run must hold it
    start: int = 0  # the step this invocation starts from
    tokens_seen: int = 0
    elapsed_before: float = 0.0  # training seconds of the earlier invocations
    t_start: float = 0.0  # perf_counter() when this invocation's loop began
    t_logged: float = 0.0  # perf_counter() and tokens_seen at the last train record
    tokens_logged: int = 0
    bar: object = None  # the tqdm progress bar (rank 0, --progress)

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / METRICS_NAME

    def elapsed(self) -> float:
        """Training seconds so far, over all invocations of the run."""
        return round(self.elapsed_before + time.perf_counter() - self.t_start, 3)

    def log(self, record: dict) -> None:
        """Append one record to ``metrics.jsonl`` (rank 0)."""
        if self.info.is_main:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")


def _setup(config: TrainConfig, run_dir: Path, resume: bool, info: D.DistInfo) -> _Run:
    """Check what the processes and the folder allow, then build the task, the model (seeded
    by ``config.seed``), AdamW (no weight decay on vectors), the schedule and the scaler."""
    if config.precision == "fp16" and info.device.type != "cuda":
        raise ValueError("precision='fp16' needs a CUDA device; use --precision bf16 on CPU")
    micro = config.batch_size // config.grad_accum
    if micro % info.world_size:
        raise ValueError(f"batch_size={config.batch_size} / grad_accum={config.grad_accum} = "
                         f"{micro} rows per micro-step cannot be split over "
                         f"{info.world_size} processes")
    _prepare_run_dir(run_dir, resume)
    D.barrier(info)  # every rank has checked the folder before rank 0 writes into it
    task = build_task(config)
    torch.manual_seed(config.seed)
    model_config = config.model_config(vocab_size=len(task.vocab), max_len=task.max_len)
    expected = json.loads(json.dumps({"model_type": MODEL_TYPE, **model_config.to_dict()}))
    model = CausalLM(model_config).to(info.device)
    if (config.threads is None and info.device.type == "cpu"
            and sum(p.numel() for p in model.parameters()) < SMALL_MODEL):
        torch.set_num_threads(1)  # restored by train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(config.beta1, config.beta2))
    schedule = Schedule(config.schedule, config.lr, config.warmup, config.steps,
                        config.min_lr_ratio)
    scaler = torch.amp.GradScaler(info.device.type, enabled=config.precision == "fp16")
    return _Run(config, run_dir, info, task, model, optimizer, schedule, scaler, micro,
                expected)


def _restore(run: _Run, resume: bool) -> bool:
    """Continue from the newest complete checkpoint: weights, AdamW, scaler, step, tokens,
    time and RNG state (rank 0's; the others reseed from the step). Without one, the other
    ranks take seeds of their own (distinct dropout masks). Returns whether one was read."""
    config, info = run.config, run.info
    latest = ckpt.latest_checkpoint(run.run_dir) if resume else None
    if info.is_main and resume:
        ckpt.remove_stale_temporaries(run.run_dir)
    if latest is None:
        if info.rank:
            torch.manual_seed(config.seed + 7919 * info.rank)  # distinct dropout masks per rank
        return False
    state, rng = ckpt.load_checkpoint(latest, run.model, run.optimizer, run.expected)
    run.start, run.tokens_seen = int(state["step"]), int(state.get("tokens", 0))
    run.elapsed_before = float(state.get("elapsed_s", 0.0))
    if state.get("scaler"):
        run.scaler.load_state_dict(state["scaler"])
    if info.rank == 0 and "torch" in rng:
        torch.set_rng_state(rng["torch"])
        if info.device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], info.device)
    else:
        torch.manual_seed(config.seed + 7919 * info.rank + run.start)
    return True


def _write_run_files(run: _Run, resume: bool, *, fresh: bool) -> None:
    """Rank 0 writes ``train.json`` and ``vocab.json``, drops the metrics written after the
    checkpoint a resumed run starts from, and (``fresh``) the untrained weights."""
    if run.info.is_main:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        # stop_after is about one invocation, not the run
        _write_json(run.run_dir / TRAIN_NAME, {**run.config.to_dict(), "stop_after": None})
        run.task.vocab.save(run.run_dir / VOCAB_NAME)
        if resume:
            _truncate_metrics(run.metrics_path, run.start)
        if fresh:
            run.model.save_pretrained(run.run_dir)
    D.barrier(run.info)


def _result_so_far(run: _Run, resume: bool) -> TrainResult:
    """The result before this invocation's first step (a resumed run: its last evaluation,
    all that a finished run has to report)."""
    result = TrainResult(run.run_dir, run.start, run.start >= run.config.steps, False)
    if resume:
        from handformer.train.plots import read_metrics

        evals = [r for r in read_metrics(run.metrics_path) if r.get("split") == "eval"]
        result.final_eval = evals[-1] if evals else None
    return result


def _loop(run: _Run, wrapped: nn.Module, eval_batches: object, result: TrainResult) -> None:
    """The steps from ``run.start`` to ``config.steps``: step, log, evaluate, checkpoint;
    a stop request (Ctrl-C, SIGTERM on any rank) or ``stop_after`` saves and stops."""
    config, info = run.config, run.info
    if info.is_main and config.progress:
        from tqdm.auto import tqdm

        run.bar = tqdm(total=config.steps, initial=run.start, unit="step", dynamic_ncols=True,
                       mininterval=0.5, file=sys.stderr, desc=f"{config.task}")
    tokens_per_step = config.batch_size * run.task.seq_len
    run.model.train()
    run.t_logged, run.tokens_logged = time.perf_counter(), run.tokens_seen
    run.t_start = run.t_logged
    with _StopRequest() as stop:
        for step in range(run.start, config.steps):
            lr = run.schedule(step)
            loss_sum = _step(run, wrapped, step, lr)
            done = step + 1
            run.tokens_seen += tokens_per_step
            result.step = done
            if done % config.log_every == 0 or done == config.steps:
                _log_train(run, result, done, loss_sum, lr)
            if done % config.eval_every == 0 or done == config.steps:
                _log_eval(run, result, done, eval_batches)
            if run.bar is not None:
                run.bar.update(1)
            interrupted = D.any_flag(stop.requested, info)
            halt = config.stop_after is not None and done - run.start >= config.stop_after
            if done % config.ckpt_every == 0 or done == config.steps or interrupted or halt:
                _save(run, done)
            if interrupted or halt:
                result.interrupted = interrupted
                break
    if run.bar is not None:
        run.bar.close()


def _step(run: _Run, wrapped: nn.Module, step: int, lr: float) -> Tensor:
    """One optimiser step at learning rate ``lr``: ``grad_accum`` micro-batches (this rank's
    rows of each; DDP syncs the gradients on the last), clipping, AdamW. Returns the sum of
    the micro-batches' mean losses (a 0-dim tensor, not synchronised)."""
    config, info, scaler = run.config, run.info, run.scaler
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), device=info.device)
    for m in range(config.grad_accum):
        b = run.task.batch(config.seed, step, m, run.micro)
        ids = shard_rows(b.input_ids, info.rank, info.world_size).to(info.device)
        tgt = shard_rows(b.targets, info.rank, info.world_size).to(info.device)
        sync = (m == config.grad_accum - 1 or not info.enabled)
        with contextlib.nullcontext() if sync else wrapped.no_sync():
            with _autocast(config, info.device):
                logits = wrapped(ids).logits  # (B, L, V)
            loss = _loss(logits, tgt, config.label_smoothing)
            scaler.scale(loss / config.grad_accum).backward()
        loss_sum += loss.detach()
    if config.clip_grad > 0:
        scaler.unscale_(run.optimizer)
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), config.clip_grad)
    scaler.step(run.optimizer)
    scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    return loss_sum


def _log_train(run: _Run, result: TrainResult, done: int, loss_sum: Tensor, lr: float) -> None:
    """A train record: the loss averaged over micro-batches and processes, the speed since
    the last record."""
    (loss_all,) = D.all_reduce_sum([float(loss_sum) / run.config.grad_accum], run.info)
    loss_value = loss_all / run.info.world_size
    now = time.perf_counter()
    speed = (run.tokens_seen - run.tokens_logged) / max(now - run.t_logged, 1e-9)
    run.t_logged, run.tokens_logged = now, run.tokens_seen
    run.log({"split": "train", "step": done, "loss": loss_value, "lr": lr,
             "tokens_per_s": round(speed, 1), "tokens": run.tokens_seen,
             "elapsed_s": run.elapsed()})
    result.losses.append((done, loss_value))
    if run.bar is not None:
        run.bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", tok_s=f"{speed:,.0f}",
                            refresh=False)


def _log_eval(run: _Run, result: TrainResult, done: int, eval_batches: object) -> None:
    """An eval record on the held-out batches (every process evaluates its share)."""
    ev = evaluate(run.model, run.task, run.config, run.info, batches=eval_batches)
    result.final_eval = {"split": "eval", "step": done, **ev, "elapsed_s": run.elapsed()}
    run.log(result.final_eval)
    if run.bar is not None:
        run.bar.write(f"step {done}: eval " + ", ".join(
            f"{k} {v:.4f}" for k, v in ev.items()), file=sys.stderr)


def _save(run: _Run, step: int) -> None:
    """Rank 0 writes a checkpoint (weights, AdamW, RNG, where the data stands), copies its
    weights to the top of the run folder and prunes the old ones; every rank waits."""
    info = run.info
    if info.is_main:
        rng = {"torch": torch.get_rng_state()}
        if info.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(info.device)
        state = {"tokens": run.tokens_seen, "elapsed_s": run.elapsed(),
                 "schedule": run.schedule.to_dict(),
                 "data": {"kind": "step-seeded", "seed": run.config.seed, "next_step": step},
                 "world_size": info.world_size, "scaler": run.scaler.state_dict()}
        path = ckpt.save_checkpoint(run.run_dir, step, run.model, run.optimizer, state, rng)
        for name in ("model.safetensors", "config.json"):  # the latest weights, on top
            ckpt.atomic_write_bytes(run.run_dir / name, (path / name).read_bytes())
        ckpt.prune_checkpoints(run.run_dir, run.config.keep)
    D.barrier(info)


def _finish(model: CausalLM, task: Task, config: TrainConfig, run_dir: Path,
            result: TrainResult) -> None:
    """summary.json, loss.png, attention.png and attention_head.png of a finished run."""
    from handformer.train.plots import plot_loss_curve, plot_model_attention

    _write_json(run_dir / "summary.json", {"step": result.step, "final_eval": result.final_eval})
    plot_loss_curve(run_dir / METRICS_NAME, run_dir / "loss.png")
    text = task.example()
    ids = task.vocab.encode(text)
    n = config.length
    rows, keys = ((slice(n, 2 * n), slice(0, n)) if isinstance(task, SequenceTask)
                  else (slice(None), slice(None)))
    plot_model_attention(model, ids, list(text), run_dir / "attention.png",
                         title=f"{config.task}: every head on {text!r}",
                         head_out=run_dir / "attention_head.png", rows=rows, keys=keys)
