"""On a CUDA machine with fla: rotarium's fla path against its PyTorch path, in two parts run one at a time.

Usage::

    python benchmarks/gpu_check.py --part ops    [--budget 180] [--only TEXT]... [--T 4096] [--repeats 3]
    python benchmarks/gpu_check.py --part models [--budget 180] [--only TEXT]... [--batch 4] [--seq-len 2048]
                                                 [--steps 3]
    python benchmarks/gpu_check.py --part ops|models --dry-run      (CPU, tiny sizes: the script's own test)
    python benchmarks/gpu_check.py --part ops|models --interpret    (CPU, tiny sizes, fla's kernels interpreted)
    (either part: [--autotune first] to compile one configuration per fla kernel instead of autotuning)

``--part ops`` calls each op with ``backend="fla"`` and with ``backend="torch"`` on the same CUDA inputs and compares
outputs, final states and gradients (relative L2 errors). The rows follow training: packed sequences (``cu_seqlens``,
one of them a single token) with a per-sequence initial and final state, and plain batches, forward and backward
in bfloat16; a few tokens continuing from a state with gradients (how a model trains through decoding); the LM loss
through the output projection (fused_linear_cross_entropy_loss, the 370M presets' width and vocabulary); the
fused-recurrent decoding kernels and one-token attention against a KV cache (GQA, forget gate, left padding). Head
sizes are the presets' largest: GLA keys 256 and values 512 (``gla-1.3b``), DeltaNet 128, the gated delta rule 256
and 512 (Gated DeltaNet's published heads), attention 64, with GQA and a sliding ``window_size``. float32 rows
(forward only: the evaluation CLIs' dtype) run with ``TRITON_F32_DEFAULT=ieee``, set before fla compiles anything, so
fla's float32 matmuls are not TF32 and a tight tolerance holds. Then fwd+bwd timings of the token mixers' ops,
bfloat16, batch 1 x ``--T`` tokens.

``--part models`` first runs every family (Gated DeltaNet included) x positional option end to end, then four training
steps under CUDA's sync debug mode (no host synchronisation may happen once fla's kernels are compiled), then trains:
one AdamW step of each 370M preset (``gla-370m``, ``fox-370m``, ``deltanet-370m``, the same with ``use_gated_delta``
(Gated DeltaNet), ``transformer-370m``) under bfloat16 autocast on a packed batch of ``--batch`` sequences of
``--seq-len`` tokens (cu_seqlens at every sequence and document start, as rotarium.data.batches builds it), reporting
tokens/s; beside it fla's own model of the same preset (GLA, DeltaNet, Gated DeltaNet, Forgetting Transformer), built
from the preset's fields with rotarium's model loaded from its weights, so the first losses must agree; fla's
Transformer needs flash-attn and is skipped. The compiled blocks' steps and fla's model's are each timed round-robin
beside rotarium's eager step (benchmarks/common.py), so that their time ratios to it compare steps of the same rounds.
The end-to-end rows run the presets cut to 2 layers and 1024 tokens of vocabulary (FoX and the Transformer with
``qk_norm`` and GQA, so those are covered too), ops on fla (``ROTARIUM_OPS_BACKEND=auto`` on CUDA) against ops on
PyTorch: loss and gradients of a plain batch and of packed documents, token-by-token decoding after a prefill against
the PyTorch full forward, and gradients through decoding (a prefill, then a few tokens from the cache with
gradients).

Every fla run counts the ops' dispatches (rotarium.ops.backend.count_dispatches): a row passes only if fla really
ran, and the PyTorch side never did. A PyTorch fallback known to be deliberate (fla's plain chunked delta rule
refuses float32; fla refuses the gated delta rule's backward on Hopper GPUs with the Triton versions that
miscompile it, listed in docs/design.md, unless tilelang is installed; fla's attention decoding kernel has no
backward) makes the row KNOWN, with the reason, instead of failing it.

Each row prints as soon as it is done (with the seconds elapsed: most of a first run is Triton compiling and
autotuning fla's kernels, which ``--autotune first`` cuts down), and each part ends with a PASS / KNOWN / SKIP / FAIL
table. Rows not started within ``--budget`` seconds are skipped, so the table prints inside a time limit. ``--only
TEXT`` (repeatable) keeps the rows whose name contains one of the texts. ``--table PATH`` also writes the table to a
file.

``--dry-run`` builds and runs every row on CPU at tiny sizes with fla replaced by the PyTorch path (fla's models are
still built and their weights mapped into rotarium's), so the script cannot rot (tests/test_gpu_check.py).

``--interpret`` runs the same tiny rows on CPU with fla's own Triton kernels executed by Triton's interpreter
(``TRITON_INTERPRET=1``, each program in numpy): every row then compares the code a GPU runs, called as rotarium calls
it, with the PyTorch path, and fla's own models train beside rotarium's. What it cannot show is what only a GPU has:
compilation, TF32, bfloat16 arithmetic (the interpreter cannot compute in bfloat16, so float16 takes its place), speed
and host synchronisation. CI runs both parts this way (tests/test_gpu_check.py).

Exit status: 1 if a row FAILs, 3 if the budget left rows unrun, 2 where nothing can run (no GPU, no fla), else 0.
fla is imported only when a row needs it.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import math
import os
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from common import paired_ratio, time_rounds, verdict  # beside this script, first on sys.path

from rotarium import ops
from rotarium.configs.presets import preset_config
from rotarium.data.batches import collate
from rotarium.hub.convert import fit_state_dict, fla_config_classes, map_fla_config, rename_state_dict
from rotarium.layers import POSITION_ENCODINGS
from rotarium.models import FAMILY_MODELS, NoFlaPeer, RotariumConfig
from rotarium.models.modeling import CACHE_FIELD
from rotarium.ops.backend import ENV_VAR, count_dispatches
from rotarium.ops.delta_rule.chunk import fla_gated_backward_refused
from rotarium.training.build import compile_blocks, compile_failures
from rotarium.training.flops import flops_per_token, peak_flops

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPE_NAMES = {BF16: "bf16", FP16: "fp16", FP32: "fp32"}
# Relative L2 errors. bf16: both sides read the same bf16 inputs; fla keeps bf16 intermediates where the PyTorch path
# keeps float32, and a wiring error (scale, gate layout, state layout, a missing gradient) is of order 1, far above.
# fp32 (ops only): IEEE matmuls on both sides.
OP_TOL = {BF16: 3e-2, FP16: 3e-2, FP32: 1e-3}
MODEL_TOL = 5e-2
PEER_LOSS_TOL = 1e-2


# --------------------------------------------------------------------------------------------------- reporting

@dataclass
class Report:
    """Rows as they finish: printed at once, then as a table."""

    budget: float
    only: list[str]
    start: float = field(default_factory=time.perf_counter)
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    over_budget: int = 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def say(self, line: str) -> None:
        print(f"[{self.elapsed():5.0f}s] {line}", flush=True)

    def run(self, name: str, check: Callable[[], tuple[str, str]]) -> None:
        """Runs one row: ``check()`` returns ``(status, note)``; an exception fails the row, and the next one runs."""
        if self.only and not any(text in name for text in self.only):
            return
        if self.elapsed() > self.budget:
            status, note = "SKIP", f"the --budget of {self.budget:.0f}s was spent before this row"
            self.over_budget += 1
        else:
            try:
                status, note = check()
            except Exception as error:  # noqa: BLE001 - reported as the row's failure; the next row still runs
                first = str(error).splitlines()[0] if str(error) else ""
                status, note = "FAIL", f"{type(error).__name__}: {first}"
                where = traceback.format_exception(error, limit=-3)
                print("".join(where[-4:]).rstrip(), flush=True)
            finally:
                release_memory()
        self.rows.append((name, status, note))
        self.say(f"{name}: {status}  {note}")

    def table(self, title: str, path: str | None) -> int:
        counts = Counter(status for _, status, _ in self.rows)
        summary = ", ".join(f"{counts[s]} {s}" for s in ("PASS", "KNOWN", "SKIP", "FAIL"))
        width = max((len(name) for name, _, _ in self.rows), default=10)
        lines = [f"== {title}: {len(self.rows)} rows: {summary}; {self.elapsed():.0f}s ==",
                 *(f"{name:<{width}}  {status:<5}  {note}" for name, status, note in self.rows)]
        if self.over_budget:
            lines.append(f"{self.over_budget} rows were not run: raise --budget or rerun them with --only")
        text = "\n".join(lines)
        print("\n" + text, flush=True)
        if path:
            Path(path).write_text(text + "\n", encoding="utf-8")
        if counts["FAIL"]:
            return 1
        return 3 if self.over_budget else 0


def release_memory() -> None:
    """Hands a finished row's GPU memory back (the 370M models would otherwise pile up)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def rel_err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return float("inf") if (a is None) != (b is None) else 0.0
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def judged(errs: dict[str, float], tol: float) -> tuple[bool, str]:
    good = all(e < tol for e in errs.values())  # NaN fails
    return good, ", ".join(f"{k} {v:.1e}" for k, v in errs.items()) + f" (tol {tol:.0e})"


# ------------------------------------------------------------------------------------------ which backend ran

MODES = ("gpu", "dry-run", "interpret")


@dataclass(frozen=True)
class Context:
    device: str
    mode: str  # one of MODES

    @property
    def tiny(self) -> bool:
        """CPU sizes: everything but the GPU run."""
        return self.mode != "gpu"

    @property
    def fla_side(self) -> str:
        """The backend the fla side must run: fla, except in a dry run, where the PyTorch path stands in for it."""
        return "torch" if self.dry_run else "fla"

    @property
    def dry_run(self) -> bool:
        """The PyTorch path stands in for fla: the script checks itself, not fla."""
        return self.mode == "dry-run"

    @property
    def interpreted(self) -> bool:
        """fla's kernels run on CPU through Triton's interpreter: right values, but no speed worth timing."""
        return self.mode == "interpret"

    @property
    def peer_options(self) -> dict[str, bool]:
        """Options for fla's peer models: the interpreter cannot run the fused cross-entropy and SwiGLU."""
        return INTERPRETED_PEER if self.interpreted else {}

    @property
    def half(self) -> torch.dtype:
        """The training dtype: bfloat16, but float16 under Triton's interpreter, which holds bfloat16 as raw 16-bit
        integers and so computes garbage with it (float16 is a numpy type there)."""
        return FP16 if self.interpreted else BF16


def known_fallback(op: str, dtype: torch.dtype, grad: bool) -> str | None:
    """Why ``op`` deliberately runs the PyTorch path on the fla side (a limit of fla, not a bug), or None."""
    if op == "forgetting_attn_with_cache" and grad:
        return "fla's attention decoding kernel has no backward"
    if op == "chunk_delta_rule" and dtype == FP32:
        return "fla's chunk_delta_rule refuses float32"
    if op == "chunk_gated_delta_rule" and grad and fla_gated_backward_refused():
        return ("fla refuses the gated delta rule's backward on Hopper with Triton < 3.7.1 (install tilelang or "
                "Triton >= 3.7.1)")
    return None


def check_dispatches(calls: Counter, side: str, ctx: Context, dtype: torch.dtype,
                     grad: bool) -> tuple[list[str], list[str]]:
    """``(problems, known fallbacks)`` of one side's op calls: the PyTorch side (and the fla side of a dry run) may
    run no fla; on a GPU the fla side must run fla, and PyTorch only where :func:`known_fallback` says why."""
    problems: list[str] = []
    known: list[str] = []
    if not calls:
        return [f"the {side} side made no op call"], known
    expected = ctx.fla_side if side == "fla" else "torch"
    if expected == "torch":
        fla_ops = sorted(op for (op, backend) in calls if backend == "fla")
        if fla_ops:
            problems.append(f"the {side} side ran fla for {fla_ops}")
        return problems, known
    if not any(backend == "fla" for (_, backend) in calls):
        problems.append("the fla side never ran fla")
    for (op, backend), n in sorted(calls.items()):
        if backend == "torch":
            reason = known_fallback(op, dtype, grad)
            if reason is None:
                problems.append(f"{op} ran the PyTorch path on the fla side ({n} calls)")
            elif f"{op}: {reason}" not in known:
                known.append(f"{op}: {reason}")
    return problems, known


def row_status(good: bool, problems: list[str], known: list[str], note: str) -> tuple[str, str]:
    parts = [note, *(f"dispatch: {p}" for p in problems), *(f"known fallback: {k}" for k in known)]
    text = "; ".join(p for p in parts if p)
    if not good or problems:
        return "FAIL", text
    return ("KNOWN" if known else "PASS"), text


@contextlib.contextmanager
def ops_backend(value: str) -> Iterator[None]:
    """``ROTARIUM_OPS_BACKEND`` set to ``value`` inside the block (how a model's ops are steered)."""
    old = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = old


# --------------------------------------------------------------------------------------------------- the ops

def op_inputs(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, device: str, HQ: int | None = None,
              cu: tuple[int, ...] | None = None, window: int | None = None) -> dict[str, torch.Tensor | int | None]:
    """Inputs of every op, drawn on CPU (the same numbers on any device). q, k, v in ``dtype``; the gates, beta and
    the states float32, as the layers pass them. ``cu``: packed sequences (B must be 1), one state each."""
    gen = torch.Generator().manual_seed(0)
    HQ = HQ or H
    N = B if cu is None else len(cu) - 1

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    x = {
        "q": randn(B, T, HQ, K).to(dtype),
        "k": F.normalize(randn(B, T, H, K), dim=-1).to(dtype),
        "v": randn(B, T, H, V).to(dtype),
        "g_channel": F.logsigmoid(randn(B, T, H, K) + 3) / 16,
        "g_head": F.logsigmoid(randn(B, T, HQ) + 3),
        "beta": torch.rand(B, T, H, generator=gen),
        "h0": randn(N, H, K, V) * 0.1,
        "cu_seqlens": None if cu is None else torch.tensor(cu, dtype=torch.long),
    }
    x = {name: None if t is None else t.to(device) for name, t in x.items()}
    x["window"] = window
    return x


def cache_inputs(B: int, T: int, H: int, HQ: int, K: int, dtype: torch.dtype, device: str, gate: bool,
                 padded: bool) -> dict[str, torch.Tensor | None]:
    """One new query per row against T cached keys (the new token's included): forget-gate cumulative sums when
    ``gate``, and the first row left-padded by a third when ``padded``."""
    gen = torch.Generator().manual_seed(0)
    k_cumsum = F.logsigmoid(torch.randn(B, T, HQ, generator=gen) + 3).cumsum(1) if gate else None
    mask = None
    if padded:
        mask = torch.ones(B, T, dtype=torch.long)
        mask[0, :T // 3] = 0
    x = {"q": torch.randn(B, 1, HQ, K, generator=gen).to(dtype), "k": torch.randn(B, T, H, K, generator=gen).to(dtype),
         "v": torch.randn(B, T, H, K, generator=gen).to(dtype), "k_cumsum": k_cumsum, "mask": mask,
         "q_cumsum": None if k_cumsum is None else k_cumsum[:, -1:].clone()}
    return {name: None if t is None else t.to(device) for name, t in x.items()}


def loss_inputs(N: int, D: int, V: int, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """Final hidden states ``[N, D]``, the LM head ``[V, D]`` and targets with every seventh ignored."""
    gen = torch.Generator().manual_seed(0)
    target = torch.randint(0, V, (N,), generator=gen)
    target[::7] = -100
    x = {"x": torch.randn(N, D, generator=gen).to(dtype), "target": target,
         "weight": (torch.randn(V, D, generator=gen) * 0.02).to(dtype)}
    return {name: t.to(device) for name, t in x.items()}


def _state(x: dict) -> dict:
    return {"initial_state": x["h0"], "output_final_state": True}


CALLS: dict[str, Callable[[dict, str], object]] = {
    "chunk_gla": lambda x, be: ops.chunk_gla(x["q"], x["k"], x["v"], x["g_channel"], **_state(x),
                                             cu_seqlens=x["cu_seqlens"], backend=be),
    "chunk_delta_rule": lambda x, be: ops.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], **_state(x),
                                                           cu_seqlens=x["cu_seqlens"], backend=be),
    "chunk_gated_delta_rule": lambda x, be: ops.chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g_head"], x["beta"], **_state(x), cu_seqlens=x["cu_seqlens"], backend=be),
    "parallel_forgetting_attn": lambda x, be: ops.parallel_forgetting_attn(
        x["q"], x["k"], x["v"], x["g_head"], window_size=x["window"], cu_seqlens=x["cu_seqlens"], backend=be),
    # g None: plain causal softmax attention, which routes to fla's parallel_attn
    "parallel_attn": lambda x, be: ops.parallel_forgetting_attn(
        x["q"], x["k"], x["v"], window_size=x["window"], cu_seqlens=x["cu_seqlens"], backend=be),
    "fused_recurrent_gla": lambda x, be: ops.fused_recurrent_gla(x["q"], x["k"], x["v"], gk=x["g_channel"],
                                                                 **_state(x), backend=be),
    "fused_recurrent_delta_rule": lambda x, be: ops.fused_recurrent_delta_rule(x["q"], x["k"], x["v"], x["beta"],
                                                                               **_state(x), backend=be),
    "fused_recurrent_gated_delta_rule": lambda x, be: ops.fused_recurrent_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g_head"], beta=x["beta"], **_state(x), backend=be),
    "forgetting_attn_with_cache": lambda x, be: ops.forgetting_attn_with_cache(
        x["q"], x["k"], x["v"], x["q_cumsum"], x["k_cumsum"], attention_mask=x["mask"], backend=be),
    "fused_linear_cross_entropy_loss": lambda x, be: ops.fused_linear_cross_entropy_loss(
        x["x"], x["target"], x["weight"], backend=be),
}
# The inputs of each call (op_inputs where not named).
INPUTS = {"forgetting_attn_with_cache": cache_inputs, "fused_linear_cross_entropy_loss": loss_inputs}
# The name each call records in the dispatch counter.
DISPATCHED = {name: "parallel_forgetting_attn" if name == "parallel_attn" else name for name in CALLS}
# Differentiated inputs of each op (the state too, unless the row says otherwise).
GRADS = {"chunk_gla": ("q", "k", "v", "g_channel", "h0"), "chunk_delta_rule": ("q", "k", "v", "beta", "h0"),
         "chunk_gated_delta_rule": ("q", "k", "v", "g_head", "beta", "h0"),
         "parallel_forgetting_attn": ("q", "k", "v", "g_head"), "parallel_attn": ("q", "k", "v"),
         "fused_linear_cross_entropy_loss": ("x", "weight")}
# Head sizes: the presets' largest (GLA: gla-1.3b; the gated delta rule: Gated DeltaNet's published 256 x 512); the
# loss: the 370M presets' width and vocabulary.
SIZES = {"chunk_gla": {"H": 2, "K": 256, "V": 512}, "fused_recurrent_gla": {"H": 2, "K": 256, "V": 512},
         "chunk_delta_rule": {"H": 4, "K": 128, "V": 128}, "fused_recurrent_delta_rule": {"H": 4, "K": 128, "V": 128},
         "chunk_gated_delta_rule": {"H": 2, "K": 256, "V": 512},
         "fused_recurrent_gated_delta_rule": {"H": 2, "K": 256, "V": 512},
         "parallel_forgetting_attn": {"H": 4, "K": 64, "V": 64}, "parallel_attn": {"H": 4, "K": 64, "V": 64},
         "forgetting_attn_with_cache": {"H": 2, "HQ": 4, "K": 64},
         "fused_linear_cross_entropy_loss": {"D": 1024, "V": 32000}}
# Under Triton's interpreter every kernel program runs in numpy, one after another, so the heads shrink; keys and values
# still differ in size and span several of the kernels' blocks.
INTERPRETED_SIZES = {"chunk_gla": {"K": 64, "V": 128}, "fused_recurrent_gla": {"K": 64, "V": 128},
                     "chunk_delta_rule": {"H": 2, "K": 64, "V": 64},
                     "fused_recurrent_delta_rule": {"H": 2, "K": 64, "V": 64},
                     "chunk_gated_delta_rule": {"K": 64, "V": 128},
                     "fused_recurrent_gated_delta_rule": {"K": 64, "V": 128},
                     "parallel_forgetting_attn": {"K": 32, "V": 32}, "parallel_attn": {"K": 32, "V": 32}}


def op_sizes(call: str, ctx: Context) -> dict[str, int]:
    return SIZES[call] | (INTERPRETED_SIZES.get(call, {}) if ctx.interpreted else {})


@dataclass(frozen=True)
class OpRow:
    name: str
    call: str  # a key of CALLS
    shape: dict  # op_inputs' sizes beyond the heads
    grads: tuple[str, ...]  # empty: inference


def op_rows(ctx: Context) -> list[tuple[OpRow, torch.dtype]]:
    """Every ops row, most telling first (a run cut short by --budget keeps those): packed training, training
    through decoding, plain batches, decoding, float32."""
    T = 100 if ctx.tiny else 1000  # not a multiple of 64, so every kernel sees a partial chunk
    cu = (0, 30, 31, 70, 100) if ctx.tiny else (0, 70, 71, 530, 1000)  # a one-token sequence among them
    packed = {"B": 1, "T": cu[-1], "cu": cu}
    batch = {"B": 2, "T": T}
    steps = {"B": 2, "T": 5}  # a few tokens continuing from a state, as decoding with gradients
    window = T // 8
    gqa = {"HQ": 4, "H": 2}
    chunked = ("chunk_gla", "chunk_delta_rule", "chunk_gated_delta_rule")
    attention = ("parallel_forgetting_attn", "parallel_attn")
    half = ctx.half
    low = DTYPE_NAMES[half]
    rows = [(OpRow(f"{low} {name} packed, per-sequence h0 and final states, fwd+bwd", name, packed, GRADS[name]),
             half) for name in chunked]
    rows += [(OpRow(f"{low} {name} packed GQA 4/2, fwd+bwd", name, {**packed, **gqa}, GRADS[name]), half)
             for name in attention]
    rows += [(OpRow(f"{low} parallel_forgetting_attn packed GQA 4/2 window {window}, fwd+bwd",
                    "parallel_forgetting_attn", {**packed, **gqa, "window": window}, GRADS["parallel_forgetting_attn"]),
              half)]
    rows += [(OpRow(f"{low} {name} 5 tokens from a state, grads (not of the state)", name, steps, GRADS[name][:-1]),
              half) for name in chunked]
    rows += [(OpRow(f"{low} {name} batch, h0, fwd+bwd", name, batch, GRADS[name]), half) for name in chunked]
    rows += [(OpRow(f"{low} parallel_forgetting_attn batch, fwd+bwd", "parallel_forgetting_attn", batch,
                    GRADS["parallel_forgetting_attn"]), half),
             (OpRow(f"{low} parallel_attn batch window {window}, fwd+bwd", "parallel_attn", {**batch, "window": window},
                    GRADS["parallel_attn"]), half)]
    loss_shape = {"N": 64, "D": 64, "V": 512} if ctx.tiny else {"N": 2048}
    rows += [(OpRow(f"{low} fused_linear_cross_entropy_loss, 1/7 ignored, fwd+bwd", "fused_linear_cross_entropy_loss",
                    loss_shape, GRADS["fused_linear_cross_entropy_loss"]), half)]
    for dtype in (half, FP32):
        name = DTYPE_NAMES[dtype]
        rows += [(OpRow(f"{name} {op} 8 tokens from a state", op, {"B": 2, "T": 8}, ()), dtype)
                 for op in ("fused_recurrent_gla", "fused_recurrent_delta_rule", "fused_recurrent_gated_delta_rule")]
        rows += [(OpRow(f"{name} forgetting_attn_with_cache 1 token, GQA 4/2, {what}", "forgetting_attn_with_cache",
                        {"B": 2, "T": T, "gate": gate, "padded": padded}, ()), dtype)
                 for what, gate, padded in (("forget gate", True, False), ("left-padded", False, True))]
    rows += [(OpRow(f"fp32 {name} batch, fwd", name, batch, ()), FP32) for name in (*chunked, *attention)]
    return rows


def run_op(row: OpRow, x: dict, backend: str, grads: tuple[str, ...]) -> tuple[dict[str, torch.Tensor | None],
                                                                               Counter]:
    """One side of a row: its output, final state and the gradients of ``grads``, and the dispatches it made."""
    leaves = {n: t.detach().clone().requires_grad_(n in grads) if isinstance(t, torch.Tensor) else t
              for n, t in x.items()}
    with count_dispatches() as calls, torch.set_grad_enabled(bool(grads)):
        out = CALLS[row.call](leaves, backend)
        o, state = out if isinstance(out, tuple) else (out, None)
        if grads:
            loss = o.float().square().mean() + (state.square().mean() if state is not None else 0)
            loss.backward()
    result = {"o": o.detach(), "state": None if state is None else state.detach()}
    return result | {f"d{n}": leaves[n].grad for n in grads}, calls


def check_op(row: OpRow, dtype: torch.dtype, ctx: Context) -> tuple[str, str]:
    op = DISPATCHED[row.call]
    x = INPUTS.get(row.call, op_inputs)(**{**op_sizes(row.call, ctx), **row.shape}, dtype=dtype, device=ctx.device)
    whole = known_fallback(op, dtype, grad=False)
    if whole is not None:
        # fla cannot take the call at all: what must hold is that "auto" routes it to the PyTorch path and runs
        _, calls = run_op(row, x, "auto", row.grads)
        problems, _ = check_dispatches(calls, "torch", ctx, dtype, bool(row.grads))
        return row_status(True, problems, [f"{op}: {whole}"], "not compared: the auto backend ran the PyTorch path")
    grads, note = row.grads, ""
    if grads and ctx.fla_side == "fla" and known_fallback(op, dtype, grad=True) is not None:
        grads, note = (), "forward only"
    ours, torch_calls = run_op(row, x, "torch", grads)
    theirs, fla_calls = run_op(row, x, ctx.fla_side, grads)
    errs = {name: rel_err(theirs[name], ours[name]) for name in ours
            if ours[name] is not None or theirs[name] is not None}
    good, text = judged(errs, OP_TOL[dtype])
    problems, known = check_dispatches(fla_calls, "fla", ctx, dtype, bool(grads))
    problems += check_dispatches(torch_calls, "torch", ctx, dtype, bool(grads))[0]
    if note:
        known.append(f"{op}: {known_fallback(op, dtype, grad=True)}; {note}")
    return row_status(good, problems, known, text)


def time_op(name: str, T: int, repeats: int, ctx: Context) -> tuple[str, str]:
    """fwd+bwd of one op, bf16, batch 1 x T, on each backend (forward only where fla refuses the backward)."""
    if ctx.interpreted:
        return "SKIP", "the speed of kernels run by Triton's interpreter says nothing of a GPU's"
    op = DISPATCHED[name]
    grads = GRADS[name]
    note = ""
    if ctx.fla_side == "fla" and known_fallback(op, BF16, grad=True) is not None:
        grads, note = (), " (forward only: fla refuses the backward here)"
    row = OpRow(name, name, {}, grads)
    x = op_inputs(**SIZES[name], B=1, T=T, dtype=BF16, device=ctx.device)
    samples = time_rounds({backend: lambda backend=backend: run_op(row, x, backend, grads)
                           for backend in dict.fromkeys((ctx.fla_side, "torch"))}, repeats)
    times = {backend: statistics.median(s) for backend, s in samples.items()}
    text = " | ".join(f"{backend} {t * 1e3:.2f} ms" for backend, t in times.items())
    if len(times) == 2:
        text += f" | torch/fla {paired_ratio(samples['torch'], samples['fla']):.1f}x"
    return "PASS", text + note + (" (dry run: both sides are the PyTorch path)" if ctx.dry_run else "")


def ops_part(report: Report, ctx: Context, args: argparse.Namespace) -> None:
    for row, dtype in op_rows(ctx):
        report.run(row.name, lambda row=row, dtype=dtype: check_op(row, dtype, ctx))
    T = 128 if ctx.tiny else args.T
    for name in ("chunk_gla", "chunk_delta_rule", "chunk_gated_delta_rule", "parallel_forgetting_attn",
                 "parallel_attn"):
        report.run(f"time bf16 {name} fwd+bwd, 1 x {T} tokens",
                   lambda name=name: time_op(name, T, 1 if ctx.tiny else args.repeats, ctx))


# ------------------------------------------------------------------------------------------------ the models

# Gated DeltaNet is DeltaNet with `use_gated_delta`, which runs kernels of its own (the gated delta rule's): it gets
# rows as a family does, after DeltaNet's. family -> {variant's name: overrides}.
VARIANTS = {"deltanet": {"gated-deltanet": {"use_gated_delta": True}}}
# Every family of the registry, and each variant after its family: name -> (family, overrides).
ROW_FAMILIES = {name: (family, overrides) for family in FAMILY_MODELS
                for name, overrides in {family: {}, **VARIANTS.get(family, {})}.items()}
QK_NORM_GQA = {"qk_norm": True, "num_kv_heads": 4}


def has_qk_norm_and_gqa(family: str) -> bool:
    return set(QK_NORM_GQA) <= set(FAMILY_MODELS[family].config.field_names())


# The 370M training rows: row name -> (preset, overrides).
PRESET_ROWS = {f"{name}-370m": (f"{family}-370m", overrides) for name, (family, overrides) in ROW_FAMILIES.items()}
# The end-to-end rows: family -> (preset, overrides); each with every positional option. QK-norm and GQA on where
# the family has them (the presets leave them off, and the 370M rows run those).
FAMILY_ROWS = {name: (f"{family}-370m", overrides | (QK_NORM_GQA if has_qk_norm_and_gqa(family) else {}))
               for name, (family, overrides) in ROW_FAMILIES.items()}
# A dry run's models: the preset's options at a tiny width and with two heads. Triton's interpreter runs a kernel's
# programs (one per sequence, head and block) one after another, so the heads are what an interpreted row's time
# grows with; a row with GQA keeps it, with four query heads on two key and value heads.
TINY = {"hidden_size": 64, "vocab_size": 256, "intermediate_size": 128, "num_heads": 2}


def tiny_sizes(overrides: dict, layers: int) -> dict:
    """``overrides`` at :data:`TINY`'s sizes, ``layers`` deep."""
    gqa = {"num_heads": 4, "num_kv_heads": 2} if "num_kv_heads" in overrides else {}
    return overrides | TINY | gqa | {"num_hidden_layers": layers}


# fla's causal-LM class of each fla model type the presets map to.
FLA_MODELS = {"gla": "GLAForCausalLM", "delta_net": "DeltaNetForCausalLM",
              "gated_deltanet": "GatedDeltaNetForCausalLM",
              "forgetting_transformer": "ForgettingTransformerForCausalLM"}


# fla's options for its models under the interpreter: its fused cross-entropy refuses CPU tensors (a Python check
# before its kernel), and its fused SwiGLU + linear re-enters CUDA's autocast, not the CPU's, in its backward.
INTERPRETED_PEER = {"fuse_cross_entropy": False, "fuse_swiglu": False}


def build_peer(ours: torch.nn.Module, device: str, **fla_options: object) -> torch.nn.Module:
    """fla's model of ``ours``'s config (its family's ``fla_peer``, with ``fla_options`` set in fla's config), whose
    weights ``ours`` then loads: both start from the same point; :class:`NoFlaPeer` where fla has none. Mapping the
    peer back (convert's map_fla_config, fit_state_dict) checks the config was inverted exactly."""
    mixer = ours.model.layers[0].mixer
    model_type, kwargs = ours.config.fla_peer(getattr(mixer, "head_k_dim", None), getattr(mixer, "head_v_dim", None))
    kwargs |= fla_options
    try:
        fla_models = importlib.import_module("fla.models")
        config_class = fla_config_classes()[model_type]
    except Exception as error:  # a missing or broken fla is the reason printed
        raise NoFlaPeer(f"fla cannot be imported: {type(error).__name__}: {error}") from error
    fla_config = config_class(**kwargs)
    family, _ = map_fla_config(model_type, fla_config)
    if family != ours.config.family:
        raise ValueError(f"the fla config maps back to {family}, not {ours.config.family}")
    with torch.device(device):
        peer = getattr(fla_models, FLA_MODELS[model_type])(fla_config).to(device)
    ours.load_state_dict(fit_state_dict(ours, rename_state_dict(model_type, peer.state_dict()), model_type,
                                        fla_config))
    return peer


def build_model(config: RotariumConfig, device: str) -> torch.nn.Module:
    """rotarium's model, initialised on ``device`` (fast for 370M) and then moved there as users move it, which
    catches a tensor a module creates on the CPU."""
    torch.manual_seed(0)
    with torch.device(device):
        return FAMILY_MODELS[config.family].lm(config).to(device)


def packed_batch(B: int, T: int, vocab: int, device: str) -> dict[str, torch.Tensor]:
    """B random sequences of T tokens with two document starts each, packed as training packs them; the labels
    skip the predictions across documents (rotarium's loss does that itself, fla's is told through them)."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (B, T), generator=gen)
    starts = [sorted(set(torch.randint(1, T, (2,), generator=gen).tolist())) for _ in range(B)]
    batch = collate(tokens, starts)
    batch["labels"][:, batch["cu_seqlens"][1:-1]] = -100
    return {name: t.to(device) for name, t in batch.items()}


def first_step(model: torch.nn.Module, batch: dict, ctx: Context) -> tuple[float, Callable[[], object], Counter]:
    """A first AdamW step of ``model`` on ``batch`` (a warm-up), its op dispatches counted: its loss (the model's at
    its initial weights), the step, for :func:`time_steps`, and the counts."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ctx.device == "cuda")
    model.train()

    def step() -> torch.Tensor:
        with torch.autocast(ctx.device, dtype=ctx.half):
            loss = model(**batch).loss
        loss.backward()  # outside autocast, as accelerate runs it
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    with count_dispatches() as calls:
        first = step().item()
    return first, step, calls


def time_steps(steps: int, **contenders: Callable[[], object]) -> dict[str, list[float]]:
    """Seconds of ``steps`` calls of each contender's step after its first, timed round-robin (common.time_rounds):
    the ratio of two contenders (common.paired_ratio) compares steps of the same rounds, in the same state of the
    machine (a GPU's clocks drift with its temperature and load), which rows timed one after another would not."""
    return time_rounds(contenders, repeats=steps, warmup=0)


def speed(times: list[float], tokens: int, flops: float | None = None, peak: float | None = None) -> str:
    """Tokens/s and milliseconds a step, from the median step; with the step's ``flops`` per token and the device's
    ``peak``, the model FLOPs utilisation too (rotarium.training.flops, as the training log counts it)."""
    if not times:
        return "not timed"
    median = statistics.median(times)
    text = f"{tokens / median:,.0f} tokens/s ({median * 1e3:.0f} ms/step)"
    if flops is not None and peak is not None:
        text += f", MFU {flops * tokens / median / peak:.1%}"
    return text


def check_training(name: str, preset: str, overrides: dict, ctx: Context, args: argparse.Namespace,
                   report: Report) -> None:
    """Three rows: rotarium's training step (ops on ``auto``), the same with its blocks compiled, then fla's model
    of the same preset from the same weights (or why there is none). rotarium's eager step is kept for the two
    others, each timed beside it round-robin (:func:`time_steps`) for its ratio to it."""
    overrides = tiny_sizes(overrides, 2) if ctx.tiny else overrides
    # interpreted kernels are not timed: their speed says nothing of a GPU's
    B, T, steps = (args.batch, args.seq_len, args.steps) if not ctx.tiny else (2, 64, int(ctx.dry_run))
    peak = peak_flops(torch.cuda.get_device_name()) if ctx.device == "cuda" else None
    state: dict = {}

    def ours_row() -> tuple[str, str]:
        config = preset_config(preset, **overrides)
        batch = state["batch"] = packed_batch(B, T, config.vocab_size, ctx.device)
        model = build_model(config, ctx.device)
        try:
            # on the CPU until its own row, so that the peak memory below is rotarium's step alone
            state["peer"] = build_peer(model, ctx.device, **ctx.peer_options).to("cpu")
        except NoFlaPeer as why:
            state["no_peer"] = str(why)
        # the weights it starts from, for the compiled row
        state["initial"] = {key: value.detach().to("cpu", copy=True) for key, value in model.state_dict().items()}
        if ctx.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with ops_backend("auto"):
            first, step, calls = first_step(model, batch, ctx)
            times = time_steps(steps, rotarium=step)["rotarium"]
        state["loss"], state["step"] = first, step
        state["flops"] = flops_per_token(model, T)
        size = sum(p.numel() for p in model.parameters())
        del model  # kept by its step
        problems, known = check_dispatches(calls, "fla", ctx, ctx.half, grad=True)
        memory = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if ctx.device == "cuda" else ""
        note = (f"{size / 1e6:.1f}M params, {speed(times, B * T, state['flops'], peak)}, first loss {first:.4f}"
                f"{memory}")
        return row_status(math.isfinite(first), problems, known, note)

    def compiled_row() -> tuple[str, str]:
        """The same model and batch with its blocks compiled as ``train.compile`` compiles them: its first loss must
        be eager's. A CPU run traces with aot_eager (dynamo and AOT autograd over every block, no code generated)."""
        if ctx.interpreted:
            return "SKIP", "the dry run traces the compiled blocks; interpreted kernels add nothing to that"
        if "loss" not in state:
            return "SKIP", "rotarium's eager row did not finish"
        config = preset_config(preset, **overrides)
        model = build_model(config, ctx.device)
        model.load_state_dict(state.pop("initial"))
        torch._dynamo.reset()  # this model's graphs alone, counted from zero
        torch._dynamo.utils.counters.clear()
        compile_blocks(model, backend="inductor" if ctx.device == "cuda" else "aot_eager")
        with ops_backend("auto"):
            first, step, calls = first_step(model, state["batch"], ctx)
            samples = time_steps(steps, eager=state["step"], compiled=step)
        del model, step
        times = samples["compiled"]
        problems, known = check_dispatches(calls, "fla", ctx, ctx.half, grad=True)
        err = abs(first - state["loss"]) / abs(state["loss"])
        if err >= PEER_LOSS_TOL:
            problems.append(f"first loss {first:.4f} against eager's {state['loss']:.4f}")
        failures = compile_failures()
        if failures:
            problems.append(failures)
        note = (f"{speed(times, B * T, state['flops'], peak)}, first loss rel diff to eager {err:.1e}, "
                f"{torch._dynamo.utils.counters['stats']['unique_graphs']} graph(s)")
        if times:
            note += f", compiled/eager time {paired_ratio(times, samples['eager']):.2f}x"
        return row_status(math.isfinite(first), problems, known, note)

    def peer_row() -> tuple[str, str]:
        if "no_peer" in state:
            return "SKIP", state["no_peer"]
        if "peer" not in state:
            return "SKIP", "rotarium's row did not get as far as building it"
        peer = state.pop("peer").to(ctx.device)
        if ctx.dry_run:
            return "SKIP", (f"built ({type(peer).__name__}) and its weights loaded into rotarium's; fla's kernels "
                            "need CUDA (dry run)")
        config_type = peer.config.model_type
        if config_type == "gated_deltanet" and fla_gated_backward_refused():
            with torch.no_grad(), torch.autocast(ctx.device, dtype=ctx.half):
                first = peer(**state["batch"]).loss.item()
            times: list[float] = []
            note = "not timed: fla refuses the gated delta rule's backward on Hopper with Triton < 3.7.1"
        else:
            first, step, _ = first_step(peer, state["batch"], ctx)
            if "step" in state:
                with ops_backend("auto"):
                    samples = time_steps(steps, rotarium=state["step"], fla=step)
            else:
                samples = time_steps(steps, fla=step)
            del step
            times = samples["fla"]
            note = speed(times, B * T, state.get("flops"), peak)
            if times and "rotarium" in samples:
                note += f", rotarium/fla time {paired_ratio(samples['rotarium'], times):.2f}x"
        if "loss" not in state:
            return "SKIP", f"{note}, first loss {first:.4f}; not compared: rotarium's row failed"
        err = abs(first - state["loss"]) / abs(state["loss"])
        return verdict(err < PEER_LOSS_TOL), (f"{note}, first loss {first:.4f} vs rotarium's: rel diff {err:.1e} "
                                              f"(tol {PEER_LOSS_TOL:.0e})")

    report.run(f"train {name} rotarium, {DTYPE_NAMES[ctx.half]} autocast, packed {B} x {T}", ours_row)
    report.run(f"train {name} rotarium, compiled blocks", compiled_row)
    report.run(f"train {name} fla's own model, same weights and batch", peer_row)
    state.clear()


def e2e_side(model: torch.nn.Module, data: dict, backend: str, ctx: Context) -> tuple[dict, Counter, Counter]:
    """One backend's run of a small model: losses and gradients (plain batch, packed documents, a few tokens from
    a cache), decoding step by step, the full forward; with the dispatches made with and without gradients."""
    device, P, D, C = ctx.device, data["prefill"], data["decode"], data["continue"]
    ids, packed, cu = data["ids"], data["packed"], data["cu_seqlens"]
    out: dict[str, torch.Tensor] = {}

    def grads() -> torch.Tensor:
        flat = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        return flat

    with ops_backend(backend), count_dispatches() as trained:
        model.train()
        model.zero_grad(set_to_none=True)
        for name, kwargs in (("batch", {"input_ids": ids, "labels": ids}),
                             ("packed", {"input_ids": packed, "labels": packed, "cu_seqlens": cu})):
            with torch.autocast(device, dtype=ctx.half):
                loss = model(**kwargs).loss
            loss.backward()
            out[f"{name} loss"], out[f"{name} grads"] = loss.detach(), grads()
        model.eval()
        with torch.no_grad(), torch.autocast(device, dtype=ctx.half):
            cache = getattr(model(ids[:, :P], use_cache=True), CACHE_FIELD)
        with torch.autocast(device, dtype=ctx.half):
            tail = ids[:, P:P + C]
            loss = model(tail, past_key_values=cache, use_cache=True, labels=tail).loss
        loss.backward()
        out["loss from cache"], out["grads from cache"] = loss.detach(), grads()
    with ops_backend(backend), count_dispatches() as inferred, torch.no_grad(), torch.autocast(device, dtype=ctx.half):
        out["full logits"] = model(ids[:, :P + D]).logits[:, P:].float()
        result = model(ids[:, :P], use_cache=True)
        cache, steps = getattr(result, CACHE_FIELD), []
        for t in range(P, P + D):
            result = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(result.logits.float())
            cache = getattr(result, CACHE_FIELD)
        out["decoded logits"] = torch.cat(steps, 1)
    return out, trained, inferred


def check_e2e(family: str, encoding: str, ctx: Context) -> tuple[str, str]:
    preset, overrides = FAMILY_ROWS[family]
    sizes = tiny_sizes(overrides, 1) if ctx.tiny else overrides | {"num_hidden_layers": 2, "vocab_size": 1024}
    config = preset_config(preset, **sizes, position_encoding=encoding)
    model = build_model(config, ctx.device)
    # tokens, packed documents (one of a single token), prefill, decoded tokens, tokens continued with gradients
    T, cu, P, D, C = (24, (0, 6, 7, 18, 24), 12, 3, 3) if ctx.tiny else (300, (0, 70, 71, 230, 300), 130, 10, 5)
    gen = torch.Generator().manual_seed(1)
    data = {"ids": torch.randint(0, config.vocab_size, (2, T), generator=gen).to(ctx.device),
            "packed": torch.randint(0, config.vocab_size, (1, cu[-1]), generator=gen).to(ctx.device),
            "cu_seqlens": torch.tensor(cu, dtype=torch.long, device=ctx.device),
            "prefill": P, "decode": D, "continue": C}
    fla_out, fla_trained, fla_inferred = e2e_side(model, data, "auto", ctx)
    torch_out, torch_trained, torch_inferred = e2e_side(model, data, "torch", ctx)
    errs = {name: rel_err(fla_out[name], torch_out[name]) for name in fla_out if name != "decoded logits"}
    # decoding on the fla path against the PyTorch path's full forward
    errs["decoded vs full"] = rel_err(fla_out["decoded logits"], torch_out["full logits"])
    good, text = judged(errs, MODEL_TOL)
    problems, known = [], []
    for calls, side, grad in ((fla_trained, "fla", True), (fla_inferred, "fla", False),
                              (torch_trained, "torch", True), (torch_inferred, "torch", False)):
        more_problems, more_known = check_dispatches(calls, side, ctx, ctx.half, grad)
        problems += more_problems
        known += [k for k in more_known if k not in known]
    return row_status(good, problems, known, text)


def check_no_host_sync(family: str, encoding: str, ctx: Context) -> tuple[str, str]:
    """A training forward and backward (unpadded batch, fla on ``auto``) under CUDA's sync debug mode set to raise:
    once fla's kernels are compiled, nothing in rotarium may read a device value (the CPU's proxy is the meta-device
    test, tests/models/test_meta_device.py)."""
    preset, overrides = FAMILY_ROWS[family]
    sizes = tiny_sizes(overrides, 1) if ctx.tiny else overrides | {"num_hidden_layers": 2, "vocab_size": 1024}
    config = preset_config(preset, **sizes, position_encoding=encoding)
    model = build_model(config, ctx.device).train()
    ids = torch.randint(0, config.vocab_size, (2, 24 if ctx.tiny else 300), device=ctx.device)

    def step() -> None:
        with torch.autocast(ctx.device, dtype=ctx.half):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    with ops_backend("auto"):
        step()  # compiling and autotuning fla's kernels synchronises
        if ctx.device != "cuda":
            return "PASS", "ran; the sync check itself needs CUDA (on CPU the meta-device tests stand in for it)"
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        except RuntimeError as error:
            return "FAIL", f"a host synchronisation: {str(error).splitlines()[0]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return "PASS", "training forward and backward made no host synchronisation"


# One training step of each family, the positional options spread over them (RoPE for a family not named here).
NO_SYNC_ENCODINGS = {"gla": "rope", "fox": "rove", "deltanet": "selective_rope", "transformer": "selective_rope"}
NO_SYNC_ROWS = tuple((family, NO_SYNC_ENCODINGS.get(family, "rope")) for family in FAMILY_MODELS)


def models_part(report: Report, ctx: Context, args: argparse.Namespace) -> None:
    # correctness first, so that a run cut short by --budget loses timings rather than checks
    for family, (_, overrides) in FAMILY_ROWS.items():
        for encoding in POSITION_ENCODINGS:
            extra = " (qk_norm, GQA)" if overrides.keys() >= QK_NORM_GQA.keys() else ""
            report.run(f"e2e {family}{extra} + {encoding}",
                       lambda family=family, encoding=encoding: check_e2e(family, encoding, ctx))
    for family, encoding in NO_SYNC_ROWS:
        report.run(f"no host sync {family} + {encoding}, training step",
                   lambda family=family, encoding=encoding: check_no_host_sync(family, encoding, ctx))
    for name, (preset, overrides) in PRESET_ROWS.items():
        check_training(name, preset, overrides, ctx, args, report)


# ------------------------------------------------------------------------------------------------------- main

def fla_problem() -> str | None:
    """Why fla's kernels cannot be imported here, or None."""
    try:
        importlib.import_module("fla.ops")
    except Exception as error:  # noqa: BLE001 - a broken triton install raises more than ImportError
        return f"{type(error).__name__}: {error}"
    return None


def header(ctx: Context, part: str) -> None:
    versions = [f"torch {torch.__version__}"]
    for module in ("triton", "fla"):
        try:
            versions.append(f"{module} {importlib.import_module(module).__version__}")
        except Exception:  # noqa: BLE001 - reported as missing
            versions.append(f"{module} missing")
    where = {"gpu": torch.cuda.get_device_name() if ctx.device == "cuda" else "",
             "dry-run": "CPU (dry run: fla replaced by the PyTorch path)",
             "interpret": "CPU (fla's Triton kernels run by Triton's interpreter)"}[ctx.mode]
    print(f"gpu_check --part {part}: {where}; {', '.join(versions)}; "
          f"TRITON_F32_DEFAULT={os.environ.get('TRITON_F32_DEFAULT', 'unset')}", flush=True)
    if ctx.mode == "gpu" and fla_gated_backward_refused():
        print("fla refuses the gated delta rule's backward on this GPU and Triton: those rows are KNOWN", flush=True)


def keep_first_autotune_config() -> None:
    """Every ``triton.autotune`` created from now on (fla's kernels are decorated when fla.ops is imported, so this
    runs before) keeps only its first configuration, so triton compiles one candidate instead of benchmarking all."""
    from triton.runtime import autotuner

    original = autotuner.Autotuner.__init__

    def first_only(self, fn, arg_names, configs, *args, **kwargs):
        original(self, fn, arg_names, configs[:1], *args, **kwargs)

    autotuner.Autotuner.__init__ = first_only


def run_fla_in_triton_interpreter() -> None:
    """fla's kernels from now on run on CPU tensors, each Triton program executed in numpy by Triton's interpreter:
    the very kernels a GPU runs, on the calls rotarium makes, though neither their speed nor their compilation.

    ``TRITON_INTERPRET=1`` must be set before triton is first imported (``triton.jit`` reads it when it decorates a
    function, triton's own library included, and importing torch imports triton), so main starts the script again with
    it. Before fla is imported, three adjustments: each autotuned kernel keeps its first configuration (the interpreter
    cannot time candidates); rotarium's backend accepts CPU tensors for fla; and a Python ``range`` loop inside a
    kernel yields Triton scalars, as it does when compiled, rather than the Python ints the interpreter gives (fla's
    kernels call ``.to`` on the loop index).
    """
    keep_first_autotune_config()
    import triton.language as tl
    from triton.runtime import interpreter

    from rotarium.ops import backend

    if not hasattr(interpreter, "_patch_lang") or not hasattr(interpreter, "_implicit_cvt"):
        raise RuntimeError(f"triton {importlib.import_module('triton').__version__}'s interpreter has no _patch_lang "
                           "or _implicit_cvt, which --interpret adjusts; run --dry-run instead")

    def scalar_range(start, stop=None, step=None, **_):
        start, stop = (0, start) if stop is None else (start, stop)
        for index in range(int(start), int(stop), 1 if step is None else int(step)):
            yield interpreter._implicit_cvt(index)

    patch_language = interpreter._patch_lang

    def patch_with_scalar_range(fn):
        scope = patch_language(fn)
        scope.set_attr(sys.modules[fn.__module__], "range", scalar_range)  # shadows the builtin inside the kernel
        scope.set_attr(tl, "range", scalar_range)
        return scope

    interpreter._patch_lang = patch_with_scalar_range
    backend.fla_device = lambda x: True  # main refuses to run when fla cannot be imported


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", required=True, choices=("ops", "models"))
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, fla replaced by the PyTorch path")
    mode.add_argument("--interpret", action="store_true",
                      help="CPU, tiny sizes, fla's Triton kernels run by Triton's interpreter (float16 for bfloat16)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds after which no new row starts (default: 180 on a GPU, none on CPU)")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="run only the rows whose name contains TEXT (may be given several times)")
    parser.add_argument("--table", default=None, help="also write the final table to this file")
    parser.add_argument("--T", type=int, default=4096, help="ops: tokens of the timing rows")
    parser.add_argument("--repeats", type=int, default=3, help="ops: timed rounds per timing row")
    parser.add_argument("--batch", type=int, default=4, help="models: sequences per training step")
    parser.add_argument("--seq-len", type=int, default=2048, help="models: tokens per sequence")
    parser.add_argument("--steps", type=int, default=3, help="models: timed training steps after the first")
    parser.add_argument("--autotune", choices=("full", "first"), default="full",
                        help="full: triton autotunes fla's kernels (compiling every candidate configuration, minutes "
                             "per kernel on a fresh machine); first: each kernel keeps its first configuration, which "
                             "changes speed, not results, and leaves time for the correctness rows")
    args = parser.parse_args()
    for name in ("T", "repeats", "batch", "seq_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.steps < 0:
        parser.error(f"--steps must be at least 0, got {args.steps}")
    if args.part == "ops":
        # Before fla compiles a kernel (triton reads it then): fla's float32 matmuls in IEEE precision, as the
        # PyTorch path's (whose CUDA matmuls must not use TF32 either).
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    ctx = Context("cuda", "gpu")
    if args.dry_run or args.interpret:
        ctx = Context("cpu", "dry-run" if args.dry_run else "interpret")
    if ctx.interpreted:
        if os.environ.get("TRITON_INTERPRET") != "1":
            os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "TRITON_INTERPRET": "1"})
        run_fla_in_triton_interpreter()  # before anything imports fla
    elif args.autotune == "first" and ctx.mode == "gpu" and torch.cuda.is_available():
        keep_first_autotune_config()  # before anything imports fla
    if not ctx.dry_run:
        if ctx.mode == "gpu" and not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; --dry-run checks the script on CPU", flush=True)
            sys.exit(2)
        problem = fla_problem()
        if problem is not None:
            print(f"gpu_check: fla cannot be imported ({problem}); install flash-linear-attention (or put its wheel "
                  "on PYTHONPATH) and rerun: every row compares fla with the PyTorch path", flush=True)
            sys.exit(2)
    header(ctx, args.part)
    report = Report(args.budget if args.budget is not None else (180.0 if ctx.mode == "gpu" else math.inf), args.only)
    (ops_part if args.part == "ops" else models_part)(report, ctx, args)
    flag = "" if ctx.mode == "gpu" else f" --{ctx.mode}"
    sys.exit(report.table(f"gpu_check --part {args.part}{flag}", args.table))


if __name__ == "__main__":
    main()
