"""Every preset x positional option at full size on CPU: one training step each, the memory a run needs, and the
numerics at depth. Every row runs in a process of its own, so its peak RSS is its own and a crash or an
out-of-memory kill becomes a row with the reason, not the end of the table.

1. Steps (``--parts steps``): the model is built on the meta device first (parameter count, the memory the step
   needs), then with real weights, and takes one forward + backward + AdamW step at batch 1 x 512 tokens with
   gradient checkpointing on. Printed per row: the loss (finite, and near its value at init, ln(vocab) + s^2/2 with
   s the logits' standard deviation), seconds, peak RSS. A row runs the first that fits the memory available: a
   float32 step; a bfloat16 step (only on CPUs with native bf16 matrix units, where it is not many times slower);
   float32 forward + backward without the optimizer; float32 forward only. The row says which, and why.
2. Memory (``--parts memory``): parameters, gradients and AdamW state in bytes, and the activations autograd keeps
   per token with and without gradient checkpointing, counted with saved-tensor hooks (see
   ``saved_activation_bytes``). The 370M presets are measured at full depth; every preset is also measured with 1
   and 2 blocks, and its full depth extrapolated (exact when blocks are identical: the 370M rows print the check).
   The GPU columns are an extrapolation: the float32 bytes per token at 2048 tokens, halved for bf16, times a
   batch of 8 x 2048 tokens.
3. Numerics at depth (``--parts numerics``, or ``--numerics`` beside the others; 370M presets): built as
   ``rotarium train`` builds a run on the embedded corpus (``rotarium.training.build``), the initial loss and every
   block's gradient norm are finite, and 20 AdamW steps at the recipe's learning rate lower the loss on held-out
   batches.

``--tiny`` runs the same code on presets shrunk 16x in width to 3 blocks, in seconds.

    python benchmarks/presets.py --numerics --output docs/benchmarks/presets.md     # everything
    python benchmarks/presets.py --presets gla-370m --options nope --parts steps    # one row
    python benchmarks/presets.py --tiny --numerics                                  # every code path, quickly
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("steps", "memory", "numerics")
GB = 1e9
# The two columns of every activation figure.
MODES = ("no_checkpointing", "checkpointing")
# Parameter-sized tensors each mode holds: weights, gradients, AdamW's two moments.
COPIES = {"step": 4, "backward": 2, "forward": 1}
# Beyond those: the interpreter and libraries, the checkpointed activations of 512 tokens and one block's
# recomputation, the logits, the transient buffers of the backward.
MARGIN = 2.5e9
# A training batch per GPU of the extrapolated columns: sequences x tokens.
GPU_BATCH = 8
# Bytes a parameter takes on a GPU in training: float32 weights (the master copy under bf16 autocast and FSDP's
# mixed precision), float32 gradients, AdamW's two float32 moments.
STATE_BYTES = {"weights": 4, "gradients": 4, "AdamW moments": 8}
GPU_STATE_BYTES = sum(STATE_BYTES.values())


@dataclass(frozen=True)
class Scale:
    """How far the presets are shrunk: ``full`` is the presets themselves, ``tiny`` the same code in seconds."""
    name: str
    width_divisor: int
    layers: int | None  # None: the preset's depth
    seq_len: int  # tokens of a step and of the CPU memory columns
    gpu_seq_len: int  # tokens of a sequence in the GPU extrapolation
    numerics_steps: int
    numerics_seq_len: int
    numerics_batch: int
    numerics_vocab: int | None  # None: the recipe's BPE size (rotarium train's default)


FULL = Scale("full", 1, None, 512, 2048, 20, 128, 4, None)
TINY = Scale("tiny", 16, 3, 64, 128, 3, 32, 2, 512)


def scale_overrides(preset: str, scale: Scale) -> dict:
    """The config fields ``scale`` changes in ``preset`` (none at full size)."""
    from rotarium.configs.presets import PRESETS

    overrides = {}
    if scale.width_divisor > 1:
        overrides["hidden_size"] = PRESETS[preset][1]["hidden_size"] // scale.width_divisor
    if scale.layers is not None:
        overrides["num_hidden_layers"] = scale.layers
    return overrides


def row_config(preset: str, option: str, scale: Scale, **fields):
    from rotarium.configs.presets import preset_config

    return preset_config(preset, position_encoding=option, **{**scale_overrides(preset, scale), **fields})


def build_model(config, dtype=None):
    """A model with real weights, built straight in ``dtype`` (no float32 copy of a bfloat16 model ever exists)."""
    import torch

    from rotarium.models import FAMILY_MODELS

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.float32)
    try:
        torch.manual_seed(0)
        return FAMILY_MODELS[config.family].lm(config)
    finally:
        torch.set_default_dtype(previous)


def expected_initial_loss(config) -> float:
    """The cross-entropy of random tokens at init: ln(vocab) + s^2/2, where s = initializer_range * sqrt(hidden) is
    the standard deviation of the logits (the final RMSNorm hands the untied head unit-RMS features) and s^2/2 the
    log-sum-exp of Gaussian logits above ln(vocab)."""
    s = config.initializer_range * math.sqrt(config.hidden_size)
    return math.log(config.vocab_size) + s * s / 2


def loss_verdict(loss: float, expected: float) -> str | None:
    """Why ``loss`` is not what an initialised model gives, or None when it is."""
    if not math.isfinite(loss):
        return f"loss {loss} is not finite"
    if abs(loss - expected) > 0.05 * expected:
        return f"initial loss {loss:.3f} is more than 5% from {expected:.3f} (ln(vocab) + s^2/2)"
    return None


def memory_available() -> int:
    """Bytes the kernel can give without swapping (``MemAvailable``)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX); without it PyTorch converts and
    a bf16 step takes many times as long as a float32 one."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def plan_step(n_params: int, available: int, bf16_native: bool, dtype: str = "auto", mode: str = "auto"
              ) -> tuple[str, str, str]:
    """(mode, dtype, why): the first of a float32 step, a bfloat16 step (on native bf16 only), float32
    forward+backward and float32 forward that fits in ``available`` bytes, else mode "none". ``dtype`` and ``mode``
    other than "auto" narrow the choice to them."""
    candidates = [("step", "float32"), ("step", "bfloat16"), ("backward", "float32"), ("forward", "float32")]
    if dtype != "auto":
        candidates = [(m, dtype) for m in COPIES]
    elif not bf16_native:
        candidates.remove(("step", "bfloat16"))
    candidates = [(m, d) for m, d in candidates if mode in ("auto", m)]
    too_big = []
    for m, d in candidates:
        need = n_params * COPIES[m] * (4 if d == "float32" else 2) + MARGIN
        if need <= available:
            why = "fits" if not too_big else f"{'; '.join(too_big)}, {available / GB:.1f} GB available"
            if (dtype, mode) != ("auto", "auto"):
                why = f"chosen by --dtype {dtype} --mode {mode}; {why}"
            elif m != "step" and not bf16_native:
                why += ("; no bfloat16 step: this CPU has no native bf16 matrix units (AVX512-BF16, AMX), where "
                        "bf16 matrix products run many times slower than float32 (--dtype bfloat16 forces it)")
            return m, d, why
        too_big.append(f"{m} in {d} needs {need / GB:.1f} GB")
    return "none", candidates[-1][1], f"{'; '.join(too_big)}, {available / GB:.1f} GB available"


# ---------------------------------------------------------------------------------------------------------------
# The rows, each run in a child process


def step_row(preset: str, option: str, scale: Scale, dtype: str, mode: str) -> dict:
    import torch

    from rotarium.configs.param_table import parameter_count
    from rotarium.models import set_activation_checkpointing
    from rotarium.training.config import OptimSection
    from rotarium.training.optim import build_optimizer

    config = row_config(preset, option, scale)
    n_params = parameter_count(preset, position_encoding=option, **scale_overrides(preset, scale))  # meta device
    available = memory_available()
    mode, dtype, why = plan_step(n_params, available, native_bf16(), dtype, mode)
    result = {"params": n_params, "mode": mode, "dtype": dtype, "plan": why, "tokens": scale.seq_len,
              "available_gb": available / GB}
    if mode == "none":
        return {**result, "status": "not run", "reason": why}
    start = time.perf_counter()
    model = build_model(config, getattr(torch, dtype))
    set_activation_checkpointing(model)
    model.train()
    result["build_s"] = time.perf_counter() - start
    ids = torch.randint(0, config.vocab_size, (1, scale.seq_len), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    with torch.set_grad_enabled(mode != "forward"):
        loss = model(input_ids=ids, labels=ids).loss
    result["loss"], result["forward_s"] = loss.item(), time.perf_counter() - start
    result["expected_loss"] = expected_initial_loss(config)
    problems = [loss_verdict(result["loss"], result["expected_loss"])]
    if mode != "forward":
        start = time.perf_counter()
        loss.backward()
        result["backward_s"] = time.perf_counter() - start
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        missing = sum(g is None for g in grads)
        norm = math.sqrt(sum(float(g.float().square().sum()) for g in grads if g is not None))
        result["grad_norm"], result["params_without_grad"] = norm, missing
        problems += [None if math.isfinite(norm) else f"gradient norm {norm} is not finite",
                     f"{missing} parameters got no gradient" if missing else None]
    if mode == "step":
        optimizer = build_optimizer(model, OptimSection())
        start = time.perf_counter()
        optimizer.step()
        result["optimizer_s"] = time.perf_counter() - start
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        problems.append(None if finite else "a parameter is not finite after the step")
    result["step_s"] = sum(result.get(k, 0.0) for k in ("forward_s", "backward_s", "optimizer_s"))
    problems = [p for p in problems if p]
    return {**result, "status": "flagged" if problems else "ok", "reason": "; ".join(problems)}


def saved_activation_bytes(model, input_ids, checkpointing: bool) -> tuple[int, int]:
    """(bytes autograd keeps from the forward for the backward, the most of them that one block saves).

    Counted with ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves passes the pack hook. A
    storage counts once however many of its views are saved, and the parameters (saved by every linear layer) do
    not count. With checkpointing, each block's tensor inputs count too (the checkpoint keeps them to recompute the
    block; its own hooks hide what runs inside). Without it, the largest block's share is what one block holds
    while it is recomputed in a checkpointed backward."""
    import torch

    from rotarium.models import set_activation_checkpointing

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    blocks: list[dict[int, int]] = []
    inside = [False]

    def keep(tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
            if inside[0]:
                blocks[-1][storage.data_ptr()] = storage.nbytes()

    def pack(tensor):
        keep(tensor)
        return tensor

    def enter(module, args):
        blocks.append({})
        inside[0] = True
        if checkpointing:
            for arg in args:
                if isinstance(arg, torch.Tensor):
                    keep(arg)

    def leave(module, args, output):
        inside[0] = False

    layers = model.model.layers
    handles = [h for layer in layers for h in (layer.register_forward_pre_hook(enter),
                                               layer.register_forward_hook(leave))]
    set_activation_checkpointing(model, enabled=checkpointing)
    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        del loss
    finally:
        for handle in handles:
            handle.remove()
    return sum(saved.values()), max((sum(b.values()) for b in blocks), default=0)


def activation_bytes(model, tokens: int) -> dict[str, float]:
    """Saved bytes of one sequence of ``tokens``: without checkpointing; with it, kept between forward and backward,
    and at its peak (kept + one block being recomputed); and the largest block's share."""
    import torch

    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    plain, block = saved_activation_bytes(model, ids, checkpointing=False)
    kept, _ = saved_activation_bytes(model, ids, checkpointing=True)
    return {"no_checkpointing": plain, "checkpointing": kept + block, "checkpointing_kept": kept, "block": block}


def extrapolate(one: dict[str, float], two: dict[str, float], layers: int) -> dict[str, float]:
    """The full-depth values from measurements with 1 and 2 blocks: a block adds the same bytes wherever it sits,
    while what lies outside the blocks (embedding, head, loss) stays; a block's own share does not depend on depth."""
    out = {key: one[key] + (layers - 1) * (two[key] - one[key]) for key in one if key != "block"}
    out["block"] = two["block"]
    out["checkpointing"] = out["checkpointing_kept"] + out["block"]
    return out


def memory_row(preset: str, option: str, scale: Scale) -> dict:
    """Activations as ``fixed + per_token * tokens`` for each of :data:`MODES`, fitted through two lengths: some
    saved tensors do not grow with the sequence (the LM head's weight gradient, which the fused loss computes in
    the forward)."""
    from rotarium.configs.param_table import parameter_count

    config = row_config(preset, option, scale)
    n_params = parameter_count(preset, position_encoding=option, **scale_overrides(preset, scale))  # meta device
    shallow = {depth: build_model(row_config(preset, option, scale, num_hidden_layers=depth)) for depth in (1, 2)}
    layers, short, long = config.num_hidden_layers, scale.seq_len, scale.gpu_seq_len
    result = {"params": n_params, "layers": layers, "cpu_tokens": short, "gpu_tokens": long, "gpu_batch": GPU_BATCH}
    at = {tokens: extrapolate(*(activation_bytes(shallow[d], tokens) for d in (1, 2)), layers)
          for tokens in (short, long)}
    if preset.endswith("-370m"):
        result["cpu"] = activation_bytes(build_model(config), short)
        result["cpu_how"] = "measured"
        result["depth_check"] = {key: at[short][key] / value - 1 for key, value in result["cpu"].items() if value}
    else:
        result["cpu"] = at[short]
        result["cpu_how"] = "extrapolated from 1 and 2 blocks"
    per_token = {mode: (at[long][mode] - at[short][mode]) / (long - short) for mode in MODES}
    result["per_token"] = per_token
    result["fixed"] = {mode: at[short][mode] - per_token[mode] * short for mode in MODES}
    tokens = GPU_BATCH * long
    result["gpu_bf16"] = {mode: (result["fixed"][mode] + per_token[mode] * tokens) / 2 for mode in MODES}
    return {**result, "status": "ok", "reason": ""}


def numerics_row(preset: str, option: str, scale: Scale) -> dict:
    """The run ``rotarium train --config <recipe> --data.source embedded`` would build, shortened."""
    import torch

    from rotarium.data.documents import iter_documents
    from rotarium.data.tokenizer import train_bpe
    from rotarium.training.build import build_model as build_run_model
    from rotarium.training.build import loader_settings, open_data_source, prepare_data
    from rotarium.training.config import load_config, recipe_names
    from rotarium.training.optim import build_optimizer, clip_norm, set_learning_rate

    recipe = f"{preset}-{option.replace('_', '-')}"
    if recipe not in recipe_names():
        raise ValueError(f"no recipe {recipe!r} for preset {preset} with {option}")
    overrides = {"data.source": "embedded", "data.streaming": False, "data.seq_len": scale.numerics_seq_len,
                 "tokenizer.name": None, "train.batch_size": scale.numerics_batch, "train.global_batch_size": None,
                 "train.gradient_accumulation_steps": 1, "train.eval_batches": 2,
                 "train.max_steps": scale.numerics_steps, "optim.warmup_steps": 2, "optim.schedule": "constant",
                 "model.options": scale_overrides(preset, scale)}
    if scale.numerics_vocab is not None:
        overrides["tokenizer.vocab_size"] = scale.numerics_vocab
    config = load_config(recipe, overrides)
    documents = list(iter_documents(config.data))
    tokenizer = train_bpe(documents, config.tokenizer.vocab_size)
    data = prepare_data(config, tokenizer, open_data_source(config, 1), loader_settings(config, 1), documents)
    torch.manual_seed(config.train.seed)
    model = build_run_model(config, tokenizer)
    model.train()
    optimizer = build_optimizer(model, config.optim)

    def held_out() -> float:
        with torch.no_grad():
            return sum(model(**batch).loss.item() for batch in data.validation) / len(data.validation)

    result = {"params": sum(p.numel() for p in model.parameters()), "layers": model.config.num_hidden_layers,
              "vocab": model.config.vocab_size, "lr": config.optim.lr, "steps": scale.numerics_steps,
              "tokens_per_step": scale.numerics_batch * scale.numerics_seq_len}
    result["held_out_before"] = held_out()
    losses, problems = [], []
    start = time.perf_counter()
    for step in range(scale.numerics_steps):
        loss = model(**data.train.batch(step, 0)).loss
        loss.backward()
        if step == 0:
            result["expected_loss"] = expected_initial_loss(model.config)
            problems.append(loss_verdict(loss.item(), result["expected_loss"]))
            norms = [math.sqrt(sum(float(p.grad.square().sum()) for p in layer.parameters() if p.grad is not None))
                     for layer in model.model.layers]
            result["block_grad_norms"] = norms
            result["embedding_grad_norm"] = float(model.model.embed_tokens.weight.grad.norm())
            result["head_grad_norm"] = float(model.lm_head.weight.grad.norm())
            bad = [i for i, n in enumerate(norms) if not math.isfinite(n) or n == 0]
            problems.append(f"blocks {bad} have a zero or non-finite gradient norm" if bad else None)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm(config.optim))
        set_learning_rate(optimizer, config.optim, step, scale.numerics_steps)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    result["seconds"] = time.perf_counter() - start
    result["losses"] = losses
    result["held_out_after"] = held_out()
    if not all(math.isfinite(x) for x in losses):
        problems.append("a training loss is not finite")
    if not result["held_out_after"] < result["held_out_before"]:
        problems.append(f"the held-out loss did not fall ({result['held_out_before']:.3f} -> "
                        f"{result['held_out_after']:.3f})")
    problems = [p for p in problems if p]
    return {**result, "status": "flagged" if problems else "ok", "reason": "; ".join(problems)}


def chosen_scale(args) -> Scale:
    scale = TINY if args.tiny else FULL
    return scale if args.numerics_steps is None else replace(scale, numerics_steps=args.numerics_steps)


def child_main(args) -> None:
    scale = chosen_scale(args)
    if args.child == "steps":
        result = step_row(args.preset, args.option, scale, args.dtype, args.mode)
    elif args.child == "memory":
        result = memory_row(args.preset, args.option, scale)
    else:
        result = numerics_row(args.preset, args.option, scale)
    Path(args.result).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------------
# The parent: one child per row


@dataclass
class Row:
    part: str
    preset: str
    option: str

    @property
    def name(self) -> str:
        return f"{self.part} {self.preset} {self.option}"


@dataclass
class Finished:
    status: int  # exit status; minus the signal's number when a signal ended the process
    peak_rss: int  # bytes
    timed_out: bool
    log: str


def spawn(command: list[str], timeout: float, env: dict[str, str] | None = None) -> Finished:
    """Runs ``command`` to its end, killed after ``timeout`` seconds. Its peak RSS comes from ``wait4``, so it is
    there even when the process was killed."""
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            process.kill()

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            _, status, usage = os.wait4(process.pid, 0)
        finally:
            timer.cancel()
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        log.seek(0)
        # ru_maxrss is in KiB on Linux
        return Finished(process.returncode, usage.ru_maxrss * 1024, killed.is_set(), log.read())


def failure(finished: Finished, timeout: float) -> str:
    """Why a child gave no result, in one line."""
    if finished.timed_out:
        return f"timed out after {timeout:g} s"
    if finished.status < 0:
        name = signal.Signals(-finished.status).name
        hint = " (most likely the kernel's out-of-memory killer)" if -finished.status == signal.SIGKILL else ""
        return f"killed by {name}{hint} at a peak RSS of {finished.peak_rss / GB:.2f} GB"
    lines = [line.strip() for line in finished.log.splitlines() if line.strip()]
    return f"exit status {finished.status}: {lines[-1] if lines else 'no output'}"


def run_child(row: Row, args) -> dict:
    """Runs ``row`` in a fresh interpreter: its result, with the child's peak RSS and wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--child", row.part, "--preset", row.preset,
                   "--option", row.option, "--result", str(result_path), "--dtype", args.dtype, "--mode", args.mode]
        if args.tiny:
            command.append("--tiny")
        if args.numerics_steps is not None:
            command += ["--numerics-steps", str(args.numerics_steps)]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        start = time.perf_counter()
        finished = spawn(command, args.row_timeout, env)
        record = {"part": row.part, "preset": row.preset, "option": row.option, "wall_s": time.perf_counter() - start,
                  "peak_rss_gb": finished.peak_rss / GB}
        if finished.status == 0 and result_path.is_file():
            return {**record, **json.loads(result_path.read_text())}
        return {**record, "status": "failed", "reason": failure(finished, args.row_timeout)}


def seconds(record: dict, key: str) -> str:
    return f"{record[key]:.1f}" if key in record else "-"


def step_line(r: dict) -> str:
    if r["status"] in ("failed", "not run"):
        return f"{r['preset']:17} {r['option']:15} {r['status'].upper()}: {r['reason']}"
    loss = f"loss {r['loss']:.3f} (init {r['expected_loss']:.3f})"
    times = " ".join(f"{k} {seconds(r, k + '_s')} s" for k in ("forward", "backward", "optimizer"))
    verdict = "ok" if r["status"] == "ok" else f"FLAGGED: {r['reason']}"
    return (f"{r['preset']:17} {r['option']:15} {r['mode']:8} {r['dtype']:8} {loss}  {times}  peak RSS "
            f"{r['peak_rss_gb']:.2f} GB  {verdict}")


def memory_line(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['preset']:17} {r['option']:15} {r['status'].upper()}: {r['reason']}"
    check = ""
    if "depth_check" in r:
        check = f"  depth extrapolation off by {max(abs(v) for v in r['depth_check'].values()):.1%}"
    return (f"{r['preset']:17} {r['option']:15} {r['params'] / 1e6:8.1f}M  activations of {r['cpu_tokens']} tokens "
            f"{pair(r['cpu'], 1e6)} MB ({r['cpu_how']}), per token {pair(r['per_token'], 1e3)} kB "
            f"+ {pair(r['fixed'], 1e6)} MB; GPU {GPU_BATCH}x{r['gpu_tokens']} bf16 {pair(r['gpu_bf16'], GB)} GB "
            f"(no ckpt / ckpt){check}")


def pair(values: dict[str, float], unit: float) -> str:
    """"without checkpointing / with it" in ``unit``."""
    return " / ".join(f"{values[mode] / unit:,.1f}" for mode in MODES)


def numerics_line(r: dict) -> str:
    if r["status"] == "failed":
        return f"{r['preset']:17} {r['option']:15} FAILED: {r['reason']}"
    norms = r.get("block_grad_norms") or [float("nan")]
    verdict = "ok" if r["status"] == "ok" else f"FLAGGED: {r['reason']}"
    return (f"{r['preset']:17} {r['option']:15} init loss {r['losses'][0]:.3f} (expected {r['expected_loss']:.3f}), "
            f"block grad norms {min(norms):.2e}..{max(norms):.2e}, held-out {r['held_out_before']:.3f} -> "
            f"{r['held_out_after']:.3f} after {r['steps']} steps  {verdict}")


LINES = {"steps": step_line, "memory": memory_line, "numerics": numerics_line}


MEMORY_METHOD = (
    "Parameters, gradients and AdamW's two moments in float32 take {state} bytes a parameter (on a GPU too: bf16 "
    "autocast and FSDP's mixed precision keep float32 master weights); FSDP over g GPUs divides them by g. "
    "Activations are the bytes autograd keeps for the backward, counted with saved-tensor hooks on CPU in float32 "
    "with rotarium's PyTorch kernels, for one sequence, as `no checkpointing / checkpointing`; with checkpointing, "
    "the blocks' inputs and what lies outside the blocks, plus one block while it is recomputed (the peak). The 370M "
    "presets are measured at full depth at {cpu} tokens, the others extrapolated from 1 and 2 blocks. Per token and "
    "fixed: the line through {cpu} and {gpu} tokens (the fixed part is what does not grow with the sequence, such as "
    "the LM head's weight gradient). The GPU columns are extrapolated, not measured: that line at {batch} x {gpu} "
    "tokens, halved for bf16; fla's kernels save other intermediates than rotarium's PyTorch ones, and under DDP's "
    "autocast the residual stream stays float32.")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table; the columns holding numbers are right-aligned."""
    align = ["---:" if any(row[i][:1].isdigit() for row in rows) else "---" for i in range(len(header))]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|",
            *("| " + " | ".join(row) + " |" for row in rows), ""]


def step_cells(r: dict) -> list[str]:
    if r["status"] in ("failed", "not run"):
        return [r["preset"], r["option"], "-", "-", "-", "-", "-", "-", f"{r['peak_rss_gb']:.2f}",
                f"{r['status']}: {r['reason']}"]
    verdict = "ok" if r["status"] == "ok" else f"flagged: {r['reason']}"
    return [r["preset"], r["option"], r["mode"], r["dtype"], f"{r['loss']:.3f} ({r['expected_loss']:.3f})",
            seconds(r, "forward_s"), seconds(r, "backward_s"), seconds(r, "optimizer_s"), f"{r['peak_rss_gb']:.2f}",
            f"{verdict}; {r['plan']}"]


def memory_columns(gpu_tokens: int) -> list[str]:
    return ["parameters", "weights / grads / AdamW GB", "activations/token kB", "+ fixed MB",
            f"GPU {GPU_BATCH} x {gpu_tokens} bf16 activations GB", "GPU total, DDP, ckpt GB"]


def memory_cells(r: dict) -> list[str]:
    """The cells of :func:`memory_columns`."""
    states = r["params"] * GPU_STATE_BYTES
    split = " / ".join(f"{r['params'] * size / GB:.1f}" for size in STATE_BYTES.values())
    return [f"{r['params'] / 1e6:,.1f}M", split, pair(r["per_token"], 1e3), pair(r["fixed"], 1e6),
            pair(r["gpu_bf16"], GB), f"{(states + r['gpu_bf16']['checkpointing']) / GB:.1f}"]


def largest(records: list[dict], preset: str) -> dict:
    """A memory record of ``preset`` holding, for every number, the largest over its options."""
    rows = [r for r in records if r["preset"] == preset]
    nested = ("cpu", "per_token", "fixed", "gpu_bf16")
    return {**rows[0], "params": max(r["params"] for r in rows),
            **{key: {k: max(r[key][k] for r in rows) for k in rows[0][key]} for key in nested}}


def numerics_cells(r: dict) -> list[str]:
    if r["status"] == "failed":
        return [r["preset"], r["option"], "-", "-", "-", f"failed: {r['reason']}"]
    norms = r["block_grad_norms"]
    verdict = "ok" if r["status"] == "ok" else f"flagged: {r['reason']}"
    return [r["preset"], r["option"], f"{r['losses'][0]:.3f} ({r['expected_loss']:.3f})",
            f"{min(norms):.2e}..{max(norms):.2e}", f"{r['held_out_before']:.3f} -> {r['held_out_after']:.3f}", verdict]


def markdown(records: list[dict], args, header: str) -> str:
    out = [f"# Presets at full size{' (--tiny)' if args.tiny else ''}", "", header, ""]
    of = {part: [r for r in records if r["part"] == part] for part in ("steps", "memory", "numerics")}
    if of["steps"]:
        out += ["## One training step (CPU, batch 1, gradient checkpointing)", ""]
        out += table(["preset", "option", "mode", "dtype", "loss (at init)", "forward s", "backward s", "AdamW s",
                      "peak RSS GB", "verdict; plan"], [step_cells(r) for r in of["steps"]])
    measured = [r for r in of["memory"] if r["status"] == "ok"]
    if of["memory"]:
        out += ["## Memory", ""]
    if measured:
        first = measured[0]
        out += [MEMORY_METHOD.format(state=GPU_STATE_BYTES, cpu=first["cpu_tokens"], gpu=first["gpu_tokens"],
                                     batch=GPU_BATCH), ""]
        columns = memory_columns(first["gpu_tokens"])
        out += table(["preset", "option", *columns[:2], f"activations of {first['cpu_tokens']} tokens MB",
                      *columns[2:]],
                     [[r["preset"], r["option"], *memory_cells(r)[:2], pair(r["cpu"], 1e6), *memory_cells(r)[2:]]
                      for r in measured])
        out += ["Per preset, the largest value over the options measured (the table of docs/training.md):", ""]
        out += table(["preset", *columns], [[preset, *memory_cells(largest(measured, preset))]
                                            for preset in dict.fromkeys(r["preset"] for r in measured)])
    out += [f"{memory_line(r)}" for r in of["memory"] if r["status"] != "ok"]
    if of["numerics"]:
        out += ["## Numerics at depth", ""]
        out += table(["preset", "option", "initial loss (expected)", "block gradient norms min..max",
                      "held-out loss before -> after", "verdict"], [numerics_cells(r) for r in of["numerics"]])
    failed = sum(r["status"] in ("failed", "not run") for r in records)
    flagged = sum(r["status"] == "flagged" for r in records)
    out += [f"{len(records)} rows: {failed} failed or not run, {flagged} flagged.", ""]
    return "\n".join(out)


def previous_records(args) -> dict[tuple[str, str, str], dict]:
    """The rows of an earlier run with the same ``--output`` and scale that have a result (``failed`` rows run
    again), so that the table can be filled in several sittings; none with ``--redo``."""
    path = args.output.with_suffix(".json")
    if args.redo or not path.is_file():
        return {}
    saved = json.loads(path.read_text())
    if saved.get("scale") != asdict(chosen_scale(args)):
        raise ValueError(f"{path} holds rows at another scale ({'--tiny' if args.tiny else 'full size'} asked); "
                         "pass --redo to replace them, or another --output")
    return {(r["part"], r["preset"], r["option"]): r for r in saved["rows"] if r["status"] != "failed"}


def ordered(records: dict[tuple[str, str, str], dict]) -> list[dict]:
    """Parts, presets and options in their canonical order, whatever order the sittings ran them in."""
    from rotarium.configs.presets import PRESETS
    from rotarium.layers import POSITION_ENCODINGS

    presets = list(PRESETS)
    return sorted(records.values(), key=lambda r: (PARTS.index(r["part"]), presets.index(r["preset"]),
                                                   POSITION_ENCODINGS.index(r["option"])))


def write_output(args, header: str, records: list[dict]) -> None:
    from rotarium.utils.files import write_json_atomic, write_text_atomic

    write_text_atomic(args.output, markdown(records, args, header))
    write_json_atomic(args.output.with_suffix(".json"), {"scale": asdict(chosen_scale(args)), "header": header,
                                                         "rows": records})


def parse_list(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in allowed]
    if unknown or not items:
        raise ValueError(f"{flag}: unknown {', '.join(unknown) or 'empty list'}; choose from {', '.join(allowed)}")
    return items


def main(argv: list[str] | None = None) -> int:
    from rotarium.layers import POSITION_ENCODINGS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=None, help="comma-separated presets (default: every preset)")
    parser.add_argument("--options", default=",".join(POSITION_ENCODINGS), help="comma-separated positional options")
    parser.add_argument("--parts", default="steps,memory", help=f"comma-separated, among {', '.join(PARTS)}")
    parser.add_argument("--numerics", action="store_true", help="adds numerics to --parts")
    parser.add_argument("--numerics-steps", type=int, default=None,
                        help=f"AdamW steps of a numerics row (default {FULL.numerics_steps}; --tiny: "
                             f"{TINY.numerics_steps})")
    parser.add_argument("--tiny", action="store_true", help="presets shrunk 16x in width to 3 blocks: seconds")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="force the dtype of the step rows")
    parser.add_argument("--mode", default="auto", choices=("auto", "step", "backward", "forward"),
                        help="force what the step rows run")
    parser.add_argument("--row-timeout", type=float, default=3600.0, help="seconds a row may take")
    parser.add_argument("--output", type=Path, default=None,
                        help="write the tables here as Markdown, and the records beside it as .json")
    parser.add_argument("--redo", action="store_true",
                        help="run every row again, even those --output's .json already holds")
    parser.add_argument("--child", choices=("steps", "memory", "numerics"), help=argparse.SUPPRESS)
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    parser.add_argument("--option", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(args)
        return 0

    from tqdm.auto import tqdm

    from rotarium.configs.presets import PRESETS

    try:
        presets = parse_list(args.presets, tuple(PRESETS), "--presets") if args.presets else list(PRESETS)
        options = parse_list(args.options, POSITION_ENCODINGS, "--options")
        parts = parse_list(args.parts, PARTS, "--parts")
        if args.numerics_steps is not None and args.numerics_steps < 1:
            raise ValueError(f"--numerics-steps must be a positive integer, got {args.numerics_steps}")
        if not args.row_timeout > 0:
            raise ValueError(f"--row-timeout must be a positive number of seconds, got {args.row_timeout}")
        if args.output is not None and args.output.suffix != ".md":
            raise ValueError(f"--output {args.output}: give a .md path (the records go beside it as .json)")
        if args.output is not None:
            previous_records(args)  # a file at another scale is refused before any row runs
    except ValueError as error:
        print(f"presets.py: error: {error}", file=sys.stderr)
        return 2
    if args.numerics and "numerics" not in parts:
        parts.append("numerics")
    rows = []
    for part in parts:
        chosen = [p for p in presets if part != "numerics" or p.endswith("-370m")]
        if not chosen:
            print(f"{part}: not run: they run on the 370M presets, and --presets names none")
        rows += [Row(part, preset, option) for preset in chosen for option in options]

    import torch

    header = (f"{'--tiny: ' if args.tiny else ''}CPU: {os.cpu_count()} cores, {torch.get_num_threads()} torch "
              f"threads, {memory_available() / GB:.1f} GB available at the start, native bf16: "
              f"{'yes' if native_bf16() else 'no'}; torch {torch.__version__}. Peak RSS is the row's whole process "
              "(interpreter and libraries included); GB = 1e9 bytes.")
    print(header)
    done = previous_records(args) if args.output is not None else {}
    todo = [row for row in rows if (row.part, row.preset, row.option) not in done]
    if len(todo) < len(rows):
        print(f"{len(rows) - len(todo)} of {len(rows)} rows are already in {args.output.with_suffix('.json')}; "
              f"running the other {len(todo)} (--redo runs them all)")
    records = dict(done)
    bar = tqdm(todo, desc="presets", unit="row")
    for row in bar:
        bar.set_postfix_str(row.name)
        record = run_child(row, args)
        records[row.part, row.preset, row.option] = record
        tqdm.write(f"[{row.part}] {LINES[row.part](record)}  ({record['wall_s']:.0f} s)")
        if args.output is not None:  # after every row, so that a stopped table keeps what it finished
            write_output(args, header, ordered(records))
    bar.close()
    text = markdown(ordered(records), args, header)
    print("\n" + text)
    if args.output is not None:
        write_output(args, header, ordered(records))
        print(f"wrote {args.output} and {args.output.with_suffix('.json')}")
    records = [records[row.part, row.preset, row.option] for row in rows]
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
