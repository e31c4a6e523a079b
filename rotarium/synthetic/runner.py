"""Training a small model on a synthetic task and measuring its accuracy (sweeps: ``rotarium.synthetic.sweep``).

A run is one model trained from scratch on freshly generated batches (a new batch every step, so there is no
overfitting to a fixed set), with the training job's AdamW and warmup + cosine schedule, then evaluated on held-out
batches from another seed at each evaluation length. Accuracy is per scored token (argmax); ``sequence_accuracy`` is
the share of sequences with every scored token right (for copying, teacher-forced exact match equals greedy
exact match).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F

from rotarium.layers.positional import POSITION_ENCODINGS
from rotarium.models.configuration import CONFIGS
from rotarium.models.modeling import FAMILY_MODELS
from rotarium.synthetic.tasks import IGNORE, TASKS, make_batch
from rotarium.training.config import OptimSection
from rotarium.training.optim import build_optimizer, clip_norm, set_learning_rate
from rotarium.utils.devices import check_device

FAMILIES = tuple(FAMILY_MODELS)
POSITIONS = POSITION_ENCODINGS


# Model-config fields a synthetic run sets from its own flags or its task: an --option naming one would conflict.
SET_BY_RUN = {"vocab_size": "the task (--vocab-size for mqar)", "hidden_size": "--hidden-size",
              "num_hidden_layers": "--layers", "num_heads": "--heads", "position_encoding": "--position",
              "max_position_embeddings": "--train-length", "pad_token_id": "the task", "bos_token_id": "the task",
              "eos_token_id": "the task", "use_cache": "the run"}


@dataclass
class RunSettings:
    """Everything a run depends on; ``None`` fields take the task's default (``TASKS[task]``), or with ``paper`` the
    reference's setting of the task (``TASKS[task].paper``) scaled down for a CPU. ``optim_options`` are
    :class:`~rotarium.training.config.OptimSection` fields over the training job's defaults."""

    task: str
    family: str | None = None  # None: the reference's family with ``paper``, else the Transformer
    position: str = "selective_rope"
    num_layers: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    steps: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    train_length: int | None = None
    eval_lengths: list[int] | None = None
    num_pairs: int | None = None
    vocab_size: int | None = None
    eval_batches: int = 4
    seed: int = 0
    model_options: dict[str, Any] = field(default_factory=dict)
    optim_options: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    paper: bool = False

    def resolved(self) -> RunSettings:
        """A copy with every ``None`` replaced by the reference's value (``paper``) or the task default, checked.

        Explicit fields and options win over the reference's. Resolving twice gives the same settings; a sweep
        resolves each family from the unresolved settings, since the reference's options depend on the family.
        """
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose one of {', '.join(TASKS)}")
        spec = TASKS[self.task]
        values = asdict(self)
        if self.paper:
            if spec.paper is None:
                with_paper = ", ".join(name for name, task in TASKS.items() if task.paper is not None)
                raise ValueError(f"{self.task} has no reference setting for --paper (tasks with one: {with_paper})")
            reference = {**spec.paper.run, **spec.paper.cpu}
            for name, value in reference.items():
                if values[name] is None:
                    values[name] = value
            family_options = spec.paper.family_model.get(values["family"], {})
            values["model_options"] = {**spec.paper.model, **family_options, **self.model_options}
            values["optim_options"] = {**spec.paper.optim, **self.optim_options}
        values["family"] = values["family"] or "transformer"
        if values["family"] not in FAMILIES:
            raise ValueError(f"unknown --family {values['family']!r}; choose one of {', '.join(FAMILIES)}")
        if self.position not in POSITIONS:
            raise ValueError(f"unknown --position {self.position!r}; choose one of {', '.join(POSITIONS)}")
        unknown = set(values["optim_options"]) - {f.name for f in fields(OptimSection)} | (
            set(values["optim_options"]) & {"lr", "warmup_steps"})
        if unknown:
            raise ValueError(f"unknown optimiser options {sorted(unknown)}; use OptimSection fields other than lr "
                             "and warmup_steps (the run sets both)")
        for name in ("num_layers", "hidden_size", "num_heads", "steps", "batch_size", "lr", "train_length",
                     "eval_lengths", "num_pairs", "vocab_size"):
            if values[name] is None:
                values[name] = getattr(spec, name)
        CONFIGS[values["family"]].validate_options(values["model_options"], prefix="--option ",
                                                set_elsewhere=SET_BY_RUN)
        out = RunSettings(**values)
        for name in ("num_layers", "hidden_size", "num_heads", "steps", "batch_size", "train_length",
                     "eval_batches"):
            if getattr(out, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(out, name)}")
        if not out.eval_lengths or min(out.eval_lengths) < 1:
            raise ValueError(f"--eval-lengths must be positive integers, got {out.eval_lengths}")
        # the task's generator checks what it can hold (MQAR's pairs and queries): asked here for every length, so
        # that a length it refuses stops the run before training, not when the trained model is evaluated
        for flag, length, train in (("--train-length", out.train_length, True),
                                    *(("--eval-lengths", length, False) for length in out.eval_lengths)):
            try:
                make_batch(out.task, 1, length, torch.Generator(), train=train, num_pairs=out.num_pairs,
                           vocab_size=out.vocab_size)
            except ValueError as error:
                raise ValueError(f"{flag} {length}: {error}") from None
        check_device(out.device)
        return out


def paper_scaling(settings: RunSettings) -> list[str]:
    """For a ``paper`` run: every reference value the run does not use (scaled for a CPU, or set explicitly) and
    every reference setting rotarium cannot express exactly, one line each."""
    s = settings.resolved()
    reference = TASKS[s.task].paper
    if not s.paper or reference is None:
        return []
    lines = []
    for name in dict.fromkeys(("steps", "batch_size", "hidden_size", *reference.run)):
        ours = getattr(s, name)
        theirs = reference.run.get(name, "not fixed")
        if ours != theirs:
            why = "scaled for a CPU" if reference.cpu.get(name) == ours else "set explicitly"
            lines.append(f"{name}: reference {theirs}, this run {ours} ({why})")
    return lines + [f"not exact: {gap}" for gap in reference.gaps]


@dataclass
class RunResult:
    settings: RunSettings
    train_loss: float
    train_seconds: float
    parameters: int
    evaluations: list[dict[str, float]]  # {"length", "accuracy", "sequence_accuracy"}
    eval_seconds: float = 0.0

    def accuracy(self, length: int) -> float:
        return next(e["accuracy"] for e in self.evaluations if e["length"] == length)


def build_model(settings: RunSettings) -> torch.nn.Module:
    s = settings
    # the config's training context is in tokens (a RoPE scaling's original length): the longest training sequence,
    # which copying's separator and copy and the word problems' <bos> make longer than the task's length; an
    # evaluation batch at the training length holds it (copying trains on every length up to it)
    tokens = make_batch(s.task, 1, s.train_length, torch.Generator(), train=False, num_pairs=s.num_pairs,
                        vocab_size=s.vocab_size)[0].shape[1]
    config = CONFIGS[s.family](
        vocab_size=s.vocab_size if s.task == "mqar" else TASKS[s.task].vocab_size, hidden_size=s.hidden_size,
        num_hidden_layers=s.num_layers, num_heads=s.num_heads, position_encoding=s.position,
        max_position_embeddings=tokens, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        use_cache=False, **s.model_options)
    return FAMILY_MODELS[s.family].lm(config)


def _batch(settings: RunSettings, length: int, generator: torch.Generator, train: bool):
    x, y = make_batch(settings.task, settings.batch_size, length, generator, train=train,
                      num_pairs=settings.num_pairs, vocab_size=settings.vocab_size)
    return x.to(settings.device), y.to(settings.device)


def _loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE), logits


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, settings: RunSettings,
                  generator: torch.Generator, max_norm: float) -> float:
    """One step on a fresh training batch (``settings.batch_size`` sequences at the training length); returns its
    loss. A non-finite loss skips the update, as the training job does for a diverging model."""
    loss, _ = _loss(model, *_batch(settings, settings.train_length, generator, train=True))
    value = float(loss.detach())
    if math.isfinite(value):
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value


def seconds_per_call(step: Callable[[], object], calls: int, warmup: int) -> float:
    """``step``'s mean wall time on one thread (a sweep runs one process per core) over ``calls`` calls after
    ``warmup`` untimed ones: what the sweeps plan their time with."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(warmup):
            step()
        start = time.perf_counter()
        for _ in range(calls):
            step()
        return (time.perf_counter() - start) / calls
    finally:
        torch.set_num_threads(threads)


def seconds_per_step(settings: RunSettings, steps: int = 6, warmup: int = 2) -> float:
    """A training step's wall time for ``settings`` on one thread (evaluation not included)."""
    s = settings.resolved()
    torch.manual_seed(s.seed)
    model = build_model(s).to(s.device)
    optim = OptimSection(lr=s.lr, warmup_steps=1, **s.optim_options)
    optimizer = build_optimizer(model, optim)
    generator = torch.Generator().manual_seed(s.seed)
    return seconds_per_call(lambda: training_step(model, optimizer, s, generator, clip_norm(optim)), steps, warmup)


@torch.no_grad()
def evaluate(model: torch.nn.Module, settings: RunSettings, length: int) -> dict[str, float]:
    """Accuracy on ``eval_batches`` batches at ``length`` from a seed no training batch uses."""
    generator = torch.Generator().manual_seed(1_000_003 + settings.seed)
    model.eval()
    right = scored = full = rows = 0
    for _ in range(settings.eval_batches):
        x, y = _batch(settings, length, generator, train=False)
        logits = model(input_ids=x, use_cache=False).logits
        mask = y != IGNORE
        correct = (logits.argmax(-1) == y) & mask
        right += int(correct.sum())
        scored += int(mask.sum())
        full += int((correct.sum(1) == mask.sum(1)).sum())
        rows += x.shape[0]
    model.train()
    return {"length": length, "accuracy": right / max(scored, 1), "sequence_accuracy": full / max(rows, 1)}


def train_model(settings: RunSettings, progress: bool = False) -> tuple[torch.nn.Module, float, float]:
    """A fresh model trained on ``settings.task``: ``(model, mean loss of the last 50 steps, seconds)``."""
    from tqdm.auto import tqdm

    s = settings.resolved()
    torch.manual_seed(s.seed)
    model = build_model(s).to(s.device)
    # the training job's defaults, with a warmup of a tenth of the steps
    optim = OptimSection(lr=s.lr, warmup_steps=max(1, s.steps // 10), **s.optim_options)
    optimizer = build_optimizer(model, optim)
    generator = torch.Generator().manual_seed(s.seed)
    start, recent = time.perf_counter(), []
    bar = tqdm(range(s.steps), desc=f"{s.task} {s.family} {s.position}", disable=not progress, leave=False,
               dynamic_ncols=True)
    for step in bar:
        set_learning_rate(optimizer, optim, step, s.steps)
        loss = training_step(model, optimizer, s, generator, clip_norm(optim))
        if not math.isfinite(loss):
            continue
        recent = (recent + [loss])[-50:]
        if step % 25 == 0:
            bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}")
    return model, sum(recent) / max(len(recent), 1), time.perf_counter() - start


def train_and_evaluate(settings: RunSettings, progress: bool = True) -> RunResult:
    """Trains a fresh model on ``settings.task`` and evaluates it at every evaluation length."""
    s = settings.resolved()
    model, train_loss, seconds = train_model(s, progress)
    start = time.perf_counter()
    evaluations = [evaluate(model, s, length) for length in s.eval_lengths]
    return RunResult(s, train_loss, seconds, sum(p.numel() for p in model.parameters()), evaluations,
                     time.perf_counter() - start)
