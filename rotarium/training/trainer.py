"""The training loop: one code path from a laptop CPU to a multi-GPU FSDP run, with accelerate handling devices.

The learning rate is a pure function of the step and the batches a pure function of ``(seed, step)``, so a resumed
run repeats the uninterrupted one exactly. What the run writes, and where, is :mod:`rotarium.training.run_folder`.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rotarium.data.batches import StreamingSchedule
from rotarium.data.documents import iter_documents, split_documents
from rotarium.training.build import accumulation_steps, build_model, prepare_data, prepare_tokenizer
from rotarium.training.config import Config, flatten
from rotarium.training.metrics import append_record, plot_loss_curve, truncate_metrics
from rotarium.training.optim import build_optimizer, clip_norm, set_learning_rate
from rotarium.training.run_folder import (
    ACCELERATE_STATE,
    EVAL,
    FINAL,
    LOSS_CURVE,
    METRICS,
    TRAINING_ARGS,
    checkpoint_dir,
    clear_run,
    holds_run,
    latest_checkpoint,
    mark_complete,
    prune_checkpoints,
    read_trainer_state,
    staging_folder,
)
from rotarium.utils.files import read_jsonl, replace_folder, write_json_atomic

logger = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row."""


TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "comet_ml": "comet_ml",
                    "aim": "aim", "clearml": "clearml", "dvclive": "dvclive", "swanlab": "swanlab",
                    "trackio": "trackio"}


def check_trackers(report_to: list[str]) -> None:
    """Before anything is built: every tracker of ``train.report_to`` is one accelerate knows and is installed
    (the recipes log to tensorboard, which rotarium does not install by itself)."""
    import importlib.util

    for tracker in report_to:
        if tracker not in TRACKER_PACKAGES:
            raise ValueError(f"`train.report_to` has {tracker!r}; accelerate's trackers are "
                             f"{', '.join(TRACKER_PACKAGES)}")
        if importlib.util.find_spec(TRACKER_PACKAGES[tracker]) is None:
            raise ValueError(f"`train.report_to` asks for {tracker}, which is not installed: `pip install "
                             f"{TRACKER_PACKAGES[tracker]}` (or `pip install rotarium[trackers]`), or pass "
                             "`--train.report_to []`")


@dataclass
class TrainResult:
    run_dir: Path
    final_dir: Path
    steps: int
    first_val_loss: float | None
    last_val_loss: float | None
    skipped_steps: int


class Trainer:
    """``Trainer(config, run_dir).train()``. Create it in every process of an ``accelerate launch``."""

    def __init__(self, config: Config, run_dir: str | os.PathLike, *, resume: bool = False,
                 overwrite: bool = False):
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        self.config, self.run_dir = config, Path(run_dir)
        t = config.train
        check_trackers(t.report_to)
        if t.num_threads is not None:
            torch.set_num_threads(t.num_threads)
        precision = t.mixed_precision
        if precision == "auto":
            precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
        # Without an accelerator, cpu=True is what makes accelerate join the processes of a launch with gloo.
        accelerator = getattr(torch, "accelerator", None)
        no_device = (accelerator.current_accelerator() is None if accelerator is not None
                     else not torch.cuda.is_available())
        self.accelerator = Accelerator(mixed_precision=precision, log_with=t.report_to or None,
                                       project_dir=str(self.run_dir), cpu=no_device)
        acc = self.accelerator
        self._check_run_dir(resume, overwrite)
        acc.wait_for_everyone()
        set_seed(t.seed)

        self.resume_from = latest_checkpoint(self.run_dir) if resume else None
        if resume and self.resume_from is None and acc.is_main_process:
            logger.warning("--resume: no complete checkpoint in %s; starting from step 0", self.run_dir)
        self.start_step = 0
        self.state: dict[str, Any] = {"step": 0, "tokens": 0, "bad_steps_in_a_row": 0, "skipped_steps": 0}
        if self.resume_from is not None:
            self.state = read_trainer_state(self.resume_from)
            self.start_step = self.state["step"]

        documents = None if config.data.streaming else list(iter_documents(config.data))
        train_docs = None
        if documents is not None:
            train_docs = split_documents(documents, config.data.validation_fraction, t.seed)[0]
        self.tokenizer = prepare_tokenizer(config, self.run_dir, train_docs, acc)
        self.data = prepare_data(config, self.tokenizer, acc.num_processes, acc.process_index, self.start_step,
                                 documents)
        self.accum = accumulation_steps(config, acc.num_processes)
        self.tokens_per_step = t.batch_size * self.accum * acc.num_processes * config.data.seq_len

        model = build_model(config, self.tokenizer)
        if config.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.config.use_cache = False
        self.model, self.optimizer = acc.prepare(model, build_optimizer(model, config.optim))
        if self.resume_from is not None:
            acc.load_state(str(self.resume_from / ACCELERATE_STATE))
        if t.report_to:
            acc.init_trackers("rotarium", config=self._flat_config())

    # ------------------------------------------------------------------------------------------------ set-up
    def _check_run_dir(self, resume: bool, overwrite: bool) -> None:
        if not holds_run(self.run_dir) or resume or not self.accelerator.is_main_process:
            return  # the main process decides (and deletes); the others would race with its deletion
        if not overwrite:
            raise ValueError(f"--output-dir {self.run_dir} already holds a run; pass --resume to continue it, "
                             "--overwrite to start over, or choose another --output-dir")
        clear_run(self.run_dir)

    # -------------------------------------------------------------------------------------------------- loop
    def train(self) -> TrainResult:
        from tqdm.auto import tqdm

        acc, t, cfg = self.accelerator, self.config.train, self.config
        metrics_path = self.run_dir / METRICS
        if acc.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            truncate_metrics(metrics_path, self.start_step)
            write_json_atomic(self.run_dir / TRAINING_ARGS, self.training_args())
        acc.wait_for_everyone()

        if self.start_step == 0:
            self._log({"step": 0, "event": "start", "world_size": acc.num_processes,
                       "first_batch_fingerprints": self._fingerprints()}, metrics_path)
            self._evaluate(0, metrics_path)
        bar = tqdm(total=t.max_steps, initial=self.start_step, disable=not acc.is_main_process, desc="train",
                   dynamic_ncols=True)
        window: list[float] = []
        window_start = time.perf_counter()
        step = self.start_step
        while step < t.max_steps:
            lr = set_learning_rate(self.optimizer, cfg.optim, step, t.max_steps)
            loss, grad_norm = self._step(step)
            step += 1
            if math.isfinite(loss) and math.isfinite(grad_norm):
                self.optimizer.step()
                self.state["bad_steps_in_a_row"] = 0
                window.append(loss)
            else:
                self.state["bad_steps_in_a_row"] += 1
                self.state["skipped_steps"] += 1
                warnings.warn(f"step {step}: non-finite loss ({loss}) or gradient norm ({grad_norm}); "
                              "skipping the update", RuntimeWarning, stacklevel=1)
                if self.state["bad_steps_in_a_row"] >= t.max_bad_steps:
                    last = latest_checkpoint(self.run_dir)
                    bar.close()
                    raise TrainingDiverged(
                        f"{self.state['bad_steps_in_a_row']} non-finite steps in a row (train.max_bad_steps="
                        f"{t.max_bad_steps}), the last at step {step}; stopped. The last good checkpoint is "
                        f"{last or 'none (no checkpoint was saved yet)'}; lower optim.lr or raise "
                        "optim.warmup_steps and resume from it.")
            self.optimizer.zero_grad(set_to_none=True)
            self.state["step"] = step
            self.state["tokens"] += self.tokens_per_step
            bar.update(1)
            if step % t.log_every == 0 or step == t.max_steps:
                elapsed = time.perf_counter() - window_start
                record = {"step": step, "loss": sum(window) / len(window) if window else float("nan"), "lr": lr,
                          "grad_norm": grad_norm, "tokens": self.state["tokens"],
                          "tokens_per_second": self.tokens_per_step * max(1, len(window)) / max(elapsed, 1e-9)}
                bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{lr:.2e}",
                                tok_s=f"{record['tokens_per_second']:.0f}")
                self._log(record, metrics_path)
                window, window_start = [], time.perf_counter()
            if step % t.eval_every == 0 or step == t.max_steps:
                self._evaluate(step, metrics_path)
            # not during a run of bad steps: the last checkpoint before the trouble is the one to go back to
            if step % t.save_every == 0 and step < t.max_steps and not self.state["bad_steps_in_a_row"]:
                self.save_checkpoint(step)
        bar.close()
        final = self.save_final()
        if acc.is_main_process:
            plot_loss_curve(metrics_path, self.run_dir / LOSS_CURVE)
            (final / EVAL).mkdir(exist_ok=True)
            shutil.copy(self.run_dir / LOSS_CURVE, final / EVAL / LOSS_CURVE)
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            # DDP's reducer must not hold the process group's last reference: its dealloc keeps the GIL while gloo's
            # destructor joins worker threads that may need the GIL to free a tensor, a deadlock at exit
            # (pytorch/pytorch#56297). Released while the group is still registered, the group is destroyed by
            # end_training instead, on a path that releases the GIL.
            self.model = self.model.module
            acc.free_memory()
        acc.end_training()
        vals = [r["val_loss"] for r in read_jsonl(metrics_path) if "val_loss" in r]
        return TrainResult(self.run_dir, final, step, vals[0] if vals else None, vals[-1] if vals else None,
                           self.state["skipped_steps"])

    def _step(self, step: int) -> tuple[float, float]:
        """Forward and backward of every micro-batch; returns (mean loss over processes, gradient norm)."""
        acc, accum = self.accelerator, self.accum
        total = torch.zeros((), device=acc.device)
        self.model.train()
        for micro in range(accum):
            batch = {k: v.to(acc.device) for k, v in self.data.train.batch(step, micro).items()}
            sync = micro == accum - 1
            # prepare() already runs the forward under autocast when mixed precision is on
            with acc.no_sync(self.model) if not sync else contextlib.nullcontext():
                loss = self.model(**batch).loss / accum
                acc.backward(loss)
            total += loss.detach().float()
        grad_norm = acc.clip_grad_norm_(self.model.parameters(), clip_norm(self.config.optim))
        loss_mean = acc.reduce(total, reduction="mean")
        return float(loss_mean), float(grad_norm)

    @torch.no_grad()
    def _evaluate(self, step: int, metrics_path: Path) -> None:
        acc = self.accelerator
        self.model.eval()
        total = torch.zeros(2, device=acc.device, dtype=torch.float64)
        for batch in self.data.validation:
            batch = {k: v.to(acc.device) for k, v in batch.items()}
            loss = self.model(**batch).loss
            counted = _counted_labels(batch)
            total += torch.stack([loss.double() * counted, torch.tensor(counted, device=acc.device)]).double()
        total = acc.reduce(total, reduction="sum")
        if total[1] > 0:
            val = float(total[0] / total[1])
            self._log({"step": step, "val_loss": val, "val_perplexity": math.exp(min(val, 50.0))}, metrics_path)

    def _fingerprints(self) -> list[int] | None:
        """Every process's first training batch as a number, to check (and show) that processes see different
        data. (Not for a stream: reading a batch ahead would consume it.)"""
        if isinstance(self.data.train, StreamingSchedule):
            return None
        tokens = self.data.train.batch(self.start_step, 0)["input_ids"].to(self.accelerator.device)
        weights = torch.arange(1, tokens.numel() + 1, device=tokens.device) % 9973
        mine = (tokens.flatten() * weights).sum().reshape(1)
        return [int(x) for x in self.accelerator.gather(mine).tolist()]

    def _log(self, record: dict[str, Any], metrics_path: Path) -> None:
        if self.accelerator.is_main_process:
            append_record(metrics_path, record)
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self.config.train.report_to and scalars:
            self.accelerator.log(scalars, step=record["step"])

    # -------------------------------------------------------------------------------------------- saving
    def _flat_config(self) -> dict[str, Any]:
        """The config as ``section.key`` scalars (lists and mappings as JSON), as trackers and
        ``training_args.json`` take it."""
        flat = flatten(self.config.to_dict())
        return {key: json.dumps(value) if isinstance(value, (list, dict)) else value for key, value in flat.items()}

    def training_args(self) -> dict[str, Any]:
        args = self._flat_config()
        args.update({"world_size": self.accelerator.num_processes, "tokens_per_step": self.tokens_per_step,
                     "max_tokens": self.tokens_per_step * self.config.train.max_steps})
        if self.config.data.source != "embedded" and not Path(self.config.data.source).exists():
            args["dataset"] = self.config.data.source
        return args

    def _save_model(self, folder: Path) -> None:
        acc = self.accelerator
        state_dict = acc.get_state_dict(self.model)  # gathers FSDP shards; every process must call it
        if acc.is_main_process:
            model = acc.unwrap_model(self.model)
            model.config.use_cache = True
            model.save_pretrained(folder, state_dict=state_dict, save_function=acc.save)
            model.config.use_cache = False
            self.tokenizer.save_pretrained(folder)
            write_json_atomic(folder / TRAINING_ARGS, self.training_args())

    def save_checkpoint(self, step: int) -> Path:
        return self._write_folder(checkpoint_dir(self.run_dir, step), step=step)

    def save_final(self) -> Path:
        return self._write_folder(self.run_dir / FINAL)

    def _write_folder(self, target: Path, step: int | None = None) -> Path:
        """The model and tokenizer (plus, for a checkpoint of ``step``, the accelerate state and, last, the trainer
        state and ``COMPLETE``) into the staging folder, which the main process then renames to ``target``."""
        acc = self.accelerator
        tmp = staging_folder(target)
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        if step is not None:
            acc.save_state(str(tmp / ACCELERATE_STATE))
        self._save_model(tmp)
        acc.wait_for_everyone()
        if acc.is_main_process:
            if step is not None:
                mark_complete(tmp, step, self.state)
            replace_folder(tmp, target)
            if step is not None:
                prune_checkpoints(self.run_dir, self.config.train.keep_checkpoints)
        acc.wait_for_everyone()
        return target


def _counted_labels(batch: dict[str, torch.Tensor]) -> int:
    """How many predictions the model's loss averages over: every position but each document's last token."""
    cu = batch.get("cu_seqlens")
    if cu is None:
        return int(batch["labels"][:, 1:].ne(-100).sum())
    return int(batch["labels"].numel() - (cu.numel() - 1))
