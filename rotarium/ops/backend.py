"""Chooses between fla's Triton kernels and rotarium's PyTorch kernels.

``backend`` (an op's keyword argument) or the environment variable
``ROTARIUM_OPS_BACKEND`` is one of ``"auto"`` (default: fla on CUDA tensors
when fla and triton work, PyTorch otherwise), ``"torch"`` or ``"fla"``.
"""
from __future__ import annotations

import functools
import importlib
import os

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


def use_fla(backend: str | None, x: torch.Tensor) -> bool:
    """Whether the call with input ``x`` goes to fla's kernel."""
    choice = requested_backend(backend)
    if choice == "torch":
        return False
    ok = x.is_cuda and fla_available()
    if choice == "fla" and not ok:
        raise ValueError(
            "backend 'fla' was forced but fla's Triton kernels cannot run here "
            f"(inputs on {x.device}, CUDA available: {torch.cuda.is_available()}); use backend 'auto' or 'torch'"
        )
    return ok
