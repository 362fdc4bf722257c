"""Train sparse autoencoders and transcoders on a laptop: :func:`train_dictionary`.

One streaming pass: every step runs the model on ``batch`` token windows (stopping after the
deepest block it needs), hands each site's activations to that site's dictionary, and takes
one Adam step over all of them (Adam is per parameter, so one optimiser over every site is
every site's own optimiser). Nothing is stored between steps: no activation store, whatever
the number of sites (all 30 layers' transcoders train from one forward pass).

The recipe (losses, AuxK, unit-norm decoder, initialisation, learning rate) is in
:mod:`handformer.features.objective`. The run folder::

    OUT/
      train_sae.json         the options (``--resume OUT`` reads them)
      metrics.jsonl          {"step", "tokens", "lr", "mse", "aux", "l0", "dead", ...} per log
      checkpoints/step-N/    the trainer's checkpoints (handformer.train.checkpoint): weights,
                             Adam state, RNG; verified by SHA-256 on resume
      dictionaries/HOOK/     one saved dictionary per site (save_dictionary's layout), written
                             when the run ends (or is interrupted)
      summary.json           steps, tokens, tokens/s of each stage, final metrics

Determinism: the windows of a step are a function of ``(seed, step)``, the dictionaries'
state (weights, Adam, the dead-latent counters) is in the checkpoint, so on CPU a run stopped
and resumed computes bit for bit what an uninterrupted run does. Under ``torchrun`` each rank
reads its share of the windows and the gradients are averaged (gloo on CPU, NCCL on GPUs).

Shape letters: ``B`` windows, ``L`` window length, ``N`` rows, ``E`` model dim, ``S`` latents.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from handformer.features.dictionary import Dictionary, SparseAutoencoder, Transcoder
from handformer.features.objective import (
    KINDS,
    DictionarySet,
    normalise_decoder,
    paper_lr,
    project_decoder_grad,
)
from handformer.features.stream import (
    ActivationReader,
    Site,
    TokenWindows,
    corpus_ids,
    parse_sites,
    split_windows,
    typical_rows,
)
from handformer.train import checkpoint as ckpt
from handformer.train import distributed as D
from handformer.train.schedule import Schedule

__all__ = ["SAETrainConfig", "TrainDictionaryResult", "train_dictionary",
           "train_on_activations", "OPTIONS_NAME", "DICTIONARIES"]

OPTIONS_NAME = "train_sae.json"
METRICS_NAME = "metrics.jsonl"
DICTIONARIES = "dictionaries"
# what --resume may change; everything else must be the run's own
RESUMABLE = ("tokens", "progress", "checkpoint_every", "eval_tokens", "threads", "stop_after")


@dataclass
class SAETrainConfig:
    """The options of a dictionary training run (saved as ``train_sae.json``).

    Attributes:
        at: hook name(s) or a glob (a transcoder: ``blocks.N.hook_mlp_out`` or ``"all"``).
        kind: ``"topk"`` or ``"relu"``.
        transcoder: train transcoders (MLP input -> MLP output) instead of SAEs.
        skip: give each transcoder a linear skip term ``W_skip`` (transcoders only).
        massive: leave out of the training batches the rows whose input or target norm is
            over this many times the batch's median (*massive activations*, Sun et al. 2024:
            a few delimiter tokens act as second attention sinks, with norms ~100x the rest,
            and one such row would outweigh the batch's loss); 0 keeps every row.
        d_sae: latents per dictionary.
        k: active latents per token (TopK).
        tokens: training tokens (positions 1.. of every window; the sink is left out).
        context: tokens per window (BOS included).
        batch: windows per step.
        lr: Adam's learning rate (None: Gao et al.'s ``2e-4 / sqrt(d_sae / 2^14)``).
        warmup: linear warm-up steps.
        decay: the last fraction of steps over which the learning rate falls to 0.
        aux_coeff: AuxK's coefficient (1/32; 0 turns dead-latent revival off).
        k_aux: AuxK's latents (None: ``d_in // 2``).
        dead_after: tokens without firing after which a latent counts as dead (None: a
            tenth of the run, at least one step).
        l1_coeff: the L1 penalty of ``kind="relu"``.
        seed: the initial weights' and the windows' seed.
        checkpoint_every: steps between checkpoints (0: only at the end).
        keep: checkpoints kept.
        eval_tokens: tokens to evaluate each dictionary on at the end (0: no evaluation).
        progress: show a progress bar.
        threads: torch threads (None: leave as it is).
        stop_after: stop this invocation after so many steps (a checkpoint is saved; None:
            run to the end). For tests and for splitting a long run.
        model_source: the model's source, for the record (``--model``).
        corpus_source: the corpus' name, for the record (``--corpus``).
    """

    at: str | list[str]
    kind: str = "topk"
    transcoder: bool = False
    skip: bool = False
    massive: float = 10.0
    d_sae: int = 4096
    k: int | None = 32
    tokens: int = 1_000_000
    context: int = 128
    batch: int = 8
    lr: float | None = None
    warmup: int = 20
    decay: float = 0.2
    aux_coeff: float = 1 / 32
    k_aux: int | None = None
    dead_after: int | None = None
    l1_coeff: float = 1.0
    seed: int = 0
    checkpoint_every: int = 200
    keep: int = 2
    eval_tokens: int = 0
    progress: bool = True
    threads: int | None = None
    stop_after: int | None = None
    model_source: str | None = None
    corpus_source: str | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad option and its value."""
        from handformer.checks import check_non_negative_int, check_positive_int, check_seed

        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)} to train (JumpReLU "
                             f"dictionaries are loaded, not trained), got {self.kind!r}")
        for name in ("d_sae", "tokens", "context", "batch", "keep"):
            check_positive_int(name, getattr(self, name))
        for name in ("checkpoint_every", "eval_tokens", "warmup"):
            check_non_negative_int(name, getattr(self, name))
        for name in ("k_aux", "dead_after", "threads", "stop_after"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        check_seed(self.seed)
        if self.context < 2:
            raise ValueError(f"context must be at least 2 tokens, got {self.context}")
        if self.kind == "topk" and (isinstance(self.k, bool) or not isinstance(self.k, int)
                                    or not 1 <= self.k <= self.d_sae):
            raise ValueError(f"k must be an integer in [1, d_sae={self.d_sae}], got {self.k!r}")
        if self.skip and not self.transcoder:
            raise ValueError("skip=True is a transcoder's option (pass transcoder=True)")
        if isinstance(self.massive, bool) or not isinstance(self.massive, int | float) \
                or not (self.massive == 0 or self.massive > 1):
            raise ValueError(f"massive must be 0 (keep every row) or a factor > 1, got "
                             f"{self.massive!r}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")
        if not 0 <= self.decay <= 1:
            raise ValueError(f"decay must be in [0, 1], got {self.decay!r}")
        if not (self.aux_coeff >= 0 and self.l1_coeff >= 0):
            raise ValueError(f"aux_coeff and l1_coeff must be >= 0, got {self.aux_coeff!r}, "
                             f"{self.l1_coeff!r}")

    def rows_per_step(self) -> int:
        """Training tokens of one step: ``batch * (context - 1)``."""
        return self.batch * (self.context - 1)

    def steps(self) -> int:
        """Optimiser steps of the run (``tokens`` rounded up to whole steps)."""
        return -(-self.tokens // self.rows_per_step())


@dataclass
class TrainDictionaryResult:
    """What :func:`train_dictionary` returns.

    Attributes:
        out: the run folder (None when no ``out`` was given).
        dictionaries: hook name -> the trained dictionary (raw units, ready to attach).
        step: optimiser steps done; tokens: training tokens seen.
        finished: the run reached its tokens; interrupted: stopped by Ctrl-C / SIGTERM.
        read_tokens_per_s: the model's activations, tokens per second (this invocation).
        train_tokens_per_s: the dictionaries' steps, tokens per second (this invocation).
        metrics: hook name -> :class:`~handformer.features.metrics.DictionaryMetrics`
            (when ``eval_tokens`` > 0).
        history: the logged records of this invocation.
        train_s: seconds of this invocation's training loop (activations and steps).
        eval_s: seconds of the evaluation after it (0 without one).
    """

    out: Path | None
    dictionaries: dict[str, Dictionary]
    step: int
    tokens: int
    finished: bool
    interrupted: bool = False
    read_tokens_per_s: float = 0.0
    train_tokens_per_s: float = 0.0
    metrics: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    train_s: float = 0.0
    eval_s: float = 0.0


def export(dset: DictionarySet, sites: Sequence[Site]) -> dict[str, Dictionary]:
    """The trained dictionaries as :class:`SparseAutoencoder` / :class:`Transcoder` modules
    reading raw activations (the training scales folded in)."""
    out: dict[str, Dictionary] = {}
    kind, k = dset.config["kind"], dset.config["k"]
    k = k if kind == "topk" else None
    for site, (at, td) in zip(sites, dset.items(), strict=True):
        d_in, d_sae = td.W_enc.shape
        if site.transcoder:
            d: Dictionary = Transcoder(d_in, d_sae, td.W_dec.shape[1], activation=kind, k=k,
                                       hook_name=f"blocks.{site.layer}.mlp.hook_in",
                                       output_hook_name=at, skip=td.W_skip is not None)
        else:
            d = SparseAutoencoder(d_in, d_sae, activation=kind, k=k, hook_name=at)
        with torch.no_grad():
            for name, value in td.folded().items():
                getattr(d, name).copy_(value)
        d.meta = {"format": "handformer", "trained": {k2: v for k2, v in dset.config.items()
                                                     if k2 != "sites"}}
        out[at] = d.eval()
    return out


def _prepare(out: Path, resume: bool, config: SAETrainConfig, given: dict) -> SAETrainConfig:
    if resume:
        path = out / OPTIONS_NAME
        if not path.is_file():
            raise ValueError(f"{out} is not a train-sae run folder (no {OPTIONS_NAME}); "
                             "--resume takes the folder a previous run wrote")
        saved = SAETrainConfig(**json.loads(path.read_text()))
        for name in RESUMABLE:  # what this invocation may change, where it says so
            if name in given:
                setattr(saved, name, given[name])
        saved.stop_after = given.get("stop_after")
        return saved
    if (out / OPTIONS_NAME).exists():
        raise ValueError(f"{out} already holds a train-sae run; continue it with --resume "
                         f"{out} or choose another --out")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty folder")
    return config


def train_dictionary(model: nn.Module, corpus: object, *, at: str | Sequence[str],
                     kind: str = "topk", transcoder: bool = False, d_sae: int = 4096,
                     k: int | None = 32, tokens: int | None = None, tokenizer: object = None,
                     out: str | Path | None = None, resume: bool = False,
                     **options: object) -> TrainDictionaryResult:
    """Train one dictionary per site of ``at``, all from one stream of the model's activations.

    Args:
        model: a handformer causal LM (eval mode is set; its weights are not changed).
        corpus: a corpus name (``en``, ``zh``, ``mixed``), a file, a list of strings, or a
            ``(T,)`` tensor of token ids.
        at: hook name(s) or a glob; a transcoder's ``blocks.N.hook_mlp_out`` or ``"all"``.
        kind: ``"topk"`` or ``"relu"``.
        transcoder: train transcoders (MLP input -> MLP output).
        d_sae, k, tokens: latents, active latents per token (TopK), training tokens
            (default 1,000,000; on resume the run's own unless given).
        tokenizer: the model's tokenizer (for a text corpus).
        out: the run folder (checkpoints, dictionaries, metrics); None keeps it in memory.
        resume: continue the run in ``out`` from its newest checkpoint.
        **options: the other fields of :class:`SAETrainConfig` (``context``, ``batch``,
            ``lr``, ``aux_coeff``, ``seed``, ``eval_tokens``, ``progress``, ...).

    Returns:
        A :class:`TrainDictionaryResult`.

    Raises:
        ValueError: for bad options (naming the option), a folder that is not a run
            (``resume``) or already one, a corpus too small; ``CheckpointError`` for a
            corrupt checkpoint. KeyError: for an unknown hook name.
    """
    given = {**options, **({"tokens": tokens} if tokens is not None else {})}
    config = SAETrainConfig(at=at if isinstance(at, str) else list(at), kind=kind,
                            transcoder=transcoder, d_sae=d_sae, k=k, **given)  # type: ignore
    return _start(model, corpus, tokenizer, config, out, resume, given)


def _start(model: nn.Module | None, corpus: object, tokenizer: object, config: SAETrainConfig,
           out: str | Path | None, resume: bool, given: dict) -> TrainDictionaryResult:
    out_path = Path(out) if out is not None else None
    if resume and out_path is None:
        raise ValueError("resume=True needs out= (the run folder to continue)")
    if out_path is not None:
        config = _prepare(out_path, resume, config, given)
    config.validate()
    threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    cuda = model is not None and next(model.parameters()).is_cuda
    info = D.setup("cuda" if cuda else "cpu")
    try:
        return _run(model, corpus, tokenizer, config, out_path, resume, info)
    finally:
        D.teardown(info)
        torch.set_num_threads(threads)


def train_on_activations(data: object, *, d_sae: int, k: int | None = 32, rows: int,
                         tokens: int, kind: str = "topk", at: str = "activations",
                         out: str | Path | None = None, resume: bool = False,
                         **options: object) -> TrainDictionaryResult:
    """Train one SAE on activations you make: ``data(step)`` returns the ``(rows, E)`` float
    batch of that step (a function of the step, for resuming). The same recipe and run folder
    as :func:`train_dictionary`, without a model (no evaluation).

    Args:
        data: ``data(step) -> (rows, E)`` float tensor, the same for the same step.
        d_sae: the number of features.
        k: active features per row (TopK).
        rows: rows per step.
        tokens: rows in all (the run's length).
        kind: ``"topk"`` or ``"relu"``.
        at: a name for the site (written into the dictionary's ``hook_name``).
        out: the run folder (None: in memory only).
        resume: continue the run in ``out``.
        options: further fields of the training config (as :func:`train_dictionary`).

    Returns:
        The :class:`TrainDictionaryResult`.

    Raises:
        ValueError: as :func:`train_dictionary`.
    """
    if not callable(data):
        raise TypeError(f"data must be a function step -> (rows, E) tensor, got "
                        f"{type(data).__name__}")
    config = SAETrainConfig(at=at, kind=kind, d_sae=d_sae, k=k, tokens=tokens, batch=rows,
                            context=2, **options)  # type: ignore[arg-type]
    return _start(None, data, None, config, out, resume, {"tokens": tokens, **options})


def _run(model: nn.Module | None, corpus: object, tokenizer: object, config: SAETrainConfig,
         out: Path | None, resume: bool, info: D.DistInfo) -> TrainDictionaryResult:
    if model is not None:
        model.eval()
        sites = parse_sites(model, config.at, transcoder=config.transcoder)
        reader = ActivationReader(model, sites)
        # enough text for the run (windows are drawn with replacement) and a held-out tail
        ids, bos = corpus_ids(model, corpus, tokenizer, seed=config.seed,
                              max_tokens=2 * config.tokens + 2 * config.eval_tokens + 10_000,
                              progress=config.progress and info.is_main)
        windows, held_out = split_windows(ids, bos, context=config.context, seed=config.seed)

        def source(step: int, whole: bool = False) -> dict:
            ids = windows.batch(step, config.batch)  # (B, L)
            return reader.read((ids if whole else _shard(ids, info)).to(info.device))
    else:  # train_on_activations: corpus is data(step) -> (N, E)
        sites = [Site(str(config.at))]

        def source(step: int, whole: bool = False) -> dict:
            x = corpus(step)  # type: ignore[operator]
            x = x if whole else _shard(x, info)
            return {sites[0].at: (x.to(info.device), x.to(info.device))}
    return _fit(sites, source, config, out, resume, info, model,
                (windows, held_out) if model is not None else None)


def _fit(sites: list[Site], source: object, config: SAETrainConfig, out: Path | None,
         resume: bool, info: D.DistInfo, model: nn.Module | None,
         data: tuple[TokenWindows, TokenWindows | None] | None) -> TrainDictionaryResult:
    from handformer.train.trainer import _StopRequest

    steps = config.steps()
    first = source(0, True)
    g = torch.Generator().manual_seed(config.seed)
    dims = {s.at: (first[s.at][0].shape[-1], first[s.at][1].shape[-1]) for s in sites}
    set_config = {"kind": config.kind, "k": config.k if config.kind == "topk" else None,
                  "d_sae": config.d_sae, "transcoder": config.transcoder}
    if config.skip:  # only when set: runs from before the option resume unchanged
        set_config["skip"] = True
    dset = DictionarySet(set_config, dims, g).to(info.device)
    for s, (_, td) in zip(sites, dset.items(), strict=True):
        td.initialise(*typical_rows(*first[s.at], config.massive))
    del first
    params = list(dset.parameters())
    lr = config.lr if config.lr is not None else paper_lr(config.d_sae)
    optimizer = torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999), eps=6.25e-10)
    decay_start = int(steps * (1 - config.decay))
    schedule = Schedule("constant", lr, min(config.warmup, steps), steps)
    d_in = max(d[0] for d in dims.values())
    k_aux = config.k_aux or max(d_in // 2, 1)
    dead_after = config.dead_after or max(config.tokens // 10, config.rows_per_step())

    start, seen, elapsed_before = 0, 0, 0.0
    expected = json.loads(json.dumps(dset.config))
    latest = ckpt.latest_checkpoint(out) if (resume and out is not None) else None
    if info.is_main and resume and out is not None:
        ckpt.remove_stale_temporaries(out)
    if latest is not None:
        state, rng = ckpt.load_checkpoint(latest, dset, optimizer, expected)
        start, seen = int(state["step"]), int(state["tokens"])
        elapsed_before = float(state.get("elapsed_s", 0.0))
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
    if out is not None and info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        ckpt.atomic_write_bytes(out / OPTIONS_NAME,
                                (json.dumps(asdict(config), indent=1) + "\n").encode())
        if resume:
            _truncate(out / METRICS_NAME, start)

    def lr_at(step: int) -> float:
        if step >= decay_start and steps > decay_start:
            return schedule(step) * (steps - step) / (steps - decay_start)
        return schedule(step)

    t0 = time.perf_counter()

    def save(step: int) -> None:
        if out is None:
            return
        if info.is_main:
            state = {"tokens": seen, "elapsed_s": round(elapsed_before + time.perf_counter()
                                                        - t0, 3),
                     "data": {"kind": "step-seeded", "seed": config.seed, "next_step": step},
                     "world_size": info.world_size}
            ckpt.save_checkpoint(out, step, dset, optimizer, state,
                                 {"torch": torch.get_rng_state()})
            ckpt.prune_checkpoints(out, config.keep)
        D.barrier(info)

    bar = None
    if info.is_main and config.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, initial=start, unit="step", dynamic_ncols=True,
                   mininterval=0.5, file=sys.stderr, desc=f"train-sae {len(sites)} site(s)")
    rows = config.rows_per_step()
    history: list[dict] = []
    t_read = t_train = 0.0
    done_rows = 0
    interrupted = False
    step = start
    with _StopRequest() as stop:
        for step in range(start, steps):
            t1 = time.perf_counter()
            acts = source(step)
            t2 = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            optimizer.zero_grad(set_to_none=True)
            parts_all = {}
            for s, (at, td) in zip(sites, dset.items(), strict=True):
                x, y = typical_rows(*acts[s.at], config.massive)
                loss, parts = td.losses(x, y, dead_after=dead_after, k_aux=k_aux,
                                        aux_coeff=config.aux_coeff, l1_coeff=config.l1_coeff)
                loss.backward()  # one site's graph at a time (their parameters are disjoint)
                parts_all[at] = parts
            _average_gradients(params, info)
            for _, td in dset.items():
                project_decoder_grad(td.W_dec)
                torch.nn.utils.clip_grad_norm_(list(td.parameters()), 1.0)
            optimizer.step()
            for at, td in dset.items():
                normalise_decoder(td.W_dec)
                td.count_firing(_any_rank(parts_all[at]["fired"], info), rows)
            seen += rows
            done_rows += rows
            t_read += t2 - t1
            t_train += time.perf_counter() - t2
            if info.is_main and (step % 10 == 0 or step == steps - 1):
                rec = _record(step + 1, seen, lr_at(step), parts_all, config.d_sae)
                history.append(rec)
                if out is not None:
                    with open(out / METRICS_NAME, "a") as f:
                        f.write(json.dumps(rec) + "\n")
                if bar is not None:
                    bar.set_postfix(mse=f"{rec['mse']:.3f}", l0=f"{rec['l0']:.0f}",
                                    dead=f"{rec['dead']:.2f}")
            if bar is not None:
                bar.update(1)
            if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0 \
                    and step + 1 < steps:
                save(step + 1)
            interrupted = D.any_flag(stop.requested, info)
            if interrupted or (config.stop_after is not None
                               and step + 1 - start >= config.stop_after):
                step += 1
                break
        else:
            step = steps
    if bar is not None:
        bar.close()
    if step > start or latest is None:
        save(step)
    dictionaries = export(dset, sites)
    result = TrainDictionaryResult(
        out, dictionaries, step, seen, step >= steps, interrupted,
        read_tokens_per_s=done_rows / t_read if t_read else 0.0,
        train_tokens_per_s=done_rows / t_train if t_train else 0.0, history=history,
        train_s=time.perf_counter() - t0)
    if config.eval_tokens and not interrupted and model is not None:
        from handformer.features.metrics import evaluate_dictionaries

        windows, held_out = data
        ev_windows = held_out or TokenWindows(windows.ids, windows.length, bos=windows.bos,
                                              seed=config.seed + 1)
        t_eval = time.perf_counter()
        result.metrics.update(evaluate_dictionaries(model, dictionaries, ev_windows,
                                                    tokens=config.eval_tokens))
        result.eval_s = time.perf_counter() - t_eval
    if out is not None and info.is_main:
        _write_outputs(out, result)
    return result


def _shard(batch: torch.Tensor, info: D.DistInfo) -> torch.Tensor:
    """This rank's rows of a step's windows (all of them in one process)."""
    from handformer.train.data import shard_rows

    return shard_rows(batch, info.rank, info.world_size)


def _average_gradients(params: list[nn.Parameter], info: D.DistInfo) -> None:
    """Average every gradient over the ranks (what DDP does; a no-op in one process)."""
    if not info.enabled:
        return
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= info.world_size


def _any_rank(flags: torch.Tensor, info: D.DistInfo) -> torch.Tensor:
    if not info.enabled:
        return flags
    t = flags.to(torch.uint8)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.bool()


def _record(step: int, tokens: int, lr: float, parts: dict, d_sae: int) -> dict:
    """One metrics.jsonl record: the mean over sites, and each site's numbers."""
    per = {at: {"mse": float(p["mse"]), "aux": float(p["aux"]), "l0": float(p["l0"]),
                "dead": float(p["dead"]) / d_sae} for at, p in parts.items()}
    mean = {key: sum(v[key] for v in per.values()) / len(per) for key in
            ("mse", "aux", "l0", "dead")}
    return {"step": step, "tokens": tokens, "lr": lr, **mean, "sites": per}


def _truncate(path: Path, step: int) -> None:
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    ckpt.atomic_write_bytes(path, "".join(f"{x}\n" for x in keep).encode())


def _write_outputs(out: Path, result: TrainDictionaryResult) -> None:
    from handformer.features.store import save_dictionary

    for at, d in result.dictionaries.items():
        save_dictionary(d, out / DICTIONARIES / at)
    summary = {"step": result.step, "tokens": result.tokens, "finished": result.finished,
               "interrupted": result.interrupted,
               "read_tokens_per_s": round(result.read_tokens_per_s, 1),
               "train_tokens_per_s": round(result.train_tokens_per_s, 1),
               "metrics": {at: m.to_dict() for at, m in result.metrics.items()}}
    ckpt.atomic_write_bytes(out / "summary.json", (json.dumps(summary, indent=1) + "\n").encode())
