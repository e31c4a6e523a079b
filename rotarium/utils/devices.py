"""The ``--device`` flags of the commands: a name checked where it enters, so that a machine without the device
stops the command with one line instead of a traceback from deep inside the first tensor moved there; and what the
CPU can do in bfloat16 (:func:`cpu_bf16_matmul`)."""
from __future__ import annotations

from pathlib import Path

import torch

# The CPU flags (as Linux's /proc/cpuinfo spells them) of instructions that multiply bfloat16 matrices, best first,
# and their names. Without one, PyTorch's CPU kernels convert bf16 operands to float32 for the products, so a bf16
# matmul costs a float32 one plus the conversions.
BF16_MATMUL_FLAGS = {"amx_bf16": "AMX", "avx512_bf16": "AVX-512 BF16", "bf16": "Arm BF16"}
CPUINFO = Path("/proc/cpuinfo")


def check_device(name: str, flag: str = "--device") -> torch.device:
    """``name`` (``cpu``, ``cuda``, ``cuda:1``, ``mps``, ...) as a ``torch.device`` this process can use; raises
    ``ValueError`` naming ``flag`` when it is not a device name or this machine has no such device."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"{flag} {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag} {name}: this machine has no CUDA device that PyTorch can use (torch "
                             f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered "
                             f"from 0")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{flag} {name}: MPS is not available on this machine; use --device cpu")
    return device


def read_cpuinfo() -> str | None:
    """The text of /proc/cpuinfo, or None where there is none (not Linux) or it cannot be read."""
    try:
        return CPUINFO.read_text(errors="replace")
    except OSError:
        return None


def cpu_bf16_matmul(cpuinfo: str | None) -> str | None:
    """The name of the CPU's bfloat16 matrix instructions ("AMX", "AVX-512 BF16", "Arm BF16") from the flags of
    ``cpuinfo`` (the text of /proc/cpuinfo: x86's ``flags`` lines, Arm's ``Features``), or None where they show
    none (or ``cpuinfo`` is None)."""
    flags: set[str] = set()
    for line in (cpuinfo or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return next((name for flag, name in BF16_MATMUL_FLAGS.items() if flag in flags), None)
