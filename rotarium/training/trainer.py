"""The training loop: one code path from a 2-core laptop to a multi-GPU FSDP run, with accelerate handling devices.

A run folder holds::

    tokenizer/                      the tokenizer (trained once, reused on resume)
    checkpoints/step-<N>/           state/ (accelerate: weights, optimizer, RNG), a save_pretrained model and
                                    tokenizer, trainer_state.json, and COMPLETE, written last
    final/                          the final model and tokenizer (+ eval/ after `rotarium eval`)
    metrics.jsonl                   one JSON object per logged step / evaluation
    training_args.json, loss_curve.png

Checkpoints are written to a hidden temporary folder and renamed into place, and only folders with ``COMPLETE`` are
resumed from, so a run killed while saving never leaves a checkpoint that ``--resume`` would pick up broken. The
learning rate is a pure function of the step and the batches a pure function of ``(seed, step)``, so a resumed run
repeats the uninterrupted one exactly.
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
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from rotarium.training.config import Config
from rotarium.training.data import (
    BatchSchedule,
    PackedSequences,
    StreamingSchedule,
    iter_documents,
    pack,
    pack_all,
    split_documents,
    tokenize,
    validation_batches,
)

logger = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
NO_DECAY_TYPES = (torch.nn.Embedding, torch.nn.LayerNorm, torch.nn.RMSNorm)


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row."""


# ----------------------------------------------------------------------------------------------------------- paths
def checkpoint_step(path: Path) -> int | None:
    name = path.name
    if not name.startswith("step-") or not name[5:].isdigit():
        return None
    return int(name[5:])


def complete_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if checkpoint_step(p) is not None and (p / COMPLETE).is_file()]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


# ---------------------------------------------------------------------------------------------------- schedule
def lr_multiplier(step: int, config: Config) -> float:
    """Warmup (linear from 0), then cosine to ``min_lr_ratio`` / warmup-stable-decay / constant. ``step`` counts
    optimizer steps from 0."""
    o, total = config.optim, config.train.max_steps
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return 1.0
    if o.schedule == "wsd":
        decay_start = total - max(1, round(o.decay_fraction * total))
        if step < decay_start:
            return 1.0
        progress = (step - decay_start + 1) / max(1, total - decay_start)
        return 1.0 - (1.0 - o.min_lr_ratio) * min(1.0, progress)
    progress = min(1.0, (step - o.warmup_steps + 1) / max(1, total - o.warmup_steps))
    return o.min_lr_ratio + (1.0 - o.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on the matrices of linear and convolution layers only: off for norms, biases and embeddings
    (the output projection too when it is tied to the input embedding)."""
    no_decay: set[int] = set()
    for module in model.modules():
        if isinstance(module, NO_DECAY_TYPES) or "norm" in type(module).__name__.lower():
            no_decay.update(id(p) for p in module.parameters(recurse=False))
    decay, rest, seen = [], [], set()
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (rest if id(param) in no_decay or param.ndim < 2 or name.endswith("bias") else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


# ------------------------------------------------------------------------------------------------- model, data
def build_model(config: Config, tokenizer) -> torch.nn.Module:
    """A fresh model from ``config.model`` (preset or explicit sizes), or the ``init_from`` checkpoint."""
    from transformers import AutoModelForCausalLM

    import rotarium  # noqa: F401  (registers the Auto classes)
    from rotarium.configs.presets import PRESETS, preset_config
    from rotarium.models.configuration import CONFIGS
    from rotarium.models.modeling import FAMILY_MODELS

    m = config.model
    if m.init_from is not None:
        try:
            model = AutoModelForCausalLM.from_pretrained(m.init_from)
        except (OSError, ValueError) as error:
            raise ValueError(f"`--init-from {m.init_from}` could not be loaded: {error}") from error
        if len(tokenizer) > model.config.vocab_size:
            raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but `--init-from {m.init_from}` has a "
                             f"vocabulary of {model.config.vocab_size}; use the checkpoint's own tokenizer")
        return model
    special = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
               "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "max_position_embeddings": config.data.seq_len, "position_encoding": m.position_encoding}
    if m.preset is not None:
        family = PRESETS[m.preset][0]
        model_config = preset_config(m.preset, **special, **m.options)
    else:
        family = m.family
        sizes = {"hidden_size": m.hidden_size, "num_hidden_layers": m.num_hidden_layers, "num_heads": m.num_heads}
        if m.intermediate_size is not None:
            sizes["intermediate_size"] = m.intermediate_size
        try:
            model_config = CONFIGS[family](**sizes, **special, **m.options)
        except TypeError as error:
            raise ValueError(f"`model.options`: {error}") from error
    return FAMILY_MODELS[family].lm(model_config)


def prepare_tokenizer(config: Config, run_dir: Path, documents: list[str] | None, accelerator):
    """The run's tokenizer: the one saved in the run folder (resume), else ``tokenizer.name``, else the
    ``init_from`` checkpoint's, else a BPE trained on the training documents by the main process."""
    from rotarium.training.tokenizer import load_tokenizer, train_bpe

    saved = run_dir / "tokenizer"
    # Only the main process looks and writes; the others wait at the barrier whatever it finds.
    if accelerator.is_main_process and not (saved / "tokenizer_config.json").is_file():
        name = config.tokenizer.name
        if name is None and config.model.init_from is not None:
            name = config.model.init_from
        if name is not None:
            tokenizer = load_tokenizer(name)
        else:
            if documents is None:
                documents = list(islice(iter_documents(config.data, skip=config.data.validation_documents),
                                        config.tokenizer.train_documents))
            tokenizer = train_bpe(documents[:config.tokenizer.train_documents], config.tokenizer.vocab_size)
        _atomic_save(lambda tmp: tokenizer.save_pretrained(tmp), saved)
    accelerator.wait_for_everyone()
    return load_tokenizer(str(saved))


@dataclass
class RunData:
    train: BatchSchedule | StreamingSchedule
    validation: list[dict[str, torch.Tensor]]
    validation_documents: list[str]


def accumulation_steps(config: Config, world: int) -> int:
    """Micro-steps per optimizer step: ``train.global_batch_size / (batch_size * processes)`` when the global batch
    is given (recipes, so one file serves any number of GPUs), else ``train.gradient_accumulation_steps``."""
    t = config.train
    if t.global_batch_size is None:
        return t.gradient_accumulation_steps
    per_step = t.batch_size * world
    if t.global_batch_size % per_step:
        raise ValueError(f"`train.global_batch_size={t.global_batch_size}` is not a multiple of train.batch_size x "
                         f"processes = {t.batch_size} x {world}; change one of them")
    return t.global_batch_size // per_step


def prepare_data(config: Config, tokenizer, world: int, rank: int, start_step: int,
                 documents: list[str] | None) -> RunData:
    d, t = config.data, config.train
    accum = accumulation_steps(config, world)
    max_val_rows = max(1, d.max_validation_tokens // d.seq_len)
    if d.streaming:
        held_out = list(islice(iter_documents(d), d.validation_documents))
        val = pack_all(tokenizer, held_out, d.seq_len, "validation")

        def training_stream(epoch: int):
            documents = iter_documents(d, skip=d.validation_documents, shuffle_seed=t.seed + epoch)
            return pack(tokenize(tokenizer, documents), d.seq_len, tokenizer.eos_token_id)

        train: BatchSchedule | StreamingSchedule = StreamingSchedule(training_stream, t.batch_size, accum, world,
                                                                     rank, start_step)
    else:
        documents = documents if documents is not None else list(iter_documents(d))
        train_docs, held_out = split_documents(documents, d.validation_fraction, t.seed)
        val = pack_all(tokenizer, held_out, d.seq_len, "validation")
        train = BatchSchedule(pack_all(tokenizer, train_docs, d.seq_len, "training"), t.batch_size, accum, world,
                              rank, t.seed)
    val = PackedSequences(val.tokens[:max_val_rows], val.starts[:max_val_rows])
    return RunData(train, validation_batches(val, t.batch_size, t.eval_batches, world, rank), held_out)


def _atomic_save(write, target: Path) -> None:
    """``write(tmp_folder)`` then rename to ``target`` (replacing it), so ``target`` is never half written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write(tmp)
    old = target.parent / f".{target.name}.old"
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


# ----------------------------------------------------------------------------------------------------- trainer
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
            self.state = json.loads((self.resume_from / TRAINER_STATE).read_text())
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
        o = config.optim
        optimizer = torch.optim.AdamW(parameter_groups(model, o.weight_decay), lr=o.lr, betas=tuple(o.betas),
                                      eps=o.eps)
        self.model, self.optimizer = acc.prepare(model, optimizer)
        if self.resume_from is not None:
            acc.load_state(str(self.resume_from / "state"))
        if t.report_to:
            acc.init_trackers("rotarium", config=_flat(config.to_dict()))

    # ------------------------------------------------------------------------------------------------ set-up
    def _check_run_dir(self, resume: bool, overwrite: bool) -> None:
        has_run = (self.run_dir / "checkpoints").exists() or (self.run_dir / "final").exists()
        if not has_run or resume or not self.accelerator.is_main_process:
            return  # the main process decides (and deletes); the others would race with its deletion
        if not overwrite:
            raise ValueError(f"--output-dir {self.run_dir} already holds a run; pass --resume to continue it, "
                             "--overwrite to start over, or choose another --output-dir")
        for name in ("checkpoints", "final", "tokenizer", "metrics.jsonl", "training_args.json", "loss_curve.png"):
            path = self.run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)

    # -------------------------------------------------------------------------------------------------- loop
    def train(self) -> TrainResult:
        from tqdm.auto import tqdm

        acc, t, cfg = self.accelerator, self.config.train, self.config
        metrics_path = self.run_dir / "metrics.jsonl"
        if acc.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            _truncate_metrics(metrics_path, self.start_step)
            _write_json(self.run_dir / "training_args.json", self.training_args())
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
            lr = cfg.optim.lr * lr_multiplier(step, cfg)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
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
            plot_loss_curve(metrics_path, self.run_dir / "loss_curve.png")
            (final / "eval").mkdir(exist_ok=True)
            shutil.copy(self.run_dir / "loss_curve.png", final / "eval" / "loss_curve.png")
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            # DDP's reducer must not hold the process group's last reference: its dealloc keeps the GIL while gloo's
            # destructor joins worker threads that may need the GIL to free a tensor, a deadlock that hung a CI run
            # at exit (pytorch/pytorch#56297). Released while the group is still registered, the group is destroyed
            # by end_training instead, on a path that releases the GIL.
            self.model = self.model.module
            acc.free_memory()
        acc.end_training()
        vals = [r["val_loss"] for r in read_metrics(metrics_path) if "val_loss" in r]
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
        clip = self.config.optim.grad_clip
        grad_norm = acc.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
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
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self.config.train.report_to and scalars:
            self.accelerator.log(scalars, step=record["step"])

    # -------------------------------------------------------------------------------------------- saving
    def training_args(self) -> dict[str, Any]:
        args = _flat(self.config.to_dict())
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
            _write_json(folder / "training_args.json", self.training_args())

    def save_checkpoint(self, step: int) -> Path:
        return self._write_folder(self.run_dir / "checkpoints" / f"step-{step}", step=step)

    def save_final(self) -> Path:
        return self._write_folder(self.run_dir / "final")

    def _write_folder(self, target: Path, step: int | None = None) -> Path:
        """The model and tokenizer (plus, for a checkpoint of ``step``, the accelerate state, the trainer state and
        ``COMPLETE``, written last) into ``.<name>.tmp``, then renamed to ``target`` by the main process."""
        acc = self.accelerator
        tmp = target.parent / f".{target.name}.tmp"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        if step is not None:
            acc.save_state(str(tmp / "state"))
        self._save_model(tmp)
        acc.wait_for_everyone()
        if acc.is_main_process:
            if step is not None:
                _write_json(tmp / TRAINER_STATE, self.state)
                with open(tmp / COMPLETE, "w") as f:
                    f.write(f"{step}\n")
                    f.flush()
                    os.fsync(f.fileno())
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
            if step is not None:
                for old in complete_checkpoints(self.run_dir)[:-self.config.train.keep_checkpoints]:
                    shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()
        return target


def _counted_labels(batch: dict[str, torch.Tensor]) -> int:
    """How many predictions the model's loss averages over: every position but each document's last token."""
    cu = batch.get("cu_seqlens")
    if cu is None:
        return int(batch["labels"][:, 1:].ne(-100).sum())
    return int(batch["labels"].numel() - (cu.numel() - 1))


def _flat(data: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "options":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if not isinstance(value, (list, dict)) else json.dumps(value)
    return out


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill
    return records


def _truncate_metrics(path: Path, start_step: int) -> None:
    """On resume, drop what the killed run logged after its checkpoint, so the file reads as one run."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if 0 < r.get("step", 0) <= start_step or (start_step and not r["step"])]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)


def plot_loss_curve(metrics_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r and math.isfinite(r["loss"])]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), marker="o", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(f"{metrics_path.parent.name}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
