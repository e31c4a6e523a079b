"""The training loop: one code path from a laptop CPU to a multi-GPU FSDP run, with accelerate handling devices.

The learning rate is a pure function of the step and the batches a pure function of ``(seed, step)``, so a resumed
run repeats the uninterrupted one exactly. What the run writes, and where, is :mod:`rotarium.training.run_folder`;
the run holds its folder's lock (:mod:`rotarium.training.lock`) from the start until :meth:`Trainer.close`.

Nothing of an earlier run is touched before the new run has its config, data and model: then ``--overwrite`` moves
the old run into ``previous/``, deletes it once the new run has written its first checkpoint (or final model), and
puts it back if the new run stops with an error before that. ``--resume`` continues from the checkpoint
:func:`rotarium.training.resume.choose_checkpoint` picks, with a config :func:`~rotarium.training.resume.check_config`
accepts, and never goes back on the run's work (:func:`~rotarium.training.resume.check_rewind`) unless
``--allow-rewind`` says so, which sets what it replaces aside once the set-up has succeeded. A run that does not
continue a checkpoint builds its tokenizer from its own config, whatever an earlier run left in the folder.
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rotarium.data.batches import StreamingSchedule
from rotarium.data.documents import iter_documents, split_documents
from rotarium.data.heldout import RECORD_KEY, held_out_record
from rotarium.models import set_activation_checkpointing
from rotarium.training.accelerator import make_accelerator
from rotarium.training.build import accumulation_steps, build_model, prepare_data, prepare_tokenizer
from rotarium.training.config import Config, flatten
from rotarium.training.guard import LossGuard
from rotarium.training.lock import RunLock
from rotarium.training.metrics import append_record, plot_loss_curve, truncate_metrics
from rotarium.training.optim import build_optimizer, clip_norm, set_learning_rate
from rotarium.training.resume import (
    check_allowed_keys,
    check_config,
    check_launch,
    check_rewind,
    choose_checkpoint,
)
from rotarium.training.run_folder import (
    ACCELERATE_STATE,
    EVAL,
    FINAL,
    LOSS_CURVE,
    METRICS,
    PREVIOUS,
    REPLACING,
    TOKENIZER,
    TRAINING_ARGS,
    checkpoint_dir,
    drop_previous_run,
    holds_run,
    latest_good_checkpoint,
    mark_complete,
    prune_checkpoints,
    read_trainer_state,
    restore_previous_run,
    set_aside_rewound,
    set_aside_run,
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
    """``Trainer(config, run_dir).train()``, then ``close()`` (which releases the run folder's lock; so does the
    process ending). Create it in every process of an ``accelerate launch``.

    ``resume``: continue from the run's newest good, verified checkpoint, or from ``resume_from`` (``step-N``);
    ``allow_config_change``: config keys that may differ from the run's on resume (:mod:`rotarium.training.resume`);
    ``allow_rewind``: let a resume go back before the step the run reached (see the module docstring);
    ``overwrite``: replace the run in ``run_dir`` (see the module docstring)."""

    def __init__(self, config: Config, run_dir: str | os.PathLike, *, resume: bool = False,
                 overwrite: bool = False, resume_from: str | None = None, allow_config_change: Iterable[str] = (),
                 allow_rewind: bool = False):
        self.config, self.run_dir = config, Path(run_dir)
        t = config.train
        check_trackers(t.report_to)
        if t.num_threads is not None:
            torch.set_num_threads(t.num_threads)
        self.accelerator = make_accelerator(t, self.run_dir)
        self._lock: RunLock | None = None
        self._previous_pending = False  # main process: an --overwrite's old run waits in previous/
        self.allow_rewind = allow_rewind
        try:
            self._set_up(resume or resume_from is not None, overwrite, resume_from, set(allow_config_change))
        except BaseException:
            self._put_previous_back()
            if self._lock is not None:  # under the lock, whatever an --overwrite staged is this run's
                shutil.rmtree(self.run_dir / REPLACING, ignore_errors=True)
            self.close()
            raise

    def _set_up(self, resume: bool, overwrite: bool, resume_from: str | None, allowed: set[str]) -> None:
        from accelerate.utils import set_seed

        acc, config, t = self.accelerator, self.config, self.config.train

        def take_folder() -> tuple[str | None, bool, int | None]:
            try:
                self._lock = RunLock(self.run_dir)
            except OSError as error:  # a special or read-only file system that the permission bits do not show
                why = f"{error.strerror or error}: {error.filename or self.run_dir}"
                raise ValueError(f"--output-dir {self.run_dir} cannot be created or written ({why}); choose a folder "
                                 "on a writable file system") from None
            return self._plan(resume, overwrite, resume_from, allowed)

        resume_path, replacing, rewind_from = self._main_decides(take_folder)
        set_seed(t.seed)
        self.resume_from = Path(resume_path) if resume_path is not None else None
        self.start_step = 0
        self.state: dict[str, Any] = {"step": 0, "tokens": 0, "bad_steps_in_a_row": 0, "skipped_steps": 0}
        if self.resume_from is not None:
            self.state = read_trainer_state(self.resume_from)
            self.start_step = self.state["step"]

        documents = None if config.data.streaming else list(iter_documents(config.data))
        train_docs = None
        if documents is not None:
            train_docs = split_documents(documents, config.data.validation_fraction, t.seed)[0]
        # An --overwrite run keeps its tokenizer apart until the old run is set aside (it must not reuse the old one).
        self.tokenizer = prepare_tokenizer(config, self.run_dir / REPLACING if replacing else self.run_dir,
                                           train_docs, acc, reuse=self.resume_from is not None)
        self.data = prepare_data(config, self.tokenizer, acc.num_processes, acc.process_index, self.start_step,
                                 documents)
        self.accum = accumulation_steps(config, acc.num_processes)
        self.tokens_per_step = t.batch_size * self.accum * acc.num_processes * config.data.seq_len

        model = build_model(config, self.tokenizer)
        self.guard = LossGuard(t.spike_factor, t.spike_window, model.config.vocab_size, self.state)
        if config.model.gradient_checkpointing:
            set_activation_checkpointing(model)
        model.config.use_cache = False
        self.model, self.optimizer = acc.prepare(model, build_optimizer(model, config.optim))
        if self.resume_from is not None:
            acc.load_state(str(self.resume_from / ACCELERATE_STATE))
        if replacing and acc.is_main_process:
            set_aside_run(self.run_dir)
            self._previous_pending = True
            os.replace(self.run_dir / REPLACING / TOKENIZER, self.run_dir / TOKENIZER)
            (self.run_dir / REPLACING).rmdir()
            logger.warning("--overwrite: the run in %s is moved to %s until this run writes its first checkpoint",
                           self.run_dir, self.run_dir / PREVIOUS)
        if rewind_from is not None and acc.is_main_process:
            aside = set_aside_rewound(self.run_dir, self.start_step, rewind_from)
            logger.warning("--allow-rewind: the run goes back from step %d to step %d; its final model, later "
                           "checkpoints and metrics up to step %d are kept in %s", rewind_from, self.start_step,
                           rewind_from, aside)
        acc.wait_for_everyone()
        if t.report_to:
            acc.init_trackers("rotarium", config=self._flat_config())

    # ------------------------------------------------------------------------------------------------ set-up
    def _main_decides(self, decide: Callable[[], Any]) -> Any:
        """Runs ``decide`` in the main process only and hands its result, or its ``ValueError``, to every process
        (so that a refusal stops them all, not only the one that looked)."""
        acc = self.accelerator
        outcome: list[Any] = [None, None]
        if acc.is_main_process:
            try:
                outcome = [None, decide()]
            except ValueError as error:
                outcome = [str(error), None]
        if acc.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(outcome)
        if outcome[0] is not None:
            raise ValueError(outcome[0])
        return outcome[1]

    def _plan(self, resume: bool, overwrite: bool, resume_from: str | None,
              allowed: set[str]) -> tuple[str | None, bool, int | None]:
        """What to do with the run folder (main process, under the lock): ``(checkpoint to resume, replacing, the
        step an allowed rewind goes back from)``."""
        run_dir, max_steps = self.run_dir, self.config.train.max_steps
        if allowed and not resume:
            raise ValueError("--allow-config-change applies to --resume only")
        if self.allow_rewind and not resume:
            raise ValueError("--allow-rewind applies to --resume only")
        check_allowed_keys(allowed)
        previous = run_dir / PREVIOUS
        if resume:
            checkpoint = choose_checkpoint(run_dir, resume_from, at_most=max_steps if self.allow_rewind else None)
            rewind_from = check_rewind(run_dir, checkpoint, max_steps, named=resume_from is not None,
                                       allow=self.allow_rewind)
            if checkpoint is not None:
                check_config(checkpoint, self.config, allowed)
                check_launch(checkpoint, fsdp=self.accelerator.distributed_type == "FSDP")
                return str(checkpoint), False, rewind_from
            logger.warning("--resume: no complete checkpoint in %s%s; starting from step 0%s", run_dir,
                           f" at or before step {max_steps}" if self.allow_rewind else "",
                           f" ({previous} holds the run an --overwrite set aside)" if previous.exists() else "")
            return None, False, rewind_from
        if not holds_run(run_dir):
            if previous.exists():
                logger.warning("%s holds the run an earlier --overwrite set aside (that run was stopped before its "
                               "first checkpoint); it is kept: delete it, or move it back, yourself", previous)
            return None, False, None
        if not overwrite:
            raise ValueError(f"--output-dir {run_dir} already holds a run; pass --resume to continue it, "
                             "--overwrite to start over, or choose another --output-dir")
        if previous.exists():
            raise ValueError(f"--overwrite: {previous} holds a run an earlier --overwrite set aside, and "
                             f"{run_dir} holds another; delete one (or move {previous}'s files back) first")
        shutil.rmtree(run_dir / REPLACING, ignore_errors=True)  # what a killed --overwrite run had staged
        return None, True, None

    def _put_previous_back(self) -> None:
        """Main process: the run stopped before its first checkpoint, so the run it was replacing returns."""
        if self._previous_pending:
            restore_previous_run(self.run_dir)
            self._previous_pending = False
            logger.warning("--overwrite: this run stopped before its first checkpoint; the previous run is back in %s",
                           self.run_dir)

    def _drop_previous(self) -> None:
        if self._previous_pending:
            drop_previous_run(self.run_dir)
            self._previous_pending = False

    def close(self) -> None:
        """Releases the run folder's lock (main process). Call it once done with the run folder."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # -------------------------------------------------------------------------------------------------- loop
    def train(self) -> TrainResult:
        try:
            return self._train()
        except BaseException:
            self._put_previous_back()
            raise

    def _train(self) -> TrainResult:
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
            healthy_before = self.guard.healthy_since_good
            problem = self.guard.observe(step, loss)
            if problem is not None and healthy_before and math.isfinite(loss):
                warnings.warn(f"step {step}: {problem}; checkpoints from here on are not marked good (the last good "
                              f"one: {latest_good_checkpoint(self.run_dir) or 'none'})", RuntimeWarning, stacklevel=1)
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
                    bar.close()
                    raise TrainingDiverged(
                        f"{self.state['bad_steps_in_a_row']} non-finite steps in a row (train.max_bad_steps="
                        f"{t.max_bad_steps}), the last at step {step}; stopped. {self._last_good_advice()}")
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
        if not self.guard.healthy_since_good:
            warnings.warn(f"the loss went bad since the last good checkpoint ({self.guard.describe_trouble()}); "
                          f"{final} holds the weights after that. {self._last_good_advice()}", RuntimeWarning,
                          stacklevel=1)
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

    def _last_good_advice(self) -> str:
        last = latest_good_checkpoint(self.run_dir)
        if last is None:
            return ("No good checkpoint was saved (the loss went bad before one); lower optim.lr or raise "
                    "optim.warmup_steps and start again with --overwrite.")
        return (f"The last good checkpoint is {last}, which --resume picks; lower optim.lr or raise "
                "optim.warmup_steps and resume from it (e.g. --resume --allow-config-change optim.lr --optim.lr "
                "<lower>).")

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
        args[RECORD_KEY] = held_out_record(self.config.data, self.data.validation_documents)
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
        # on every process, so that their guards agree; before the state is saved, as it resets the counters
        verdict = self.guard.checkpoint_verdict() if step is not None else {}
        if acc.is_main_process:
            if step is not None:
                mark_complete(tmp, step, {**self.state, **verdict})
            replace_folder(tmp, target)
            self._drop_previous()
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
