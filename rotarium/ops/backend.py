"""Chooses between fla's Triton kernels and rotarium's PyTorch kernels, and records which one ran.

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
from collections.abc import Iterator

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


FLA_MAX_HEAD_DIM = 256


def head_dim_limit(op: str, **dims: int) -> str | None:
    """The reason fla's ``op`` cannot take heads of these sizes (its kernels assert head sizes up to
    FLA_MAX_HEAD_DIM), or None."""
    too_big = {name: size for name, size in dims.items() if size > FLA_MAX_HEAD_DIM}
    if not too_big:
        return None
    sizes = ", ".join(f"{name} = {size}" for name, size in too_big.items())
    return f"fla's {op} supports head sizes up to {FLA_MAX_HEAD_DIM}, got {sizes}"

logger = logging.getLogger("rotarium.ops")
_active_counters: list[Counter] = []


def dispatch(op: str, to_fla: bool) -> bool:
    """Records that ``op`` runs on fla (``to_fla``) or on the PyTorch path, and returns ``to_fla``; every op routes
    through it: ``if dispatch("chunk_gla", use_fla(backend, q)): ...``."""
    backend = "fla" if to_fla else "torch"
    for counter in _active_counters:
        counter[(op, backend)] += 1
    if logger.isEnabledFor(logging.DEBUG):
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
