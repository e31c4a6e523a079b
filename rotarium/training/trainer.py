"""The training loop: one code path from a laptop CPU to a multi-GPU FSDP run, with accelerate handling devices.

The learning rate is a pure function of the step and the batches a pure function of ``(seed, step)`` (a stream's,
of each process's position in it, which every checkpoint records), so a resumed run repeats the uninterrupted one
exactly. The run folder (its lock, what is written where, the checkpoint to resume,
an ``--overwrite`` or a rewind) has one owner, :class:`rotarium.training.run_folder.RunFolder`, which the trainer
calls at fixed points; the lock is held from the start until :meth:`Trainer.close`.

Nothing of an earlier run is touched before the new run has its config, data and model: then ``--overwrite`` moves
the old run into ``previous/``, deletes it once the new run has written its first checkpoint (or final model), and
puts it back if the new run stops with an error before that. ``--resume`` continues from the checkpoint
:meth:`~rotarium.training.run_folder.RunFolder.plan` picks, with a config
:func:`~rotarium.training.resume.check_config` accepts, and never goes back on the run's work
(:func:`~rotarium.training.run_folder.check_rewind`) unless ``--allow-rewind`` says so, which sets what it replaces
aside once the set-up has succeeded. A run that does not continue a checkpoint builds its tokenizer from its own
config, whatever an earlier run left in the folder.

A step of the loop is :meth:`Trainer.train_step` (forward, backward and the optimizer step, with the loss guard),
then :meth:`~Trainer.log_step`, :meth:`~Trainer.evaluate` and :meth:`~Trainer.save_checkpoint`, each on its own
interval; :meth:`~Trainer.finish` saves the final model and plots the loss curve.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rotarium.data.documents import iter_documents, split_documents
from rotarium.data.heldout import (
    RECORD_KEY,
    absolute_source,
    changed_at_steps,
    check_held_out,
    is_prepared_record,
)
from rotarium.data.loader import BackgroundCheck
from rotarium.models import set_activation_checkpointing
from rotarium.training.accelerator import make_accelerator
from rotarium.training.build import (
    build_model,
    check_init_from_model,
    check_prepared_source_exists,
    loader_settings,
    open_data_source,
    prepare_data,
    prepare_tokenizer,
)
from rotarium.training.config import Config, flatten
from rotarium.training.flops import flops_per_token, peak_flops
from rotarium.training.guard import LossGuard
from rotarium.training.optim import build_optimizer, clip_norm, set_learning_rate
from rotarium.training.resume import check_allowed_keys, check_config, check_data, check_launch, recorded_held_out
from rotarium.training.run_folder import (
    ACCELERATE_STATE,
    TRAINING_ARGS,
    FolderPlan,
    RunFolder,
    read_trainer_state,
)
from rotarium.training.state import DataPosition, LoopCounters, TrainerState
from rotarium.utils.files import read_jsonl, write_json_atomic
from rotarium.utils.interrupts import raise_if_interrupted

logger = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row."""


class DamagedData(ValueError):
    """A shard of the prepared folder the run reads does not match its recorded SHA-256."""


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


@dataclass
class StepResult:
    """What :meth:`Trainer.train_step` did: the loss (one mean over the tokens of every process and micro-batch),
    the gradient norm before clipping, the learning rate, and whether the optimizer stepped (not for a non-finite
    loss or norm)."""
    loss: float
    grad_norm: float
    lr: float
    updated: bool


class Trainer:
    """``Trainer(config, run_dir).train()``, then ``close()`` (which releases the run folder's lock; so does the
    process ending). Create it in every process of an ``accelerate launch``.

    ``resume``: continue from the run's newest good, verified checkpoint, or from ``resume_from`` (``step-N``);
    ``allow_config_change``: config keys that may differ from the run's on resume (:mod:`rotarium.training.resume`);
    ``allow_rewind``: let a resume go back before the step the run reached (see the module docstring);
    ``allow_data_change``: let a resume go on with a data source that changed since the checkpoint
    (:mod:`rotarium.data.heldout`; its held-out documents may then overlap the ones trained on);
    ``overwrite``: replace the run in ``run_dir`` (see the module docstring). A local ``data.source`` is taken as
    its absolute path."""

    def __init__(self, config: Config, run_dir: str | os.PathLike, *, resume: bool = False,
                 overwrite: bool = False, resume_from: str | None = None, allow_config_change: Iterable[str] = (),
                 allow_rewind: bool = False, allow_data_change: bool = False):
        config = dataclasses.replace(config, data=absolute_source(config.data))
        self.config, self.run_dir = config, Path(run_dir)
        self.allow_data_change = allow_data_change
        t = config.train
        check_prepared_source_exists(config)
        check_trackers(t.report_to)
        if t.num_threads is not None:
            torch.set_num_threads(t.num_threads)
        self.accelerator = make_accelerator(t, self.run_dir)
        self.folder = RunFolder(self.run_dir, main=self.accelerator.is_main_process)
        try:
            self._set_up(resume or resume_from is not None, overwrite, resume_from, set(allow_config_change),
                         allow_rewind)
        except BaseException:
            self.folder.abandon()
            self.close()
            raise

    # ------------------------------------------------------------------------------------------------ set-up
    def _set_up(self, resume: bool, overwrite: bool, resume_from: str | None, allowed: set[str],
                allow_rewind: bool) -> None:
        from accelerate.utils import set_seed

        acc, config, t = self.accelerator, self.config, self.config.train
        source = open_data_source(config, acc.num_processes)
        prepared = source.prepared

        def take_folder() -> tuple[FolderPlan, bool]:
            if allowed and not resume:
                raise ValueError("--allow-config-change applies to --resume only")
            if self.allow_data_change and not resume:
                raise ValueError("--allow-data-change applies to --resume only")
            check_allowed_keys(allowed)
            self.folder.lock()
            plan = self.folder.plan(resume=resume, overwrite=overwrite, resume_from=resume_from,
                                    allow_rewind=allow_rewind, max_steps=t.max_steps)
            changed = False
            if plan.checkpoint is not None:
                check_config(plan.checkpoint, config, allowed)
                changed = check_data(plan.checkpoint, config.data, prepared.identity if prepared is not None else None,
                                     allowed, allow_change=self.allow_data_change, layout=source.layout,
                                     stream=source.stream)
                check_launch(plan.checkpoint, fsdp=acc.distributed_type == "FSDP")
            return plan, changed

        plan, changed = self._main_decides(take_folder)
        set_seed(t.seed)
        self.resume_from = plan.checkpoint
        self.counters = LoopCounters()

        documents = None if config.data.streaming or prepared is not None else list(iter_documents(config.data))
        train_docs = None
        if documents is not None:
            train_docs = split_documents(documents, config.data.validation_fraction, t.seed)[0]
        self.tokenizer = prepare_tokenizer(config, self.folder.tokenizer_home(plan), train_docs, acc,
                                           reuse=self.resume_from is not None, prepared=prepared)
        if prepared is not None and prepared.metadata["tokenizer"]["vocab_size"] > len(self.tokenizer):
            raise ValueError(f"the prepared folder {config.data.source} holds ids of a vocabulary of "
                             f"{prepared.metadata['tokenizer']['vocab_size']}, the run's tokenizer has "
                             f"{len(self.tokenizer)}; train from the folder the run was started on")
        settings = loader_settings(config, acc.num_processes, acc.process_index, order_cache=self.folder.data_order,
                                   pin_memory=acc.device.type == "cuda")
        self.data = prepare_data(config, self.tokenizer, source, settings, documents)
        self._changed_at: list[int] = []
        if self.resume_from is not None:
            changed = self._check_held_out() or changed
            self._changed_at = changed_at_steps(recorded_held_out(self.resume_from)[0])
        # the shards' hashes, checked while the run trains (a large folder would delay the first step by minutes)
        self._verifying = prepared is not None and not config.data.skip_verify
        self._verifier = (BackgroundCheck(functools.partial(prepared.verify, splits=("train", "validation")))
                          if self._verifying and acc.is_main_process else None)
        self.accum = settings.accum
        self.tokens_per_step = t.batch_size * self.accum * acc.num_processes * config.data.seq_len

        model = build_model(config, self.tokenizer)
        if self.resume_from is None:  # a resumed run's model settings were checked when it started
            check_init_from_model(config, model)
        # counted before accelerate shards the weights; the peak only where one is known (on CUDA)
        self.flops_per_token = flops_per_token(model, config.data.seq_len)
        self.peak_flops = peak_flops(torch.cuda.get_device_name(acc.device)) if acc.device.type == "cuda" else None
        self.guard = LossGuard(t.spike_factor, t.spike_window, model.config.vocab_size)
        position = DataPosition(self.data.train, self.counters, functools.partial(_gathered, acc))
        self.checkpoint_state = TrainerState(self.counters, {"guard": self.guard, "data": position})
        if config.model.gradient_checkpointing:
            set_activation_checkpointing(model)
        model.config.use_cache = False
        self.model, self.optimizer = acc.prepare(model, build_optimizer(model, config.optim))
        if self.resume_from is not None:
            acc.load_state(str(self.resume_from / ACCELERATE_STATE))
            self.checkpoint_state.load_state_dict(read_trainer_state(self.resume_from))
            if changed:
                self._changed_at.append(self.counters.step)
        self.start_step = self.counters.step
        self.folder.begin(plan, self.start_step, self.training_args())
        acc.wait_for_everyone()
        if t.report_to:
            acc.init_trackers("rotarium", config=self._flat_config())

    def _check_held_out(self) -> bool:
        """On resume, the held-out documents derived again must be the ones the checkpoint recorded
        (:func:`~rotarium.data.heldout.check_held_out`; a prepared folder's split is checked by its fingerprint).
        Returns whether they changed and ``--allow-data-change`` let the run go on."""
        record, where = recorded_held_out(self.resume_from)
        if record is None or is_prepared_record(record) or self.data.prepared is not None:
            return False
        return check_held_out(record, self.config.data, self.data.validation_documents, where,
                              allow=self.allow_data_change, prefix="--resume: ",
                              hint="or start a new run from the checkpoint's weights on this corpus (--init-from)")

    def _check_verified(self, step: int, wait: bool) -> None:
        """Raises :class:`DamagedData` once the background check of the prepared folder's shards (on the main
        process) has failed, on every process alike (a collective while the check runs); ``wait``: let it finish
        first (before the final model)."""
        if not self._verifying:
            return
        acc, verifier = self.accelerator, self._verifier
        if verifier is not None and wait:
            verifier.wait()
        state = torch.tensor([float(verifier is not None and verifier.done), float(
            verifier is not None and verifier.error is not None)], device=acc.device)
        if acc.num_processes > 1:
            state = acc.reduce(state, reduction="sum")
        if state[1] > 0:
            why = verifier.error if verifier is not None else "the main process found a damaged shard"
            raise DamagedData(f"{why}; training stopped after step {step}, before anything of that step was saved "
                              f"(the checkpoints before it were trained on that folder too; data.skip_verify skips "
                              "this check)")
        if state[0] > 0:
            self._verifying = False
            logger.info("the shards of %s match their recorded SHA-256", self.config.data.source)

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

    def close(self) -> None:
        """Releases the run folder's lock (main process). Call it once done with the run folder."""
        self.folder.release()

    # -------------------------------------------------------------------------------------------------- loop
    def train(self) -> TrainResult:
        try:
            return self._train()
        except BaseException:
            self.data.close()
            self.folder.abandon()
            raise

    def _train(self) -> TrainResult:
        from tqdm.auto import tqdm

        acc, t = self.accelerator, self.config.train
        self.folder.start_log(self.start_step, self.training_args())
        acc.wait_for_everyone()
        if self.start_step == 0:
            self._log({"step": 0, "event": "start", "world_size": acc.num_processes,
                       "first_batch_fingerprints": self._fingerprints(), "flops_per_token": self.flops_per_token,
                       "peak_flops_per_process": self.peak_flops})
            self.evaluate(0)
        self._bar = tqdm(total=t.max_steps, initial=self.start_step, disable=not acc.is_main_process, desc="train",
                         dynamic_ncols=True)
        self._window: list[float] = []
        self._window_start = time.perf_counter()
        self._window_steps, self._data_wait = 0, 0.0
        step = self.start_step
        try:
            while step < t.max_steps:
                raise_if_interrupted()  # a Ctrl-C that a finalizer swallowed stops the run here
                result = self.train_step(step)
                step += 1
                self._check_verified(step, wait=step == t.max_steps)  # before anything of this step is written
                self._bar.update(1)
                if step % t.log_every == 0 or step == t.max_steps:
                    self.log_step(step, result)
                if step % t.eval_every == 0 or step == t.max_steps:
                    self.evaluate(step)
                # not during a run of bad steps: the last checkpoint before the trouble is the one to go back to
                if step % t.save_every == 0 and step < t.max_steps and not self.counters.bad_steps_in_a_row:
                    self.save_checkpoint(step)
        finally:
            self._bar.close()
        return self.finish(step)

    def train_step(self, step: int) -> StepResult:
        """Optimizer step ``step`` (0-based): the learning rate set, forward and backward of every micro-batch, the
        gradient clipped, and the update applied when the loss and the norm are finite (skipped, and counted,
        when not: :class:`TrainingDiverged` after ``train.max_bad_steps`` in a row). The loss guard sees the loss,
        and the run's state (step, tokens, counters) advances."""
        t = self.config.train
        lr = set_learning_rate(self.optimizer, self.config.optim, step, t.max_steps)
        loss, grad_norm = self._forward_backward(step)
        step += 1
        healthy_before = self.guard.healthy_since_good
        problem = self.guard.observe(step, loss)
        if problem is not None and healthy_before and math.isfinite(loss):
            warnings.warn(f"step {step}: {problem}; checkpoints from here on are not marked good (the last good "
                          f"one: {self.folder.latest_good_checkpoint() or 'none'})", RuntimeWarning, stacklevel=1)
        updated = math.isfinite(loss) and math.isfinite(grad_norm)
        if updated:
            self.optimizer.step()
            self.counters.bad_steps_in_a_row = 0
            self._window.append(loss)
        else:
            self.counters.bad_steps_in_a_row += 1
            self.counters.skipped_steps += 1
            warnings.warn(f"step {step}: non-finite loss ({loss}) or gradient norm ({grad_norm}); "
                          "skipping the update", RuntimeWarning, stacklevel=1)
            if self.counters.bad_steps_in_a_row >= t.max_bad_steps:
                raise TrainingDiverged(
                    f"{self.counters.bad_steps_in_a_row} non-finite steps in a row (train.max_bad_steps="
                    f"{t.max_bad_steps}), the last at step {step}; stopped. {self._last_good_advice()}")
        self.optimizer.zero_grad(set_to_none=True)
        self.counters.step = step
        self.counters.tokens += self.tokens_per_step
        self._window_steps += 1
        return StepResult(loss, grad_norm, lr, updated)

    def _forward_backward(self, step: int) -> tuple[float, float]:
        """Forward and backward of every micro-batch of ``step``; returns (the step's loss, gradient norm before
        clipping).

        The loss is one mean over every scored token of the step, on every process and micro-batch, as
        transformers' Trainer takes it (``num_items_in_batch``): each micro-batch's loss is its sum over the step's
        count, so a micro-batch with more document ends, hence fewer scored tokens, does not weigh as much as the
        others, and the step is the same loss whatever its split into processes and micro-batches."""
        acc = self.accelerator
        self.model.train()
        waiting = time.perf_counter()
        batches = [self.data.train.batch(step, micro) for micro in range(self.accum)]
        self._data_wait += time.perf_counter() - waiting
        counted = torch.tensor(float(sum(_counted_labels(batch) for batch in batches)), device=acc.device)
        counted = acc.reduce(counted, reduction="sum")  # the step's scored tokens, over every process
        total = torch.zeros((), device=acc.device)
        for micro, batch in enumerate(batches):
            batch = {k: v.to(acc.device, non_blocking=True) for k, v in batch.items()}
            sync = micro == len(batches) - 1
            # prepare() already runs the forward under autocast when mixed precision is on
            with acc.no_sync(self.model) if not sync else contextlib.nullcontext():
                loss = self.model(**batch, num_items_in_batch=counted).loss
                # DDP and FSDP average the processes' gradients, where the step's loss is their sum
                acc.backward(loss * acc.num_processes)
            total += loss.detach().float()
        grad_norm = acc.clip_grad_norm_(self.model.parameters(), clip_norm(self.config.optim))
        return float(acc.reduce(total, reduction="sum")), float(grad_norm)

    def log_step(self, step: int, result: StepResult) -> None:
        """The training record of ``step``: the mean loss of the steps updated since the last record, the
        throughput over them (tokens and FLOPs per second of all processes, :mod:`rotarium.training.flops`, and on
        a GPU of known peak the model FLOPs utilisation ``mfu``), and ``data_wait_seconds``, the mean time a step of
        them waited for its batches (this process's; a run bound by reading its data shows it here)."""
        elapsed = time.perf_counter() - self._window_start
        window = self._window
        # every step of the window read its tokens, a skipped one (non-finite loss) too, and took its time
        tokens_per_second = self.tokens_per_step * max(1, self._window_steps) / max(elapsed, 1e-9)
        record = {"step": step, "loss": sum(window) / len(window) if window else float("nan"), "lr": result.lr,
                  "grad_norm": result.grad_norm, "tokens": self.counters.tokens,
                  "tokens_per_second": tokens_per_second,
                  "flops_per_second": self.flops_per_token * tokens_per_second,
                  "data_wait_seconds": self._data_wait / max(1, self._window_steps)}
        throughput = {"flops": _flops(record["flops_per_second"])}
        if self.peak_flops is not None:
            record["mfu"] = record["flops_per_second"] / (self.peak_flops * self.accelerator.num_processes)
            throughput = {"mfu": f"{record['mfu']:.1%}"}
        self._bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{result.lr:.2e}",
                              tok_s=f"{record['tokens_per_second']:.0f}", **throughput,
                              data_wait=f"{record['data_wait_seconds'] * 1e3:.1f}ms")
        self._log(record)
        self._window, self._window_start = [], time.perf_counter()
        self._window_steps, self._data_wait = 0, 0.0

    @torch.no_grad()
    def evaluate(self, step: int) -> None:
        """The validation loss (over every process's validation batches) and perplexity, logged at ``step``."""
        acc = self.accelerator
        self.model.eval()
        total = torch.zeros(2, device=acc.device, dtype=torch.float64)
        for batch in self.data.validation:
            batch = {k: v.to(acc.device) for k, v in batch.items()}
            loss = self.model(**batch, return_logits=False).loss  # the loss alone: no [tokens, vocab] logits
            counted = _counted_labels(batch)
            total += torch.stack([loss.double() * counted, torch.tensor(counted, device=acc.device)]).double()
        total = acc.reduce(total, reduction="sum")
        if total[1] > 0:
            val = float(total[0] / total[1])
            self._log({"step": step, "val_loss": val, "val_perplexity": math.exp(min(val, 50.0))})

    def finish(self, step: int) -> TrainResult:
        """After the last step: the final model, the loss curve, and accelerate's teardown."""
        acc = self.accelerator
        self.data.close()
        final = self.save_final()
        if not self.guard.healthy_since_good:
            warnings.warn(f"the loss went bad since the last good checkpoint ({self.guard.describe_trouble()}); "
                          f"{final} holds the weights after that. {self._last_good_advice()}", RuntimeWarning,
                          stacklevel=1)
        self.folder.write_loss_curve()
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            # DDP's reducer must not hold the process group's last reference: its dealloc keeps the GIL while gloo's
            # destructor joins worker threads that may need the GIL to free a tensor, a deadlock at exit
            # (pytorch/pytorch#56297). Released while the group is still registered, the group is destroyed by
            # end_training instead, on a path that releases the GIL.
            self.model = self.model.module
            acc.free_memory()
        acc.end_training()
        vals = [r["val_loss"] for r in read_jsonl(self.folder.metrics) if "val_loss" in r]
        return TrainResult(self.run_dir, final, step, vals[0] if vals else None, vals[-1] if vals else None,
                           self.counters.skipped_steps)

    def _last_good_advice(self) -> str:
        last = self.folder.latest_good_checkpoint()
        if last is None:
            return ("No good checkpoint was saved (the loss went bad before one); lower optim.lr or raise "
                    "optim.warmup_steps and start again with --overwrite.")
        return (f"The last good checkpoint is {last}, which --resume picks; lower optim.lr or raise "
                "optim.warmup_steps and resume from it (e.g. --resume --allow-config-change optim.lr --optim.lr "
                "<lower>).")

    def _fingerprints(self) -> list[int] | None:
        """Every process's first training batch as a number, to check (and show) that processes see different
        data. Read from the schedule, past the loader, which hands out each batch once. (Not for a stream: reading
        a batch ahead would consume it.)"""
        schedule = self.data.schedule
        if schedule is None:
            return None
        tokens = schedule.batch(self.start_step, 0)["input_ids"].to(self.accelerator.device)
        weights = torch.arange(1, tokens.numel() + 1, device=tokens.device) % 9973
        mine = (tokens.flatten() * weights).sum().reshape(1)
        return [int(x) for x in self.accelerator.gather(mine).tolist()]

    def _log(self, record: dict[str, Any]) -> None:
        self.folder.log(record)
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
        source = self.config.data.source
        if self.data.prepared is not None:  # the prepare's source: a Hub dataset as given, a local one as a path
            source = self.data.prepared.metadata["settings"].get("source") or "embedded"
        if source != "embedded" and not Path(source).exists() and not Path(source).is_absolute():
            args["dataset"] = source
        args[RECORD_KEY] = self._held_out_record
        return args

    @functools.cached_property
    def _held_out_record(self) -> dict[str, Any]:
        """What identifies the run's held-out documents (:mod:`rotarium.data.heldout`): computed once, since every
        checkpoint's ``training_args.json`` carries it and the documents do not change within a run."""
        record = self.data.train.describe()
        if self._changed_at:
            record["changed_at_steps"] = self._changed_at
        return record

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
        """Checkpoint ``step``: the accelerate state (weights, optimizer, RNG), the model and tokenizer, and the
        trainer state's parts (:mod:`rotarium.training.state`) with the guard's verdict, published by the run folder
        (:meth:`RunFolder.publish`)."""
        return self._write_folder(self.folder.checkpoint(step), step=step)

    def save_final(self) -> Path:
        return self._write_folder(self.folder.final)

    def _write_folder(self, target: Path, step: int | None = None) -> Path:
        acc = self.accelerator
        staged = self.folder.stage(target)
        acc.wait_for_everyone()
        try:
            if step is not None:
                acc.save_state(str(staged / ACCELERATE_STATE))
            self._save_model(staged)
            acc.wait_for_everyone()
            state = None
            if step is not None:
                # on every process (the data position is gathered, and the guards must agree); the verdict before
                # the state is taken, as it resets the guard's counters
                verdict = self.guard.checkpoint_verdict()
                state = {**self.checkpoint_state.state_dict(), **verdict}
            self.folder.publish(staged, target, step=step, state=state, keep=self.config.train.keep_checkpoints)
        except (OSError, RuntimeError) as error:
            if not _disk_full(error):
                raise
            self.folder.discard(staged)  # frees what it took; the folders published before it are untouched
            why = " ".join(str(error).split())
            raise OSError(errno.ENOSPC, f"no space left on the device to write {target} ({why}); the checkpoints "
                          "before it are whole: free space and resume with --resume") from error
        acc.wait_for_everyone()
        return target


def _disk_full(error: BaseException) -> bool:
    """Whether ``error`` says the disk is full: an ``OSError`` ENOSPC or EDQUOT, or torch's writer failing (its
    ``RuntimeError`` carries no errno, only the message of the failed write)."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    message = str(error)
    return "No space left" in message or "file write failed" in message


def _flops(value: float) -> str:
    """FLOP/s as the progress bar shows them: ``312.4T``, ``1.25G``."""
    return f"{value / 1e12:.1f}T" if value >= 1e12 else f"{value / 1e9:.2f}G"


def _gathered(accelerator: Any, items: list[Any]) -> list[Any]:
    """Every process's ``items``, in process order (a collective: every process calls it)."""
    if accelerator.num_processes == 1:
        return items
    from accelerate.utils import gather_object

    return gather_object(items)


def _counted_labels(batch: dict[str, torch.Tensor]) -> int:
    """How many predictions the model's loss averages over: every position but each document's last token."""
    cu = batch.get("cu_seqlens")
    if cu is None:
        return int(batch["labels"][:, 1:].ne(-100).sum())
    return int(batch["labels"].numel() - (cu.numel() - 1))
