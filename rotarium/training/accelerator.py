"""The trainer's :class:`accelerate.Accelerator`: devices, mixed precision and the process group of a launch.

On a GPU everything is accelerate's own. Without an accelerator two things need a hand:

- ``cpu=True`` is what makes accelerate join the processes of a launch over gloo (a config with
  ``distributed_type: MULTI_GPU`` starts them with torchrun, which is how rotarium's CPU configs launch).
- accelerate enables FSDP only for accelerator devices and otherwise drops the launch's FSDP plugin, although
  PyTorch's FSDP 2 (``fully_shard``) shards, gathers and checkpoints on CPU tensors over gloo. So when a launch asks
  for FSDP (``ACCELERATE_USE_FSDP``, as ``rotarium/configs/accelerate/fsdp_cpu.yaml`` does) on CPU processes, the
  plugin is put back: the run then goes through accelerate's FSDP 2 path (``prepare`` wrapping each ``Block``,
  sharded ``save_state`` / ``load_state``, the gathered ``get_state_dict``) exactly as on GPUs, which is what lets a
  CPU test stand for a GPU cluster.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rotarium.training.config import TrainSection
from rotarium.utils.devices import BF16_MATMUL_FLAGS, cpu_bf16_matmul, read_cpuinfo

if TYPE_CHECKING:
    from accelerate import Accelerator


def has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return accelerator.current_accelerator() is not None
    return torch.cuda.is_available()


def resolve_precision(mixed_precision: str) -> str:
    """``auto``: bf16 where the GPU supports it, else full precision."""
    if mixed_precision != "auto":
        return mixed_precision
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def report_cpu_bf16(cpuinfo: str | None) -> None:
    """For ``train.mixed_precision: bf16`` on a CPU whose flags are ``cpuinfo`` (the text of /proc/cpuinfo, None
    where there is none): prints which bf16 matmul instructions the run's autocast uses, or warns where the CPU has
    none, since autocast then makes a step slower than in float32, not faster."""
    instructions = cpu_bf16_matmul(cpuinfo)
    if instructions is not None:
        print(f"bf16 autocast on CPU: {instructions} matmul")
        return
    known = " or ".join(f"{name} ({flag})" for flag, name in BF16_MATMUL_FLAGS.items())
    found = "its flags in /proc/cpuinfo show none" if cpuinfo is not None else "no /proc/cpuinfo to tell"
    warnings.warn(f"train.mixed_precision bf16 on a CPU without bf16 matmul instructions ({known}; {found}): "
                  f"PyTorch then converts the bf16 operands of every matmul to float32 and the results back, so a "
                  f"step is slower than in float32, not faster; `--train.mixed_precision no` trains in float32",
                  RuntimeWarning, stacklevel=3)


def fsdp_requested() -> bool:
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")


def make_accelerator(train: TrainSection, project_dir: str | os.PathLike) -> Accelerator:
    """The accelerator of a run from its ``train`` section and the launch's environment (see the module docstring)."""
    from accelerate import Accelerator

    precision = resolve_precision(train.mixed_precision)
    on_cpu = not has_accelerator()
    try:
        accelerator = Accelerator(mixed_precision=precision, log_with=train.report_to or None,
                                  project_dir=str(Path(project_dir)), cpu=on_cpu)
    except ValueError as error:
        if "already been initialized" not in str(error):
            raise
        # accelerate keeps one precision per process: an earlier trainer here (TRL's configs default to bf16) set it
        from accelerate.state import AcceleratorState

        raise ValueError(
            f"train.mixed_precision={train.mixed_precision!r} needs accelerate's {precision!r}, but an earlier "
            f"trainer in this Python process set {AcceleratorState().mixed_precision!r}, which accelerate keeps for "
            "the whole process: run `rotarium train` in a process of its own, or reset accelerate's state first "
            "(accelerate.state.AcceleratorState._reset_state(reset_partial_state=True))") from None
    if on_cpu and precision == "bf16" and accelerator.is_main_process:
        report_cpu_bf16(read_cpuinfo())
    if on_cpu and fsdp_requested() and accelerator.num_processes > 1:
        _enable_fsdp_on_cpu(accelerator, precision)
    return accelerator


def _enable_fsdp_on_cpu(accelerator, precision: str) -> None:
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # from the launch's FSDP_* environment, as accelerate builds it
    if plugin.fsdp_version != 2:
        raise ValueError(f"FSDP on CPU processes needs `fsdp_version: 2` in the accelerate config (it has "
                         f"{plugin.fsdp_version}); FSDP 1 runs on GPUs only")
    if precision != "no":
        plugin.set_mixed_precision(precision)
    state = AcceleratorState()
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
