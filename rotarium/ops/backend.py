"""Chooses between fla's Triton kernels and rotarium's PyTorch kernels, and records which one ran; holds the table
of what fla's kernels can do (:data:`FLA_KERNELS`), which the ops and the mixers consult.

``backend`` (an op's keyword argument) or the environment variable
``ROTARIUM_OPS_BACKEND`` is one of ``"auto"`` (default: fla on CUDA tensors
when fla and triton work, PyTorch otherwise), ``"torch"`` or ``"fla"``.

Every op call records the backend it ran on: :func:`count_dispatches` collects them (e.g. to check that a GPU run
really used fla's kernels), and the logger ``rotarium.ops`` reports each at DEBUG level.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

BACKENDS = ("auto", "torch", "fla")
ENV_VAR = "ROTARIUM_OPS_BACKEND"


@functools.cache
def fla_available() -> bool:
    """True when fla's Triton kernels can run here (a CUDA device, triton and fla importable)."""
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("triton")
        importlib.import_module("fla.ops")
    except Exception:  # noqa: BLE001  (a broken triton install raises more than ImportError)
        return False
    return True


def requested_backend(backend: str | None) -> str:
    choice = backend if backend is not None else os.environ.get(ENV_VAR, "auto")
    if choice not in BACKENDS:
        source = "`backend`" if backend is not None else f"the environment variable {ENV_VAR}"
        raise ValueError(f"{source} must be one of {BACKENDS}, got {choice!r}")
    return choice


def fla_device(x: torch.Tensor) -> bool:
    """Whether fla's kernels can take ``x``: a CUDA tensor where fla works. (Tests that exercise the fla calls
    without a GPU replace this function.)"""
    return x.is_cuda and fla_available()


def use_fla(backend: str | None, x: torch.Tensor, unsupported: str | None = None) -> bool:
    """Whether the call with input ``x`` goes to fla's kernel.

    ``unsupported``: why fla's kernel cannot take this particular call (a shape or dtype it asserts against), or
    None. Such a call runs the PyTorch path on ``"auto"``, with a warning once per reason, and raises on a forced
    ``"fla"``.
    """
    choice = requested_backend(backend)
    if choice == "torch":
        return False
    ok = fla_device(x)
    if choice == "fla" and not ok:
        raise ValueError(
            "backend 'fla' was forced but fla's Triton kernels cannot run here "
            f"(inputs on {x.device}, CUDA available: {torch.cuda.is_available()}); use backend 'auto' or 'torch'"
        )
    if ok and unsupported is not None:
        if choice == "fla":
            raise ValueError(f"backend 'fla' was forced but {unsupported}; use backend 'auto' or 'torch'")
        _warn_once(f"{unsupported}; running rotarium's PyTorch implementation for these calls instead")
        return False
    return ok


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=4)


# What fla can do, and in which configuration, as rotarium calls it. Every fact about particular fla and Triton
# releases that the code depends on sits here, beside the table; the ops and layers consult the table and state only
# their own reasons. Read from fla 0.6.0:
# - its chunked delta rules, parallel attention and attention decoding assert head sizes up to FLA_MAX_HEAD_DIM;
# - its plain chunked delta rule asserts against float32 inputs (the gated one takes them);
# - its step-wise gated delta rule has no backward (it raises), and its step-wise plain delta rule's backward writes
#   the initial state's gradient into a buffer it allocates only where that state requires a gradient;
# - its one-step attention decoding serves one query per sequence and has no backward;
# - on NVIDIA Hopper GPUs with Triton >= 3.4 and < 3.7.1 it raises in the gated delta rule's backward (a Triton
#   miscompilation of its gated ``chunk_bwd_dqkwg`` kernel, fla issue #640) unless tilelang is installed, which
#   runs that kernel instead; fla sets the flags IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0 and TRITON_ABOVE_3_7_1 for
#   this check, and an fla without them has no such guard (:func:`fla_gated_backward_refused`).
FLA_MAX_HEAD_DIM = 256


def head_dim_limit(op: str, max_head_dim: int = FLA_MAX_HEAD_DIM, **dims: int) -> str | None:
    """The reason fla's ``op`` cannot take heads of these sizes (its kernels assert head sizes up to
    ``max_head_dim``), or None."""
    too_big = {name: size for name, size in dims.items() if size > max_head_dim}
    if not too_big:
        return None
    sizes = ", ".join(f"{name} = {size}" for name, size in too_big.items())
    return f"fla's {op} supports head sizes up to {max_head_dim}, got {sizes}"


GATED_BACKWARD_REFUSAL = (
    "fla refuses the gated delta rule's backward on Hopper GPUs with Triton >= 3.4 and < 3.7.1; running "
    "rotarium's PyTorch implementation for it (upgrade Triton to >= 3.7.1 or install tilelang for fla's kernels)"
)


@functools.cache
def fla_gated_backward_refused() -> bool:
    """Whether fla refuses the gated delta rule's backward here (see the facts above :data:`FLA_KERNELS`)."""
    import importlib.util

    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:  # an fla without these flags has no such guard
        return False
    if importlib.util.find_spec("tilelang") is not None:
        return False
    return bool(IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1)


@dataclass(frozen=True)
class FlaKernel:
    """One of fla's kernels as rotarium calls it: what inputs it takes and whether rotarium trains through it.

    A call outside what it takes runs rotarium's PyTorch path on ``"auto"`` (with a warning where :meth:`refusal`
    gives a reason) and fails on a forced ``"fla"``.
    """

    label: str
    """How reasons name the kernel."""
    max_head_dim: int | None = None
    """The largest head size its kernels take (they assert it); None where they take any."""
    float32: bool = True
    """Whether it takes float32 inputs."""
    max_queries: int | None = None
    """The most queries per sequence it serves (decoding kernels); None for any number."""
    backward: str | None = None
    """Why rotarium never trains through it; None where it trains."""
    backward_refused: Callable[[], bool] | None = None
    """Whether fla refuses its backward in this configuration (fla and Triton versions, GPU); None: never."""
    backward_refusal: str | None = None
    """The warning of a call that would train where ``backward_refused``."""

    def refusal(self, q: torch.Tensor) -> str | None:
        """Why the kernel cannot take queries like ``q`` ``[..., K]`` (their head size, their dtype; the loss's
        inputs ``[N, D]`` where it has no head size limit), or None."""
        if self.max_head_dim is not None:
            reason = head_dim_limit(self.label, self.max_head_dim, K=q.shape[-1])
            if reason is not None:
                return reason
        if not self.float32 and q.dtype == torch.float32:
            return (f"fla's {self.label} does not support float32 inputs (cast q, k, v to bfloat16 or float16 to use "
                    "fla's Triton kernel)")
        return None

    @property
    def trains(self) -> bool:
        """Whether rotarium may call it where gradients flow (wherever fla does not refuse its backward)."""
        return self.backward is None

    def serves(self, queries: int, needs_grad: bool) -> bool:
        """Whether it serves a call with ``queries`` queries per sequence that does (``needs_grad``) or does not
        record gradients."""
        if self.max_queries is not None and queries > self.max_queries:
            return False
        return self.trains or not needs_grad


_STEP_WISE_INFERENCE = "fla's step-wise {} kernel is for inference: {}"

FLA_KERNELS: dict[str, FlaKernel] = {
    # keyed by fla's function name; the rotarium op of the same name calls it (parallel_forgetting_attn calls
    # parallel_attn when it has no gate, forgetting_attn_with_cache calls attn_decoding_one_step)
    "chunk_gla": FlaKernel("chunk_gla"),
    "fused_recurrent_gla": FlaKernel("fused_recurrent_gla"),
    "chunk_delta_rule": FlaKernel("chunk_delta_rule", max_head_dim=FLA_MAX_HEAD_DIM, float32=False),
    "chunk_gated_delta_rule": FlaKernel(
        "chunk_gated_delta_rule", max_head_dim=FLA_MAX_HEAD_DIM, backward_refused=fla_gated_backward_refused,
        backward_refusal=GATED_BACKWARD_REFUSAL),
    "fused_recurrent_delta_rule": FlaKernel(
        "fused_recurrent_delta_rule",
        backward=_STEP_WISE_INFERENCE.format(
            "delta rule", "its backward writes a gradient of the initial state that it allocates only where that "
            "state requires one")),
    "fused_recurrent_gated_delta_rule": FlaKernel(
        "fused_recurrent_gated_delta_rule",
        backward=_STEP_WISE_INFERENCE.format("gated delta rule", "it raises in backward")),
    "parallel_forgetting_attn": FlaKernel("parallel attention", max_head_dim=FLA_MAX_HEAD_DIM),
    "parallel_attn": FlaKernel("parallel attention", max_head_dim=FLA_MAX_HEAD_DIM),
    "attn_decoding_one_step": FlaKernel(
        "attn_decoding_one_step", max_head_dim=FLA_MAX_HEAD_DIM, max_queries=1,
        backward="fla's attention decoding kernel has no backward"),
    "fused_linear_cross_entropy_loss": FlaKernel("fused_linear_cross_entropy_loss"),
}
"""What each of fla's kernels that rotarium calls can do; see :class:`FlaKernel` for the columns."""

logger = logging.getLogger("rotarium.ops")
_active_counters: list[Counter] = []


def record_backend(op: str, to_fla: bool) -> bool:
    """Records that ``op`` runs on fla (``to_fla``) or on the PyTorch path, and returns ``to_fla``; every op routes
    through it: ``if record_backend("chunk_gla", use_fla(backend, q)): ...``."""
    backend = "fla" if to_fla else "torch"
    for counter in _active_counters:
        counter[(op, backend)] += 1
    # torch.compile traces no logging call (it would break the graph); a compiled op logs nothing while it is traced
    if not torch.compiler.is_compiling() and logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s ran on %s", op, backend)
    return to_fla


@contextlib.contextmanager
def count_dispatches() -> Iterator[Counter]:
    """Counts the op calls made inside the block, keyed by ``(op name, backend)``::

        with count_dispatches() as calls:
            model(ids).loss.backward()
        assert calls[("chunk_gla", "fla")] > 0
    """
    counter: Counter = Counter()
    _active_counters.append(counter)
    try:
        yield counter
    finally:
        _active_counters.remove(counter)
