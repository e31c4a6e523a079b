"""Perplexity against context length: the length-extrapolation curve of the papers.

The text is one token stream, each document framed as the run's training framed it (the tokenizer's bos where its
template starts a text with one, the text, the eos that ends a document in packing: the same function training and
``rotarium prepare`` use, :class:`~rotarium.data.prepared.DocumentEncoder`), so a context can span several
documents as a training sequence does; a prepared folder's validation split is stored so framed. For a context
length L it is cut into non-overlapping windows of L tokens and every prediction in every window is scored. Each
length scores the same tokens where the text allows (``max_tokens`` of them), so the numbers differ only by how
much context the model gets, up to the window's own length.
"""
from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rotarium.data.config import DEFAULT_SEED, LOCAL_KINDS, DataSection
from rotarium.data.documents import held_out_documents, iter_documents
from rotarium.data.heldout import RECORD_KEY as HELD_OUT_RECORD
from rotarium.data.heldout import (
    check_held_out,
    check_prepared,
    check_source,
    is_prepared_record,
    recorded_source,
    warn_if_changed,
)
from rotarium.data.prepared import DocumentEncoder, PreparedCorpus, is_prepared, tokenizer_fingerprint
from rotarium.evaluation.outputs import check_result_paths, result_path
from rotarium.evaluation.tasks import EvalRun, EvalTask, Flag
from rotarium.utils.files import make_folder, write_json_atomic
from rotarium.utils.plots import save_figure

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

RESULT_FILES = ("perplexity.json", "perplexity.png")
MAX_TOKENS = 65536
# The lengths perplexity is scored at where no training length scales them (Perplexity.default_lengths), and
# rotarium train's eval.context_lengths without one given.
DEFAULT_LENGTHS = (64, 128, 256, 512)


def stream_tokens(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> torch.Tensor:
    """``texts`` as one token stream ``[N]``, each document framed as training frames it (the framing is the
    tokenizer's, which the checkpoint carries: a run has no other), so the model is scored on text as it was
    trained to read it."""
    tokens, _ = DocumentEncoder(tokenizer, np.dtype(np.int64))(list(texts))
    return torch.from_numpy(tokens)


def evaluation_tokens(text: list[str] | PreparedCorpus | torch.Tensor, tokenizer: PreTrainedTokenizerBase,
                      limit: int) -> torch.Tensor:
    """The token stream ``[N]`` to score: documents tokenised and framed as training frames them
    (:func:`stream_tokens`), or a prepared folder's validation split as it is stored, its first ``limit`` tokens
    (all of them are never needed: see :func:`perplexity_by_context`), or ``text`` itself where it is already that
    stream (a job scoring one text at several lengths tokenises it once). Raises ``ValueError`` when ``tokenizer`` is
    not the folder's: its ids would mean other text."""
    if isinstance(text, torch.Tensor):
        return text
    if not isinstance(text, PreparedCorpus):
        return stream_tokens(tokenizer, text)
    if tokenizer_fingerprint(tokenizer) != text.tokenizer_sha256:
        raise ValueError(f"the model's tokenizer is not the one the prepared folder {text.path} was made with "
                         f"(SHA-256 {tokenizer_fingerprint(tokenizer)[:12]}, the folder's "
                         f"{text.tokenizer_sha256[:12]}); score it with a model trained on it, or pass --data FILE")
    split = text.validation
    return torch.from_numpy(split.tokens(0, min(limit, split.num_tokens)).astype("int64"))


def check_settings(max_tokens: int, batch_size: int) -> None:
    """Raises ``ValueError`` naming the flag when ``--max-tokens`` or ``--batch-size`` cannot work."""
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")


@torch.no_grad()
def perplexity_by_context(model: PreTrainedModel, tokens: torch.Tensor, context_lengths: list[int], *,
                          max_tokens: int = MAX_TOKENS, batch_size: int = 8,
                          progress: bool = True) -> list[dict[str, Any]]:
    """``tokens`` ``[N]``: for each L in ``context_lengths``, the mean loss over windows of L tokens of the first
    ``max_tokens`` (rounded down to whole windows; at least one window). Rows: context_length, windows, tokens,
    loss, perplexity. Lengths longer than the text are reported with ``windows = 0``."""
    from tqdm.auto import tqdm

    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if not context_lengths or any(not isinstance(L, int) or L < 2 for L in context_lengths):
        raise ValueError(f"context lengths must be integers >= 2, got {context_lengths}")
    check_settings(max_tokens, batch_size)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    rows = []
    for L in sorted(context_lengths):
        budget = max(max_tokens, L)
        n_windows = min(tokens.numel(), budget) // L
        if n_windows == 0:
            rows.append({"context_length": L, "windows": 0, "tokens": 0, "loss": None, "perplexity": None})
            continue
        windows = tokens[:n_windows * L].view(n_windows, L)
        total, count = 0.0, 0
        for first in tqdm(range(0, n_windows, batch_size), desc=f"eval L={L}", disable=not progress, leave=False):
            batch = windows[first:first + batch_size].to(device)
            logits = model(input_ids=batch, use_cache=False).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(),
                                                     reduction="sum")
            total += float(loss)
            count += batch[:, 1:].numel()
        mean = total / count
        rows.append({"context_length": L, "windows": n_windows, "tokens": count, "loss": round(mean, 5),
                     "perplexity": round(math.exp(min(mean, 50.0)), 3)})
    model.train(was_training)
    return rows


def format_table(rows: list[dict[str, Any]], train_length: int | None = None) -> str:
    lines = ["| context | windows | loss | perplexity |", "|---:|---:|---:|---:|"]
    for r in rows:
        mark = " (beyond training)" if train_length and r["context_length"] > train_length else ""
        loss = "-" if r["loss"] is None else f"{r['loss']:.4f}"
        ppl = "-" if r["perplexity"] is None else f"{r['perplexity']:.2f}"
        lines.append(f"| {r['context_length']}{mark} | {r['windows']} | {loss} | {ppl} |")
    return "\n".join(lines)


def save_results(rows: list[dict[str, Any]], folder: str | os.PathLike, *, title: str,
                 train_length: int | None = None, rope_scaling: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """``folder/perplexity.json`` (the rows) and ``folder/perplexity.png`` (perplexity against context length, the
    training length marked). Under ``rope_scaling`` (``--rope-scaling``'s JSON), files named after it
    (:func:`rotarium.evaluation.outputs.result_path`), the JSON ``{"rope_scaling": ..., "rows": [...]}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    make_folder(folder, "the evaluation folder")
    table, plot = (result_path(folder, name, rope_scaling) for name in RESULT_FILES)
    write_json_atomic(table, rows if rope_scaling is None else {"rope_scaling": rope_scaling, "rows": rows})
    points = [(r["context_length"], r["perplexity"]) for r in rows if r["perplexity"] is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    if points:
        ax.plot(*zip(*points), marker="o")
    if train_length:
        ax.axvline(train_length, color="gray", linestyle="--", label=f"training length {train_length}")
        ax.legend()
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, plot)
    return table, plot


def _training_args(model_dir: str | os.PathLike | None) -> tuple[dict[str, Any], Path | None]:
    """The ``training_args.json`` beside the checkpoint (or in its run folder), and its path."""
    for folder in (Path(model_dir), Path(model_dir).parent) if model_dir else ():
        path = folder / "training_args.json"
        if path.is_file():
            try:
                args = json.loads(path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as error:
                raise ValueError(f"{path} is not JSON ({error}); pass --data FILE to score a text of your choice"
                                 ) from None
            if not isinstance(args, dict):
                raise ValueError(f"{path} is not a JSON object; pass --data FILE to score a text of your choice")
            return args, path
    return {}, None


def evaluation_documents(data: str, model_dir: str | os.PathLike | None = None, *, allow_data_change: bool = False
                         ) -> tuple[list[str] | PreparedCorpus, str]:
    """The texts to score (for :func:`evaluation_tokens`) and a description. ``data``: ``validation`` (the documents
    the checkpoint's training run held out, re-derived from its ``training_args.json`` and checked against the
    record of them made at training, :mod:`rotarium.data.heldout`: the source's identity, then the documents' digest;
    a prepared folder's validation split for a run from one; the embedded corpus's split when there is none; a
    changed source only warns with ``allow_data_change``), ``embedded`` (the whole embedded corpus), a prepared
    folder (its validation split), or a local text / JSON Lines / Parquet file or folder."""
    if data == "validation":
        args, path = _training_args(model_dir)
        if is_prepared_record(args.get(HELD_OUT_RECORD)):
            warn_if_changed(args[HELD_OUT_RECORD], str(path))
            corpus = check_prepared(args[HELD_OUT_RECORD], str(path), allow=allow_data_change)
            return corpus, f"{corpus.path} (validation split)"
        section = DataSection(**{k[5:]: v for k, v in args.items() if k.startswith("data.")
                                 and k[5:] in DataSection.__dataclass_fields__})
        record = args.get(HELD_OUT_RECORD)
        if path is None:
            logger.warning("no training_args.json beside %s: scoring the embedded corpus's validation split, which "
                           "this model may have trained on; pass --data FILE to score a text it did not see",
                           model_dir or "the model")
        elif record is None:
            logger.warning("%s has no record of the documents the run held out (written by an older rotarium): the "
                           "validation split of `data.source=%s` is re-derived and cannot be verified; if the corpus "
                           "changed since training, it may hold training documents", path, section.source)
        else:
            section = recorded_source(record, section, str(path))
            check_source(record, section, str(path), allow=allow_data_change,
                         hint="or pass --data FILE to score another text knowingly")
            warn_if_changed(record, str(path))
        documents = held_out_documents(section, args.get("train.seed", DEFAULT_SEED))
        if record is not None:
            check_held_out(record, section, documents, str(path), allow=allow_data_change)
        split = "held-out documents" if section.streaming else "validation split"
        return documents, f"{section.source} ({split})"
    if is_prepared(data):
        return PreparedCorpus(data), f"{data} (validation split)"
    return list(iter_documents(DataSection(source=data))), data


@dataclass(frozen=True)
class PerplexityTexts:
    """What :meth:`Perplexity.evaluate` scores: ``documents`` (for :func:`evaluation_tokens`), how tables name them
    (``description``), the tokens scored per length (``max_tokens``) and what a plot's title says was measured
    (``measure``; perplexity on the description without it)."""
    documents: list[str] | PreparedCorpus | torch.Tensor
    description: str
    max_tokens: int
    measure: str | None = None


class Perplexity(EvalTask):
    """``rotarium eval`` without a selector: perplexity against context length on held-out text."""

    name = "perplexity"
    flags = (
        Flag("--data", {"default": None, "help": (
            "'validation': the documents the checkpoint's training run held out, checked against the record the run "
            "kept of them (default); 'embedded': the embedded corpus; a prepared folder (its validation split); or a "
            f"local {LOCAL_KINDS} file or folder")}),
        Flag("--allow-data-change", {"action": "store_true", "help": (
            "score the run's held-out documents derived from its source as it is now, although the source changed "
            "since training (they may then include documents the run trained on; without it such an evaluation is "
            "refused, naming what changed)")}),
        Flag("--max-tokens", {"type": int, "default": None,
                              "help": f"tokens scored per context length (default {MAX_TOKENS})"}),
    )
    result_files = RESULT_FILES
    lengths_help = "half, 1x, 2x and 4x the training length"

    def default_lengths(self, train_length: int | None) -> list[int]:
        if not train_length:
            return list(DEFAULT_LENGTHS)
        return sorted({max(2, train_length // 2), *(train_length * m for m in (1, 2, 4))})

    def prepare(self, run: EvalRun) -> PerplexityTexts:
        args = run.args
        max_tokens = MAX_TOKENS if args.max_tokens is None else args.max_tokens
        check_settings(max_tokens, args.batch_size)
        check_result_paths(run.output, RESULT_FILES, run.rope_scaling, run.what)
        documents, description = evaluation_documents("validation" if args.data is None else args.data,
                                                      args.model if run.local else None,
                                                      allow_data_change=args.allow_data_change)
        return PerplexityTexts(documents, description, max_tokens)

    def evaluate(self, prepared: PerplexityTexts, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 run: EvalRun) -> dict[str, Any]:
        train_length = run.training_length(model)
        lengths = run.lengths(self, train_length)
        tokens = evaluation_tokens(prepared.documents, tokenizer, max(prepared.max_tokens, *lengths))
        rows = perplexity_by_context(model, tokens, lengths, max_tokens=prepared.max_tokens,
                                     batch_size=run.args.batch_size, progress=run.progress)
        measure = prepared.measure or f"perplexity on {prepared.description}"
        return {"rows": rows, "description": prepared.description, "tokens": tokens.numel(),
                "train_length": train_length, "measure": measure}

    def summary(self, record: dict[str, Any], run: EvalRun) -> str:
        return (f"{run.model_name}{run.scaled} on {record['description']} ({record['tokens']} tokens):\n"
                f"{format_table(record['rows'], record['train_length'])}")

    def save(self, record: dict[str, Any], run: EvalRun) -> tuple[Path, ...]:
        return save_results(record["rows"], run.output, title=run.title(record["measure"]),
                            train_length=record["train_length"], rope_scaling=run.rope_scaling)

    def wrote(self, paths: Sequence[Path]) -> str:
        table, plot = paths
        return f"wrote {table} and {plot}"
