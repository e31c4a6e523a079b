"""Synthetic tasks, generated on the fly from a seeded ``torch.Generator`` (no data files).

Every task turns a batch request into ``(input_ids, targets)``, both ``[B, T]`` int64: ``targets[b, t]`` is the token
the model must output at position ``t`` (read from the logits at ``t``, no shift), ``-100`` where nothing is scored.
Variable-length batches are right-padded: a causal model never sees the padding from a scored position.

- ``mqar``: multi-query associative recall (Arora et al., 2023, Zoology): key-value pairs, then the keys again in a
  random order at random places; at each queried key the model outputs its value.
- ``copying``: a string over 26 letters, a separator, the string again; scored on the copy. Trained on lengths
  2 to the training length, evaluated on longer strings (length generalisation).
- ``s2`` / ``a3``: the word problem of S2 (parity) and of A3 (the cyclic group of order 3, isomorphic to Z3): at
  every position the model outputs the product of the group elements so far.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

IGNORE = -100


def _uniform_int(low: int, high: int, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=generator)


def _random_subsets(batch: int, population: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """``[batch, size]``: for every row, ``size`` distinct values of ``range(population)`` in random order."""
    return torch.rand(batch, population, generator=generator).argsort(dim=1)[:, :size]


# ------------------------------------------------------------------------------------------------------------ MQAR
def mqar_batch(batch: int, seq_len: int, num_pairs: int, vocab_size: int, generator: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``k_1 v_1 ... k_n v_n`` then, in the remaining ``seq_len - 2n`` positions, every key once as a query
    followed by its value, at random even-aligned slots, the rest filled with token 0. Keys come from
    ``[1, vocab/2)`` (distinct within a sequence), values from ``[vocab/2, vocab)``. Scored: the value at each query.
    """
    if num_pairs < 1 or 4 * num_pairs > seq_len:
        raise ValueError(f"MQAR needs 1 <= num_pairs <= seq_len / 4 (pairs, then a query and answer per pair); "
                         f"got num_pairs={num_pairs}, seq_len={seq_len}")
    if vocab_size // 2 - 1 < num_pairs:
        raise ValueError(f"MQAR needs vocab_size >= 2 * (num_pairs + 1) for distinct keys; got vocab_size="
                         f"{vocab_size}, num_pairs={num_pairs}")
    n, half = num_pairs, vocab_size // 2
    keys = _random_subsets(batch, half - 1, n, generator) + 1
    values = _uniform_int(half, vocab_size, (batch, n), generator)
    inputs = torch.zeros(batch, seq_len, dtype=torch.long)
    targets = torch.full((batch, seq_len), IGNORE, dtype=torch.long)
    inputs[:, 0:2 * n:2], inputs[:, 1:2 * n:2] = keys, values
    slots = _random_subsets(batch, (seq_len - 2 * n) // 2, n, generator).sort(dim=1).values
    query_positions = 2 * n + 2 * slots
    order = _random_subsets(batch, n, n, generator)  # which pair each query asks for
    asked_keys, asked_values = keys.gather(1, order), values.gather(1, order)
    inputs.scatter_(1, query_positions, asked_keys)
    inputs.scatter_(1, query_positions + 1, asked_values)
    targets.scatter_(1, query_positions, asked_values)
    return inputs, targets


# --------------------------------------------------------------------------------------------------------- copying
COPY_ALPHABET = 26
COPY_BOS, COPY_SEP = COPY_ALPHABET, COPY_ALPHABET + 1


def copying_batch(batch: int, min_length: int, max_length: int, generator: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``<bos> x_1 .. x_n <sep> x_1 .. x_n`` with ``n`` uniform in ``[min_length, max_length]`` per row; at
    ``<sep>`` and at each copied letter but the last the model outputs the next letter of the copy."""
    if not 1 <= min_length <= max_length:
        raise ValueError(f"copying needs 1 <= min_length <= max_length, got {min_length}, {max_length}")
    lengths = _uniform_int(min_length, max_length + 1, (batch,), generator)
    letters = _uniform_int(0, COPY_ALPHABET, (batch, max_length), generator)
    T = 2 * max_length + 2
    inputs = torch.zeros(batch, T, dtype=torch.long)
    targets = torch.full((batch, T), IGNORE, dtype=torch.long)
    positions = torch.arange(max_length)
    for b in range(batch):  # rows differ in length; B is small and the loop is over rows, not time
        n = int(lengths[b])
        s = letters[b, :n]
        inputs[b, 0], inputs[b, 1:n + 1], inputs[b, n + 1], inputs[b, n + 2:2 * n + 2] = COPY_BOS, s, COPY_SEP, s
        targets[b, n + 1 + positions[:n]] = s
    return inputs[:, :int(2 * lengths.max()) + 2], targets[:, :int(2 * lengths.max()) + 2]


# -------------------------------------------------------------------------------------------------- word problems
def word_problem_batch(batch: int, length: int, group_order: int, generator: torch.Generator
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``<bos> g_1 .. g_T`` with ``g_t`` uniform in the cyclic group ``Z_order`` (S2 = Z2: parity; A3 = Z3); at
    position ``t`` the model outputs ``g_1 + ... + g_t mod order``. Token ``order`` is ``<bos>``."""
    if length < 1 or group_order < 2:
        raise ValueError(f"word problems need length >= 1 and a group of order >= 2; got {length}, {group_order}")
    elements = _uniform_int(0, group_order, (batch, length), generator)
    inputs = torch.cat([torch.full((batch, 1), group_order, dtype=torch.long), elements], dim=1)
    states = elements.cumsum(dim=1) % group_order
    targets = torch.cat([torch.full((batch, 1), IGNORE, dtype=torch.long), states], dim=1)
    return inputs, targets


# ----------------------------------------------------------------------------------------------------------- tasks
REFERENCE_REPOSITORY = "https://github.com/timurcarstensen/selective-rope"


@dataclass(frozen=True)
class PaperSetting:
    """A task as the Selective RoPE reference (Movahedi et al., ICLR 2026; its public repository,
    ``REFERENCE_REPOSITORY``) configures it, in rotarium's names. docs/reference_settings.md maps every option.

    ``run`` holds :class:`~rotarium.synthetic.runner.RunSettings` fields at the reference's values, ``optim``
    :class:`~rotarium.training.config.OptimSection` fields, ``model`` config fields of every family and
    ``family_model`` those of one family. ``cpu`` scales steps, batch and width down to what a CPU run affords;
    ``gaps`` names what rotarium cannot express exactly and what it uses instead.
    """

    sources: tuple[str, ...]  # the reference's config files, relative to its repository
    run: dict[str, Any]
    optim: dict[str, Any]
    model: dict[str, Any]
    family_model: dict[str, dict[str, Any]] = field(default_factory=dict)
    cpu: dict[str, int] = field(default_factory=dict)
    gaps: tuple[str, ...] = ()


@dataclass
class TaskSpec:
    """A task with its defaults: what a CPU run in minutes uses, and the reference's setting in ``paper``.

    The defaults aim at a sweep (4 families x 4 options x 3 seeds, times ``sweep_lrs``) that a laptop's CPU runs
    (a sweep prints its timed estimate; docs/results.md has each table's), at a width where the families can
    learn the task in distribution, so that the table compares positional options rather than models too small for
    the task (docs/results.md says which do).
    """

    name: str
    description: str
    vocab_size: int
    train_length: int  # the (maximum) length trained on, in the task's own unit
    eval_lengths: list[int]
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 2
    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-3
    num_pairs: int = 8  # mqar only
    sweep_lrs: tuple[float, ...] = ()  # the learning rates a sweep tries (default: ``lr`` alone)
    length_unit: str = "tokens"
    paper: PaperSetting | None = None


# The reference's GLA keeps its key width equal to the model width in every synthetic config (expand_k 1, against
# 0.5 for language modelling) and decays every key feature on its own (fla's GLA, rotated); its Selective RoPE
# defaults differ from ours in the activation after the convolution (none). All are spelled out.
_REFERENCE_GLA = {"expand_k": 1.0, "expand_v": 1.0, "rotary_gate_per_pair": False}
# The reference's attention configs (model/attn.yaml of every task) rotate with Selective RoPE and add no decay.
_REFERENCE_ATTENTION = {"selective_rope_decay": False}
_REFERENCE_SELECTIVE_ROPE = {"selective_rope_rank": 32, "selective_rope_conv_size": 4,
                             "selective_rope_activation": None, "selective_rope_spectrum": "rope",
                             "selective_rope_temperature_base": 500000.0, "selective_rope_tau_max": 1.0,
                             "selective_rope_learn_temperature": False, "selective_rope_bias": False,
                             "selective_rope_phase_gate": False, "rope_theta": 500000.0}

TASKS: dict[str, TaskSpec] = {
    "mqar": TaskSpec(
        "mqar", "multi-query associative recall: the value of every queried key", vocab_size=32,
        train_length=32, eval_lengths=[32, 64, 128], num_pairs=4, hidden_size=64, num_heads=4, steps=1500,
        batch_size=32, lr=3e-3,
        paper=PaperSetting(
            sources=("configs/mad/mad.yaml", "configs/mad/model/gla.yaml", "configs/mad/trainer/trainer.yaml",
                     "configs/mad/model/position_embedding/selective_rope.yaml",
                     "synthetic_tasks/mad/configs/tasks/in-context-recall.yml"),
            # the paper's MQAR figure: sequences of 512 with 64 key-value pairs; vocabulary as in Zoology
            run={"family": "gla", "num_layers": 2, "hidden_size": 128, "num_heads": 8, "steps": 20000,
                 "batch_size": 128, "lr": 5e-4, "train_length": 512, "eval_lengths": [512], "num_pairs": 64,
                 "vocab_size": 8192},
            optim={"weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8, "schedule": "cosine",
                   "min_lr_ratio": 1e-6 / 5e-4, "grad_clip": 0.0},
            model={**_REFERENCE_SELECTIVE_ROPE},
            family_model={"gla": {**_REFERENCE_GLA, "use_short_conv": False, "gate_logit_normalizer": 16.0,
                                  "gate_low_rank_dim": 16, "norm_eps": 1e-5},
                          "transformer": _REFERENCE_ATTENTION},
            cpu={"steps": 1500, "batch_size": 32},
            gaps=("steps: MAD trains 200 epochs of 12800 sequences with early stopping, here a fixed count",
                  "a warmup of a tenth of the steps, which MAD does not use",
                  "MAD's attention config has 16 heads where its GLA has 8; every family gets 8 (--heads 16)",
                  ("data: our MQAR generator (Zoology's layout) at the paper's length and pairs; MAD's own "
                   "in-context-recall generator (vocabulary 16, lengths 128-1024) is not reimplemented")))),
    "copying": TaskSpec(
        "copying", "copy a string of 26 letters; trained on lengths 2 to the training length, evaluated on longer "
        "strings", vocab_size=COPY_ALPHABET + 2, train_length=24, eval_lengths=[24, 48, 96, 192], hidden_size=96,
        num_heads=4, steps=1000, batch_size=20, lr=2e-3,
        length_unit="letters",
        paper=PaperSetting(
            sources=("configs/copying/copying.yaml", "configs/copying/model/gla.yaml",
                     "configs/copying/data/data.yaml", "configs/copying/trainer/trainer.yaml",
                     "configs/copying/model/position_embedding/selective_rope.yaml"),
            run={"family": "gla", "num_layers": 4, "hidden_size": 512, "num_heads": 16, "steps": 5000,
                 "batch_size": 256, "lr": 2e-3, "train_length": 64, "eval_lengths": [64, 128, 256, 512]},
            # "linear" with a tenth of warmup: a linear decay to zero over the rest, which is wsd decaying over 90%
            optim={"weight_decay": 0.1, "betas": [0.9, 0.999], "eps": 1e-8, "schedule": "wsd",
                   "decay_fraction": 0.9, "min_lr_ratio": 0.0, "grad_clip": 1.0},
            model={**_REFERENCE_SELECTIVE_ROPE, "selective_rope_spectrum": "rfa", "selective_rope_rfa_theta": 0.9999,
                   "selective_rope_tau_max": 0.25, "selective_rope_skip_conv": True, "selective_rope_bias": True,
                   "selective_rope_phase_gate": True},
            family_model={"gla": {**_REFERENCE_GLA, "use_short_conv": False},
                          "transformer": _REFERENCE_ATTENTION},
            cpu={"steps": 1000, "batch_size": 32, "hidden_size": 128},
            gaps=(("use_gate and use_bias are swept over true and false; --paper takes both true "
                   "(--option selective_rope_bias=false / selective_rope_phase_gate=false for the others)"),))),
    "s2": TaskSpec(
        "s2", "word problem of S2 (parity): the running parity at every position", vocab_size=3,
        train_length=32, eval_lengths=[32, 128, 512], num_layers=1, steps=800, sweep_lrs=(1e-3, 3e-3, 1e-2),
        paper=PaperSetting(
            sources=("configs/state_tracking/state_tracking.yaml", "configs/state_tracking/model/gla.yaml",
                     "configs/state_tracking/data/data.yaml", "configs/state_tracking/trainer/trainer.yaml",
                     "configs/state_tracking/model/position_embedding/selective_rope.yaml"),
            # data: S2 words of exactly 128 (strict_len), tested at 512, a label at every position (tagging)
            # no step count: 100 epochs of a generated data set, stopped at 99% validation accuracy
            run={"family": "gla", "num_layers": 1, "hidden_size": 384, "num_heads": 12, "batch_size": 1024,
                 "lr": 5e-4, "train_length": 128, "eval_lengths": [128, 512]},
            optim={"weight_decay": 1e-6, "betas": [0.9, 0.999], "eps": 1e-8, "grad_clip": 0.0},
            model={**_REFERENCE_SELECTIVE_ROPE, "selective_rope_temperature_base": 1.0,
                   "selective_rope_bias": True},
            family_model={"gla": {**_REFERENCE_GLA, "use_short_conv": True},
                          "transformer": _REFERENCE_ATTENTION},
            cpu={"steps": 1000, "batch_size": 32},
            gaps=(("steps and schedule: the reference trains 100 epochs of a generated data set and stops at 99% "
                   "validation accuracy; the data set's size and the scheduler live in a training script the "
                   "repository does not include, so a fixed step count with our cosine schedule stands in"),))),
    "a3": TaskSpec(
        "a3", "word problem of A3 (= Z3): the running sum mod 3 at every position", vocab_size=4,
        train_length=32, eval_lengths=[32, 128, 512], num_layers=1, steps=800, sweep_lrs=(1e-3, 3e-3, 1e-2)),
}


def make_batch(task: str, batch: int, length: int, generator: torch.Generator, *, train: bool,
               num_pairs: int | None = None, vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of ``task`` at ``length`` (the training length for training batches; copying trains on every
    length from 2 to ``length`` and evaluates on exactly ``length``)."""
    spec = TASKS[task]
    if task == "mqar":
        return mqar_batch(batch, length, num_pairs or spec.num_pairs, vocab_size or spec.vocab_size, generator)
    if task == "copying":
        return copying_batch(batch, 2 if train else length, length, generator)
    return word_problem_batch(batch, length, {"s2": 2, "a3": 3}[task], generator)
