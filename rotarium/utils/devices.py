"""The ``--device`` flags of the commands: a name checked where it enters, so that a machine without the device
stops the command with one line instead of a traceback from deep inside the first tensor moved there."""
from __future__ import annotations

import torch


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
