"""``rotarium extrapolation``: length extrapolation on text, RoVE's headline claim, as a resumable sweep.

Every family x positional option x seed trains the same small model (the training job's, ``rotarium train``) for
the same number of tokens at one sequence length on the same corpus with one shared tokenizer, then scores the
run's held-out documents at context lengths from the training length to a multiple of it (``rotarium eval``'s
perplexity task, :data:`rotarium.evaluation.registry.EVAL_TASKS`). With ``--yarn`` the options that rotate by
position (RoPE, RoVE) are scored again with YaRN at each longer length (factor: that length over the training
length), and with ``--ruler`` each run also answers RULER's synthetic tasks (its RULER task) from the training
length to a multiple of it, scored by generation and by the answer's likelihood. Each finished run appends its rows
to ``extrapolation.csv`` (and ``ruler.csv``); a rerun skips the runs there with the same settings and resumes an
interrupted run from its last checkpoint. ``extrapolation.md`` (median and min-max over seeds, the papers' claims
checked seed by seed) and ``extrapolation.png`` (and ``ruler.png``) are written from the CSVs.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rotarium.evaluation.ruler import MULTIPLES as RULER_MULTIPLES
from rotarium.evaluation.verdicts import (
    DEGRADES,
    Precondition,
    Scale,
    Verdict,
    decide,
    generation_bounds,
    reason_lines,
    rules,
    uniform_guess,
)
from rotarium.layers.positional import ROPE_FREQUENCY_ENCODINGS
from rotarium.synthetic.runner import FAMILIES, POSITIONS, seconds_per_call
from rotarium.utils.argtypes import int_list
from rotarium.utils.files import check_writable_folder, read_csv_rows, write_csv_atomic, write_text_atomic
from rotarium.utils.plots import save_figure

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from rotarium.training.config import Config

# Debian's python3-doc package (`apt-get install python3-doc`): Python's full documentation as reStructuredText,
# many times the embedded corpus, so that long held-out documents exist at every length the table reads.
PYTHON_DOCS = "/usr/share/doc/python3/html/_sources"
# The command's training defaults over the training job's (4 layers, width 256, 4 heads, 16 x 128 tokens a step):
# sized so that a whole table (4 families x 4 options x 3 seeds) is a CPU job; a validation loss only at the start
# and the end (the table scores the held-out documents itself), a checkpoint every 50 steps for resuming, one thread
# per run.
DEFAULTS = {"train.max_steps": 100, "train.save_every": 50, "train.eval_every": 1_000_000, "train.num_threads": 1,
            "train.keep_checkpoints": 1, "data.max_validation_tokens": 8192, "train.eval_batches": 4}
CSV_FIELDS = ("family", "position", "seed", "rope_scaling", "context_length", "loss", "perplexity", "windows",
              "tokens", "train_length", "train_tokens", "steps", "batch_size", "lr", "num_layers", "hidden_size",
              "num_heads", "parameters", "train_seconds", "eval_seconds", "vocab_size", "settings")
# Each score with its 95% interval over the samples (Wilson's; the bootstrap's for the NLL) and the prompts' realised
# lengths, as `rotarium eval --ruler` reports them.
RULER_INTERVALS = tuple(f"{score}_{end}" for score in ("score", "answer_nll", "exact_match") for end in ("low", "high"))
RULER_FIELDS = ("family", "position", "seed", "rope_scaling", "task", "context_length", "samples", "score",
                "answer_nll", "exact_match", *RULER_INTERVALS, "prompt_tokens_min", "prompt_tokens_mean",
                "prompt_tokens_max", "train_length", "vocab_size", "settings")
# A whole run's training over its steps at the probe's pace: the checkpoints, the validation at the start and the
# end, tokenising the corpus.
RUN_OVER_PROBE = 1.3
# A RULER sample's cost in forwards of its length: the prompt for generation, the prompt and answer under teacher
# forcing, and the generated tokens one at a time.
RULER_FORWARDS = 3
MARGIN = 0.01  # relative: "lower perplexity" (or answer NLL) means lower by at least 1%
PERPLEXITY = Scale("perplexity", lower_is_better=True, margin=MARGIN, relative=True)
ANSWER_NLL = Scale("answer NLL", lower_is_better=True, margin=MARGIN, relative=True)
# RULER's keys from one fixed list, whatever is installed: ruler.csv does not name the list, and a resumed sweep
# adds rows to the ones an earlier process wrote
RULER_WORDS = "rotarium"


def variant(position: str, rope_scaling: str = "") -> str:
    """A column of the tables: the option, with ``+yarn`` when scored with YaRN."""
    return f"{position}+{rope_scaling}" if rope_scaling else position


@dataclass(frozen=True)
class Scoring:
    """What each run is scored on after training: perplexity at ``multiples`` of the training length on
    ``eval_tokens`` held-out tokens; with ``yarn`` again with YaRN for RoPE and RoVE; RULER's ``ruler_tasks`` at
    ``ruler_multiples``, ``ruler_samples`` samples each."""

    multiples: tuple[int, ...] = (1, 2, 4, 8)
    eval_tokens: int = 16384
    yarn: bool = False
    ruler_tasks: tuple[str, ...] = ()
    ruler_multiples: tuple[int, ...] = RULER_MULTIPLES
    ruler_samples: int = 20
    # (task, multiple) pairs whose prompt fits the length: set by `fitting_ruler` before any run
    ruler_fits: tuple[tuple[str, int], ...] = ()

    def scalings(self, position: str) -> tuple[str, ...]:
        return ("", "yarn") if self.yarn and position in ROPE_FREQUENCY_ENCODINGS else ("",)


def fitting_ruler(scoring: Scoring, tokenizer: Path, train_length: int, log: Callable[[str], None]) -> Scoring:
    """``scoring`` with the RULER tasks and lengths where every sample's prompt fits (RULER's prompts have a fixed
    part, the one-shot example of variable tracking above all, that a short length cannot hold): a task is scored
    where it fits, and ``ValueError`` names a task that fits at no length."""
    import dataclasses

    from rotarium.data.tokenizer import load_tokenizer
    from rotarium.evaluation.ruler import check_fits, load_words

    if not scoring.ruler_tasks:
        return scoring
    loaded, words = load_tokenizer(str(tokenizer)), load_words(RULER_WORDS)
    fits = []
    for task in scoring.ruler_tasks:
        short = []
        for multiple in scoring.ruler_multiples:
            try:
                check_fits(task, loaded, multiple * train_length, scoring.ruler_samples, words=words)
                fits.append((task, multiple))
            except ValueError as error:
                short.append((multiple * train_length, str(error)))
        if len(short) == len(scoring.ruler_multiples):
            raise ValueError(f"--ruler {task}: {short[-1][1]} (--ruler-multiples {max(scoring.ruler_multiples)} x "
                             f"the training length {train_length} is the longest asked)")
        if short:
            log(f"RULER {task} is not scored at {', '.join(str(length) for length, _ in short)} tokens: its prompt "
                "does not fit there")
    return dataclasses.replace(scoring, ruler_fits=tuple(fits))


@dataclass(frozen=True)
class Unit:
    family: str
    position: str
    seed: int


def _run_name(unit: Unit) -> str:
    return f"{unit.family}-{unit.position}-seed{unit.seed}"


def unit_config(overrides: dict[str, Any], unit: Unit, tokenizer: Path) -> Config:
    from rotarium.training.config import load_config

    return load_config(None, {**DEFAULTS, **overrides, "model.family": unit.family,
                              "model.position_encoding": unit.position, "train.seed": unit.seed,
                              "tokenizer.name": str(tokenizer), "eval.run_after": False})


def settings_key(config: Config) -> str:
    """What the runs of one table share, as the CSV writes it: every config value but the unit's own and those
    that change how fast a run goes, not what it computes (threads, checkpoints, trackers, compiling)."""
    flat = {f"{section}.{k}": v for section, values in config.to_dict().items() for k, v in values.items()}
    for key in ("model.family", "model.position_encoding", "train.seed", "train.num_threads", "tokenizer.name",
                "train.save_every", "train.keep_checkpoints", "train.report_to", "train.eval_every",
                "train.compile"):
        flat.pop(key, None)
    return json.dumps(flat, sort_keys=True, default=str)


def read_rows(path: Path) -> list[dict[str, Any]]:
    rows = read_csv_rows(path, ints=("seed", "context_length", "windows", "train_length", "steps", "num_layers",
                                     "hidden_size"),
                         floats=("train_seconds", "eval_seconds", "lr"),
                         optional_floats=("loss", "perplexity", "vocab_size"))
    for row in rows:
        row["rope_scaling"] = row.get("rope_scaling") or ""  # absent from tables written before YaRN was scored
    return rows


def read_ruler_rows(path: Path) -> list[dict[str, Any]]:
    return read_csv_rows(path, ints=("seed", "context_length", "samples", "train_length"),
                         floats=("score", "answer_nll", "exact_match"),
                         optional_floats=("vocab_size", *RULER_INTERVALS, "prompt_tokens_min", "prompt_tokens_mean",
                                          "prompt_tokens_max"))  # absent from older CSVs


def shared_tokenizer(overrides: dict[str, Any], folder: Path) -> Path:
    """One BPE for every run (perplexities compare only under one tokenizer), trained once on the documents seed 0
    does not hold out; a ``tokenizer.name`` override is used instead when given."""
    from rotarium.data.documents import iter_documents, split_documents
    from rotarium.data.tokenizer import train_bpe
    from rotarium.training.config import load_config
    from rotarium.utils.files import write_folder_atomic

    config = load_config(None, {**DEFAULTS, **overrides})
    if config.tokenizer.name is not None:
        return Path(config.tokenizer.name)
    target = folder / "tokenizer"
    if not (target / "tokenizer_config.json").is_file():
        documents = split_documents(list(iter_documents(config.data)), config.data.validation_fraction, 0)[0]
        tokenizer = train_bpe(documents[:config.tokenizer.train_documents], config.tokenizer.vocab_size)
        write_folder_atomic(target, tokenizer.save_pretrained)
    return target


def train_and_score(overrides: dict[str, Any], unit: Unit, tokenizer: str, run_dir: str, scoring: Scoring,
                    progress: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Trains one unit (resuming its run folder) and scores it: ``(perplexity rows, RULER rows)``."""
    from rotarium.evaluation.perplexity import stream_tokens
    from rotarium.training.trainer import Trainer

    config = unit_config(overrides, unit, Path(tokenizer))
    start = time.perf_counter()
    trainer = Trainer(config, run_dir, resume=True)
    result = trainer.train()
    train_seconds = time.perf_counter() - start
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    L = config.data.seq_len
    tokens = stream_tokens(trainer.tokenizer, trainer.data.validation_documents)
    m, t = config.model, config.train
    # the uniform guess the verdicts compare a NLL with is over the model's output vocabulary
    shared = {"family": unit.family, "position": unit.position, "seed": unit.seed, "train_length": L,
              "vocab_size": model.config.vocab_size, "settings": settings_key(config)}
    perplexity, ruler = score_model(model, trainer.tokenizer, tokens, L, t.batch_size, unit.position, scoring,
                                    progress, name=str(run_dir))
    run = {"train_tokens": result.steps * trainer.tokens_per_step, "steps": t.max_steps, "batch_size": t.batch_size,
           "lr": config.optim.lr, "num_layers": m.num_hidden_layers, "hidden_size": m.hidden_size,
           "num_heads": m.num_heads, "parameters": sum(p.numel() for p in model.parameters()),
           "train_seconds": round(train_seconds, 1),
           "eval_seconds": round(time.perf_counter() - start - train_seconds, 1)}
    return [{**shared, **row, **run} for row in perplexity], [{**shared, **row} for row in ruler]


def score_model(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, documents: list[str] | torch.Tensor,
                train_length: int, batch_size: int, position: str, scoring: Scoring, progress: bool = False, *,
                name: str = "model") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A trained model's rows, each with its ``rope_scaling``: perplexity on ``documents`` (or their token stream)
    at each of ``scoring``'s multiples of ``train_length``, and the RULER tasks that fit there, through ``rotarium
    eval``'s evaluation tasks (:data:`~rotarium.evaluation.registry.EVAL_TASKS`), one length at a time; with YaRN too
    where ``scoring`` asks for it and ``position`` rotates by position. ``name``: how records name the model."""
    import torch

    from rotarium.evaluation.perplexity import PerplexityTexts
    from rotarium.evaluation.registry import EVAL_TASKS
    from rotarium.evaluation.ruler import SEED, RulerRequest, RulerTexts, load_words
    from rotarium.evaluation.tasks import EvalRun
    from rotarium.models import with_rope_parameters

    def scored(scaling: str, multiple: int) -> torch.nn.Module:
        # YaRN stretched to the length it reads; at the training length its factor is 1, the model itself
        if not scaling or multiple == 1:
            return model
        return with_rope_parameters(model, {"rope_type": scaling, "factor": float(multiple)})

    def at(multiple: int) -> EvalRun:
        return EvalRun.of(name, name, context_lengths=[multiple * train_length], batch_size=batch_size,
                          progress=progress)

    texts = PerplexityTexts(documents, "the held-out documents", scoring.eval_tokens)
    words = load_words(RULER_WORDS) if scoring.ruler_fits else None
    perplexity, ruler = [], []
    with torch.no_grad():
        for scaling in scoring.scalings(position):
            for multiple in scoring.multiples:
                record = EVAL_TASKS["perplexity"].evaluate(texts, scored(scaling, multiple), tokenizer, at(multiple))
                perplexity += [{"rope_scaling": scaling, **row} for row in record["rows"]]
            for multiple in sorted({multiple for _, multiple in scoring.ruler_fits}):
                tasks = [task for task, fit in scoring.ruler_fits if fit == multiple]
                request = RulerRequest(tasks, scoring.ruler_samples, SEED, words, RulerTexts())
                record = EVAL_TASKS["ruler"].evaluate(request, scored(scaling, multiple), tokenizer, at(multiple))
                ruler += [{"rope_scaling": scaling, **row} for row in record["rows"]]
    return perplexity, ruler


def _worker(args: tuple) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    import torch

    torch.set_num_threads(1)
    return train_and_score(*args)


def seconds_per_step(config: Config, tokenizer: Path, steps: int = 3, warmup: int = 1) -> float:
    """A training step's wall time for ``config`` on one thread: a batch of random tokens through the model with
    labels, backward and AdamW."""
    import torch

    from rotarium.data.tokenizer import load_tokenizer
    from rotarium.training.build import build_model
    from rotarium.training.optim import build_optimizer

    torch.manual_seed(0)
    model = build_model(config, load_tokenizer(str(tokenizer)))
    optimizer = build_optimizer(model, config.optim)
    tokens = torch.randint(0, model.config.vocab_size, (config.train.batch_size, config.data.seq_len))

    def step() -> None:
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return seconds_per_call(step, steps, warmup)


def seconds_per_token_scored(config: Config, tokenizer: Path, length: int, warmup: int = 1) -> float:
    """A scored token's wall time for ``config`` at context ``length`` on one thread: a forward without gradients of
    one window of random tokens."""
    import torch

    from rotarium.data.tokenizer import load_tokenizer
    from rotarium.training.build import build_model

    torch.manual_seed(0)
    model = build_model(config, load_tokenizer(str(tokenizer))).eval()
    tokens = torch.randint(0, model.config.vocab_size, (1, length))

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=tokens, use_cache=False)

    return seconds_per_call(forward, 1, warmup) / length


def expected_seconds(configs: list, tokenizer: Path, scoring: Scoring) -> float:
    """The runs' expected time on one thread each: training from a few timed steps of each family x option, scoring
    from a timed forward at the training length and at the longest scored one (the cost of a token in between
    interpolated linearly in the length, as attention's is)."""
    probes: dict[tuple[str, str], tuple[float, float, float]] = {}
    total = 0.0
    for config in configs:
        L, position = config.data.seq_len, config.model.position_encoding
        longest = L * max([*scoring.multiples, *(multiple for _, multiple in scoring.ruler_fits)])
        key = (config.model.family, position)
        if key not in probes:
            probes[key] = (seconds_per_step(config, tokenizer), seconds_per_token_scored(config, tokenizer, L),
                           seconds_per_token_scored(config, tokenizer, longest) if longest > L else 0.0)
        step, short, long = probes[key]

        def per_token(length: int) -> float:
            return short if length == L else short + (long - short) * (length - L) / (longest - L)  # noqa: B023

        scored = sum(max(scoring.eval_tokens, m * L) // (m * L) * m * L * per_token(m * L) for m in scoring.multiples)
        scored += sum(scoring.ruler_samples * RULER_FORWARDS * m * L * per_token(m * L)
                      for _, m in scoring.ruler_fits)
        total += RUN_OVER_PROBE * config.train.max_steps * step + len(scoring.scalings(position)) * scored
    return total


def run_units(overrides: dict[str, Any], units: list[Unit], output_dir: Path, runs_dir: Path, *, scoring: Scoring,
              jobs: int = 1, progress: bool = True,
              log: Callable[[str], None] = print) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every unit not yet in ``output_dir/extrapolation.csv`` (and ``ruler.csv``) with these settings; returns the
    perplexity and RULER rows of this sweep."""
    csv_path, ruler_path = output_dir / "extrapolation.csv", output_dir / "ruler.csv"
    tokenizer = shared_tokenizer(overrides, runs_dir)
    rows, ruler_rows = read_rows(csv_path), read_ruler_rows(ruler_path)
    configs = {u: unit_config(overrides, u, tokenizer) for u in units}
    L = configs[units[0]].data.seq_len
    scoring = fitting_ruler(scoring, tokenizer, L, log)

    def ours(row: dict[str, Any]) -> bool:
        unit = Unit(row["family"], row["position"], row["seed"])
        return unit in configs and row["settings"] == settings_key(configs[unit])

    def expected(unit: Unit) -> tuple[set, set]:
        scalings = scoring.scalings(unit.position)
        return ({(s, m * L) for s in scalings for m in scoring.multiples},
                {(s, task, m * L) for s in scalings for task, m in scoring.ruler_fits})

    def done(unit: Unit) -> bool:
        mine = [r for r in rows if ours(r) and Unit(r["family"], r["position"], r["seed"]) == unit]
        scored = [r for r in ruler_rows if ours(r) and Unit(r["family"], r["position"], r["seed"]) == unit]
        perplexity, ruler = expected(unit)
        return (perplexity <= {(r["rope_scaling"], r["context_length"]) for r in mine}
                and ruler <= {(r["rope_scaling"], r["task"], r["context_length"]) for r in scored})

    todo = [u for u in units if not done(u)]
    estimate = expected_seconds([configs[u] for u in todo], tokenizer, scoring) / max(1, min(jobs, len(todo)))
    log(f"{len(units) - len(todo)} of {len(units)} runs already done; {len(todo)} to run with {jobs} process(es), "
        f"expected about {estimate / 60:.0f} min on this machine (timed from a few steps and forwards of each "
        "family x option; longer if other work shares its cores)")

    def record(unit: Unit, new: list[dict[str, Any]], new_ruler: list[dict[str, Any]]) -> None:
        nonlocal rows, ruler_rows

        def other(row: dict[str, Any]) -> bool:
            return not (Unit(row["family"], row["position"], row["seed"]) == unit
                        and row["settings"] == settings_key(configs[unit]))

        # a sweep killed half-way keeps every finished unit
        rows = [r for r in rows if other(r)] + new
        write_csv_atomic(csv_path, rows, CSV_FIELDS)
        if scoring.ruler_fits or ruler_path.exists():
            ruler_rows = [r for r in ruler_rows if other(r)] + new_ruler
            write_csv_atomic(ruler_path, ruler_rows, RULER_FIELDS)
        ppl = ", ".join(f"{r['context_length']}{'+' + r['rope_scaling'] if r['rope_scaling'] else ''}: "
                        f"{r['perplexity']}" for r in new)
        log(f"{unit.family} {unit.position} seed {unit.seed}: perplexity {ppl} ({new[0]['train_seconds']:.0f} s "
            f"training, {new[0]['eval_seconds']:.0f} s scoring)")

    tasks = [(u, (overrides, u, str(tokenizer), str(runs_dir / _run_name(u)), scoring)) for u in todo]
    if jobs <= 1 or len(tasks) <= 1:
        for unit, args in tasks:
            record(unit, *train_and_score(*args, progress=progress))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_worker, args): unit for unit, args in tasks}
            for future in as_completed(futures):
                record(futures[future], *future.result())
    wanted = {(s, m * L) for s in ("", "yarn") for m in scoring.multiples}
    ruler_wanted = {(s, task, m * L) for s in ("", "yarn") for task, m in scoring.ruler_fits}
    return ([r for r in rows if ours(r) and (r["rope_scaling"], r["context_length"]) in wanted
             and (scoring.yarn or not r["rope_scaling"])],
            [r for r in ruler_rows if ours(r) and (r["rope_scaling"], r["task"], r["context_length"]) in ruler_wanted
             and (scoring.yarn or not r["rope_scaling"])])


# ------------------------------------------------------------------------------------------------------- report
def aggregate(rows: list[dict[str, Any]], value: str = "perplexity") -> dict[tuple[str, str, int], dict[str, Any]]:
    """``(family, variant, context_length)`` -> median, min, max of ``value`` over seeds and ``by_seed``."""
    groups: dict[tuple[str, str, int], dict[int, float]] = {}
    for r in rows:
        if r[value] is not None:
            key = (r["family"], variant(r["position"], r.get("rope_scaling", "")), r["context_length"])
            groups.setdefault(key, {})[r["seed"]] = r[value]
    return {k: {"median": statistics.median(v.values()), "min": min(v.values()), "max": max(v.values()),
                "by_seed": v} for k, v in groups.items()}


@dataclass(frozen=True)
class TextClaim:
    """``option`` (a table's column: an option, ``+yarn`` when scored with YaRN) is lower than every column of
    ``against``, seed by seed, at every context length of ``where`` (``train``: the training length; ``beyond``: each
    longer one; ``all``: both), in ``metric``: perplexity, or the answer's NLL per token under teacher forcing on the
    RULER task of that name; decided by :func:`rotarium.evaluation.verdicts.decide`. ``regime``: a column whose
    perplexity the paper's claim relies on degrading beyond the training length (YaRN repairs RoPE there)."""

    text: str
    option: str
    against: tuple[str, ...]
    where: str
    metric: str = "perplexity"
    regime: str = ""


CLAIMS = (
    TextClaim("RoVE's perplexity beyond the training length is lower than RoPE's (RoVE paper)",
              "rove", ("rope",), "beyond"),
    TextClaim("Selective RoPE's perplexity at the training length is lower than RoPE's (Selective RoPE paper)",
              "selective_rope", ("rope",), "train"),
    TextClaim("Selective RoPE's perplexity beyond the training length is lower than RoPE's",
              "selective_rope", ("rope",), "beyond"),
    TextClaim("RoVE + YaRN's perplexity beyond the training length is lower than both RoVE's and RoPE + YaRN's: the "
              "gains add (RoVE paper)", "rove+yarn", ("rove", "rope+yarn"), "beyond", regime="rope"),
    TextClaim("RoVE retrieves the needle better than RoPE: a lower answer NLL on RULER's niah_single_1 (RoVE paper)",
              "rove", ("rope",), "all", "niah_single_1"),
    TextClaim("... and with YaRN: RoVE + YaRN below RoPE + YaRN on niah_single_1", "rove+yarn", ("rope+yarn",),
              "beyond", "niah_single_1"),
    TextClaim("RoVE tracks variables better than RoPE: a lower answer NLL on RULER's vt (RoVE paper)",
              "rove", ("rope",), "all", "vt"),
    TextClaim("... and with YaRN: RoVE + YaRN below RoPE + YaRN on vt", "rove+yarn", ("rope+yarn",), "beyond", "vt"),
)


def _claim_rows(claim: TextClaim, rows: list[dict[str, Any]], ruler_rows: list[dict[str, Any]]
                ) -> tuple[list[dict[str, Any]], str]:
    """The rows ``claim`` reads and their column: perplexity, or the answers of its RULER task."""
    if claim.metric == "perplexity":
        return rows, "perplexity"
    return [r for r in ruler_rows if r["task"] == claim.metric], "answer_nll"


def check_claim(claim: TextClaim, rows: list[dict[str, Any]], ruler_rows: list[dict[str, Any]], family: str,
                length: int) -> Verdict:
    """The verdict on ``claim`` for ``family`` at ``length``: beyond the training length compared with the gap at it;
    a cell at a floor where its NLL (perplexity) is near a uniform guess over the vocabulary or, on RULER, where no
    generated answer is right; a ``regime`` claim outside the paper's regime where that column does not degrade."""
    rows = [r for r in rows if r["family"] == family]
    chosen, value = _claim_rows(claim, rows, [r for r in ruler_rows if r["family"] == family])
    scale = PERPLEXITY if value == "perplexity" else ANSWER_NLL
    L = chosen[0]["train_length"] if chosen else length

    def by_seed(cells: dict, at: int) -> dict[str, dict[int, float]]:
        return {c: cells.get((family, c, at), {}).get("by_seed", {}) for c in (claim.option, *claim.against)}

    cells = aggregate(chosen, value)
    vocab = [int(r["vocab_size"]) for r in chosen if r.get("vocab_size")]  # absent from CSVs of older runs
    bounds = [uniform_guess(max(vocab), perplexity=scale is PERPLEXITY)] if vocab else []
    if scale is ANSWER_NLL:
        bounds += generation_bounds(by_seed(aggregate(chosen, "score"), length))
    precondition = None
    if claim.regime:
        perplexity = aggregate(rows)
        precondition = Precondition(
            f"{claim.regime} degrading beyond the training length (perplexity above {DEGRADES:g}x its own at {L})",
            *(perplexity.get((family, claim.regime, at), {}).get("by_seed", {}) for at in (length, L)))
    return decide(claim.option, claim.against, by_seed(cells, length), scale,
                  train=by_seed(cells, L) if length > L else None, bounds=bounds, precondition=precondition)


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    present = {variant(r["position"], r.get("rope_scaling", "")) for r in rows}
    return [v for p in POSITIONS for v in (p, variant(p, "yarn")) if v in present]


def _cell(c: dict[str, Any] | None, seeds: int, digits: int = 1) -> str:
    if c is None:
        return "-"
    n = len(c["by_seed"])
    few = f" {n} seed{'s' * (n > 1)}" if n < seeds else ""
    return f"{c['median']:.{digits}f} [{c['min']:.{digits}f}-{c['max']:.{digits}f}]{few}"


def markdown_report(rows: list[dict[str, Any]], command: str | None, corpus: str, seeds: tuple[int, ...],
                    units: int, ruler_rows: list[dict[str, Any]] = ()) -> str:
    ruler_rows = list(ruler_rows)
    first = rows[0]
    L = first["train_length"]
    cells = aggregate(rows)
    runs = {(r["family"], r["position"], r["seed"]): r for r in rows}
    seconds = [r["train_seconds"] + r["eval_seconds"] for r in runs.values()]
    out = ["## Length extrapolation on text", ""]
    if command:
        out += [f"Command: `{command}`", ""]
    scored = "perplexity"
    if any(r["rope_scaling"] for r in rows):
        scored += " (RoPE and RoVE also with YaRN, factor = context / training length)"
    if ruler_rows:
        scored += f"; RULER {', '.join(dict.fromkeys(r['task'] for r in ruler_rows))}"
    out += [(f"Budget: {first['num_layers']} layers, width {first['hidden_size']}, {first['num_heads']} heads; "
            f"{first['steps']} steps of {first['batch_size']} x {L} tokens ({int(first['train_tokens']):,} training "
            f"tokens per run), lr {first['lr']:g}; corpus `{corpus}`, one shared BPE; seeds "
            f"{', '.join(map(str, seeds))}; scored: {scored}. Wall time per run (training and scoring, one thread; "
            f"longer on a shared CPU): median "
            f"{statistics.median(seconds) / 60:.1f} min (min-max {min(seconds) / 60:.1f}-{max(seconds) / 60:.1f}); "
            f"{sum(seconds) / 60:.0f} min for the {len(runs)} runs one after another."), "",
            (f"Status: **complete**, all {len(runs)} runs." if len(runs) >= units else
             f"Status: **partial**, {len(runs)} of {units} runs; cells with fewer seeds say how many."), "",
            ("Cells: perplexity on each run's held-out documents, median over seeds [min-max]; the same tokens are "
            "scored at every context length."), ""]
    columns = _columns(rows)
    families = [f for f in FAMILIES if any(r["family"] == f for r in rows)]
    lengths = sorted({r["context_length"] for r in rows})
    for length in lengths:
        kind = f"beyond training, {length // L}x" if length > L else "the training length"
        out += [f"**Context {length} ({kind})**", "", "| family | " + " | ".join(columns) + " |",
                "|---|" + "---:|" * len(columns)]
        for family in families:
            out.append(f"| {family} | " + " | ".join(_cell(cells.get((family, c, length)), len(seeds))
                                                     for c in columns) + " |")
        out.append("")
    if ruler_rows:
        out += _ruler_section(ruler_rows, families, L, len(seeds))
    out += ["### Claims, seed by seed", "", rules(PERPLEXITY), ""]
    for claim in CLAIMS:
        chosen, _ = _claim_rows(claim, rows, ruler_rows)
        if not {claim.option, *claim.against} <= set(_columns(chosen)):
            continue  # a claim on a column or task not scored
        claim_lengths = [x for x in sorted({r["context_length"] for r in chosen})
                         if claim.where == "all" or (x > L) == (claim.where == "beyond")]
        if not claim_lengths:
            continue
        verdicts = {(family, x): check_claim(claim, rows, ruler_rows, family, x) for family in families
                    for x in claim_lengths}
        out += [f"**{claim.text}**", "", "| family | " + " | ".join(f"context {x}" for x in claim_lengths) + " |",
                "|---|" + "---|" * len(claim_lengths)]
        for family in families:
            out.append(f"| {family} | " + " | ".join(str(verdicts[family, x]) for x in claim_lengths) + " |")
        out.append("")
        out += reason_lines([(family, str(x), v) for (family, x), v in verdicts.items()], "context")
    return "\n".join(out)


def _ruler_section(ruler_rows: list[dict[str, Any]], families: list[str], L: int, seeds: int) -> list[str]:
    out = ["### RULER", "",
           ("Each run answers the same samples (RULER's seed 42, the shared tokenizer; a task only at the lengths its "
            "prompt fits). Cells: the answer's negative log-likelihood per token under teacher forcing, median over "
            "seeds [min-max], then RULER's score (% of gold answers in the greedy generation, median over seeds). "
            "Each run's 95% intervals over its samples (Wilson's for the score, the bootstrap's for the NLL) and the "
            "prompts' realised lengths are in ruler.csv."),
           ""]
    columns = _columns(ruler_rows)
    for task in dict.fromkeys(r["task"] for r in ruler_rows):
        mine = [r for r in ruler_rows if r["task"] == task]
        nll, score = aggregate(mine, "answer_nll"), aggregate(mine, "score")
        lengths = sorted({r["context_length"] for r in mine})
        out += [f"**{task}**", "", "| family | option | " + " | ".join(
            f"{x}{f' ({x // L}x)' if x > L else ' (training length)'}" for x in lengths) + " |",
            "|---|---|" + "---:|" * len(lengths)]
        for family in families:
            for column in columns:
                if not any((family, column, x) in nll for x in lengths):
                    continue
                out.append(f"| {family} | {column} | " + " | ".join(
                    _cell(nll.get((family, column, x)), seeds, 3)
                    + (f" ({100 * score[(family, column, x)]['median']:.0f}%)" if (family, column, x) in score else "")
                    for x in lengths) + " |")
        out.append("")
    return out


def _line_style(column: str) -> dict[str, Any]:
    position, _, scaling = column.partition("+")
    return {"color": f"C{POSITIONS.index(position)}", "linestyle": "--" if scaling else "-",
            "marker": "s" if scaling else "o"}  # one colour per option in every panel, dashed with YaRN


def _draw_panel(ax: Any, cells: dict, family: str, columns: list[str], train_length: int) -> None:
    """One family's lines in ``ax``: per column, the median against context length with the seeds' min-max as a
    band; the training length marked, lengths on a log2 axis."""
    for column in columns:
        points = sorted((x, c) for (f, col, x), c in cells.items() if (f, col) == (family, column))
        if points:
            xs = [x for x, _ in points]
            style = _line_style(column)
            ax.plot(xs, [c["median"] for _, c in points], label=column, **style)
            ax.fill_between(xs, [c["min"] for _, c in points], [c["max"] for _, c in points], color=style["color"],
                            alpha=0.15)
    ax.axvline(train_length, color="gray", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.grid(alpha=0.3)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = aggregate(rows)
    families = [f for f in FAMILIES if any(r["family"] == f for r in rows)]
    columns = _columns(rows)
    L = rows[0]["train_length"]
    fig, axes = plt.subplots(1, len(families), figsize=(3.4 * len(families), 3.4), squeeze=False)
    for ax, family in zip(axes[0], families):
        _draw_panel(ax, cells, family, columns, L)
        ax.set_yscale("log")
        ax.set_title(family)
    axes[0][0].set_ylabel("perplexity (median, min-max)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"perplexity against context length (dashed: training length {L})")
    fig.tight_layout()
    save_figure(fig, path)


def plot_ruler(ruler_rows: list[dict[str, Any]], path: Path) -> None:
    """A panel per RULER task and family: the answer's NLL per token against context length, a line per column
    (median, the seeds' min-max as a band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in ruler_rows))
    families = [f for f in FAMILIES if any(r["family"] == f for r in ruler_rows)]
    columns = _columns(ruler_rows)
    L = ruler_rows[0]["train_length"]
    fig, axes = plt.subplots(len(tasks), len(families), figsize=(3.6 * len(families), 3.2 * len(tasks)),
                             squeeze=False)
    for i, task in enumerate(tasks):
        cells = aggregate([r for r in ruler_rows if r["task"] == task], "answer_nll")
        for ax, family in zip(axes[i], families):
            _draw_panel(ax, cells, family, columns, L)
            ax.set_title(f"{task}, {family}")
        axes[i][0].set_ylabel("answer NLL per token")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"RULER: the answer's NLL under teacher forcing (dashed: training length {L})")
    fig.tight_layout()
    save_figure(fig, path)


def extrapolation_sweep(overrides: dict[str, Any], output_dir: str | os.PathLike, runs_dir: str | os.PathLike, *,
                        families: tuple[str, ...] = FAMILIES, positions: tuple[str, ...] = POSITIONS,
                        seeds: tuple[int, ...] = (0, 1, 2), scoring: Scoring = Scoring(), jobs: int = 1,
                        command: str | None = None, progress: bool = True,
                        log: Callable[[str], None] = print) -> list[Path]:
    """Runs the sweep and writes its table, CSVs and plots into ``output_dir``; returns their paths (the table
    second)."""
    for key in ("model.family", "model.position_encoding", "train.seed"):
        if key in overrides:
            raise ValueError(f"--{key} is set per run here; use --families, --positions or --seeds")
    if scoring.yarn and not set(positions) & set(ROPE_FREQUENCY_ENCODINGS):
        raise ValueError(f"--yarn rescales {' and '.join(ROPE_FREQUENCY_ENCODINGS)}; --positions has neither")
    output_dir, runs_dir = Path(output_dir), Path(runs_dir)
    check_writable_folder(output_dir, "--output-dir")  # before the runs, whose rows it records as each ends
    check_writable_folder(runs_dir, "--runs-dir")
    output_dir.mkdir(parents=True, exist_ok=True)
    runs_dir.mkdir(parents=True, exist_ok=True)
    units = [Unit(f, p, s) for s, f, p in itertools.product(seeds, families, positions)]
    start = time.perf_counter()
    rows, ruler_rows = run_units(overrides, units, output_dir, runs_dir, scoring=scoring, jobs=jobs,
                                 progress=progress, log=log)
    log(f"ran for {(time.perf_counter() - start) / 60:.1f} min")
    paths = [output_dir / f"extrapolation.{ext}" for ext in ("csv", "md", "png")]
    corpus = {**DEFAULTS, **overrides}.get("data.source", "embedded")
    write_text_atomic(paths[1], markdown_report(rows, command, str(corpus), seeds, len(units), ruler_rows) + "\n")
    plot(rows, paths[2])
    if ruler_rows:
        paths += [output_dir / "ruler.csv", output_dir / "ruler.png"]
        plot_ruler(ruler_rows, paths[-1])
    return paths


# ---------------------------------------------------------------------------------------------------------- CLI
def add_commands(subparsers: argparse._SubParsersAction) -> None:
    from rotarium.synthetic.cli import choice_list

    parser = subparsers.add_parser(
        "extrapolation", help="perplexity against context length of every family x positional option on text",
        description="Trains the training job's model (4 layers, width 256; any --section.key override of "
                    "`rotarium train`) of every family x positional option x seed for the same tokens on one corpus "
                    "with one shared tokenizer, and scores each run's held-out documents from the training length "
                    "to 8x it. Writes extrapolation.md (median and min-max over seeds, the papers' claims checked "
                    "seed by seed), .csv and .png. Each run is saved as it ends; a rerun skips finished runs and "
                    "resumes an interrupted one. Prints the expected time first.",
        epilog=f"default corpus: {PYTHON_DOCS} (Debian: apt-get install python3-doc); any local folder or file: "
               "--data.source PATH. Defaults over the training job's: "
               + ", ".join(f"{k} {v}" for k, v in DEFAULTS.items()) + ".")
    parser.add_argument("--families", type=choice_list(FAMILIES), default=list(FAMILIES),
                        help=f"comma-separated subset of {','.join(FAMILIES)}")
    parser.add_argument("--positions", type=choice_list(POSITIONS), default=list(POSITIONS),
                        help=f"comma-separated subset of {','.join(POSITIONS)}")
    parser.add_argument("--seeds", type=int_list("--seeds", minimum=0), default=[0, 1, 2],
                        help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--multiples", type=int_list("--multiples"), default=list(Scoring.multiples),
                        help="context lengths as multiples of data.seq_len (default "
                             f"{','.join(map(str, Scoring.multiples))})")
    parser.add_argument("--eval-tokens", type=int, default=16384,
                        help="held-out tokens scored at each context length (default 16384)")
    parser.add_argument("--yarn", action="store_true",
                        help="also score RoPE and RoVE with YaRN at each longer length, its factor that length over "
                             "the training length (perplexity and RULER)")
    parser.add_argument("--ruler", metavar="TASKS",
                        help="RULER tasks each run also answers (e.g. niah_single_1,vt; rotarium eval --ruler's "
                             "names), scored by generation and by the answer's likelihood")
    parser.add_argument("--ruler-multiples", type=int_list("--ruler-multiples"), default=list(Scoring.ruler_multiples),
                        help="RULER's context lengths as multiples of data.seq_len (default "
                             f"{','.join(map(str, Scoring.ruler_multiples))}); a task is scored where its prompt fits")
    parser.add_argument("--ruler-samples", type=int, default=20,
                        help="RULER samples per task and length, the same for every run (default 20)")
    parser.add_argument("--output-dir", default="docs/text_extrapolation", help="where the table, CSV and plot go")
    parser.add_argument("--runs-dir", default="runs/extrapolation", help="the run folders (checkpoints, models)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="runs at a time, one process and one thread each (default: 2, or 1 on one core)")
    parser.set_defaults(func=run_extrapolation, accepts_overrides=True)


def run_extrapolation(args: argparse.Namespace) -> int:
    from rotarium.evaluation.ruler import parse_tasks
    from rotarium.training.config import parse_overrides

    if args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    if args.eval_tokens < 1:
        raise ValueError(f"--eval-tokens must be positive, got {args.eval_tokens}")
    if args.ruler_samples < 1:
        raise ValueError(f"--ruler-samples must be at least 1, got {args.ruler_samples}")
    scoring = Scoring(multiples=tuple(args.multiples), eval_tokens=args.eval_tokens, yarn=args.yarn,
                      ruler_tasks=tuple(parse_tasks(args.ruler)) if args.ruler is not None else (),
                      ruler_multiples=tuple(args.ruler_multiples), ruler_samples=args.ruler_samples)
    overrides = parse_overrides(args.overrides)
    if "data.source" not in overrides:
        if not Path(PYTHON_DOCS).is_dir():
            raise ValueError(f"the default corpus {PYTHON_DOCS} is not installed: apt-get install python3-doc, or "
                             "pass --data.source FOLDER")
        overrides["data.source"] = PYTHON_DOCS
    command = ("rotarium " + " ".join(shlex.quote(a) for a in sys.argv[1:])
               if sys.argv[1:2] == ["extrapolation"] else None)
    paths = extrapolation_sweep(
        overrides, args.output_dir, args.runs_dir, families=tuple(args.families), positions=tuple(args.positions),
        seeds=tuple(args.seeds), scoring=scoring, jobs=args.jobs, command=command)
    print(paths[1].read_text())
    return 0
