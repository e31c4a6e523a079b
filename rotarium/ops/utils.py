"""Input validation, packing and chunk layouts shared by every op, and when a fused op may read a layer's weights
(:func:`plain_linear`).

Validation happens here, at the op boundary, so that a wrong shape or a bad
``cu_seqlens`` fails with a message naming the argument instead of an opaque
broadcasting error deep inside a kernel.
"""
from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.nn.modules import module as _module

# Value checks (positive log decays, cu_seqlens contents) read tensor values. On CPU that is free; on CUDA each read
# is a host-device synchronisation that stalls the launch queue, so there they are off unless asked for:
# ROTARIUM_OPS_VALUE_CHECKS=1 turns them on everywhere, =0 off everywhere.
_VALUE_CHECKS_ENV = os.environ.get("ROTARIUM_OPS_VALUE_CHECKS")
VALUE_CHECKS = _VALUE_CHECKS_ENV != "0"


def checks_values(x: torch.Tensor) -> bool:
    """Whether the value checks read ``x``: by default only where that costs no synchronisation (CPU tensors), and
    never while torch.compile traces, where a read would split the graph (the kernels that enter a graph as one
    operator, :mod:`rotarium.ops.opaque`, still check when they run)."""
    if not VALUE_CHECKS or torch.compiler.is_compiling():
        return False
    if _VALUE_CHECKS_ENV == "1":
        return x.device.type != "meta"
    return x.device.type == "cpu"


# The hooks of every module call (torch.nn.modules.module's register_module_forward_hook and its kin)
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def plain_linear(module: nn.Module) -> bool:
    """Whether a fused op may read ``module``'s ``weight`` and ``bias`` in place of calling it: it is exactly an
    ``nn.Linear`` (not a PEFT LoRA layer, a quantised linear or a parametrised one), its tensors are plain, and
    nothing would run around its call (hooks of its own or of every module, a replaced ``forward`` such as
    accelerate's). Anything else changes what the module computes, so the caller must call it."""
    if type(module) is not nn.Linear or "forward" in vars(module):
        return False
    if any((module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)):
        return False
    if any(getattr(_module, name, None) for name in _GLOBAL_HOOKS):
        return False
    return all(type(tensor) in (torch.Tensor, nn.Parameter) for tensor in (module.weight, module.bias)
               if tensor is not None)


def float32_internals(fn: Callable) -> Callable:
    """Runs a PyTorch-path kernel with autocast off for its inputs' device.

    The kernels cast their inputs to float32 and are designed around float32 products: under autocast (accelerate's
    bf16 mixed precision) their chunk matmuls would run in bfloat16, rounding the recurrent state at every chunk, and
    the CPU's triangular solve has no bfloat16 kernel at all. Outputs keep the dtype of v, as without autocast.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device_type = next(a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        if not _autocast_enabled(device_type):
            return fn(*args, **kwargs)
        with torch.autocast(device_type, enabled=False):
            return fn(*args, **kwargs)

    return wrapper


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (meta): nothing to turn off
        return False


def multiply_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out = a * b``, returned. Eager: written in place (``torch.mul(out=)`` allocates nothing). Under
    ``torch.compile``, which refuses an ``out=`` that is a strided view: as a copy of the product, which the compiler
    fuses into one loop."""
    if torch.compiler.is_compiling():
        return out.copy_(a * b)
    return torch.mul(a, b, out=out)


def check_tensor(name: str, x: torch.Tensor, ndim: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        # a ValueError like every input error of an op, so that callers catch one type
        raise ValueError(f"`{name}` must be a torch.Tensor of shape {layout}, got {type(x).__name__}")  # noqa: TRY004
    if x.ndim != ndim:
        raise ValueError(f"`{name}` must have shape {layout} ({ndim} dims), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"`{name}` must be a floating-point tensor, got dtype {x.dtype}")


def check_dims(name: str, x: torch.Tensor, expected: Sequence[int | None], layout: str) -> None:
    """``expected`` holds the required size of each dim, None for free dims."""
    for dim, (actual, want) in enumerate(zip(x.shape, expected)):
        if want is not None and actual != want:
            raise ValueError(
                f"`{name}` must have shape {layout} = {tuple('*' if w is None else w for w in expected)}, "
                f"got {tuple(x.shape)} (dim {dim} is {actual}, expected {want})"
            )


def check_same_device(ref_name: str, ref: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    for name, x in tensors.items():
        if x is not None and x.device != ref.device:
            raise ValueError(f"`{name}` is on {x.device} but `{ref_name}` is on {ref.device}; put them on one device")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    items = list(tensors.items())
    ref_name, ref = items[0]
    for name, x in items[1:]:
        if x.dtype != ref.dtype:
            raise ValueError(f"`{name}` has dtype {x.dtype} but `{ref_name}` has {ref.dtype}; use one dtype for both")


def check_log_decay(name: str, g: torch.Tensor | None) -> None:
    if g is None or not checks_values(g):
        return
    if bool((g > 0).any()):
        raise ValueError(
            f"`{name}` is a log decay and must be <= 0 everywhere (e.g. logsigmoid of a gate), "
            f"got a maximum of {g.max().item():.4g}"
        )


def check_cu_seqlens(cu_seqlens: torch.Tensor | None, batch_size: int, seq_len: int, device: torch.device,
                     cu_seqlens_cpu: torch.Tensor | None = None) -> None:
    """Shapes always; values from the host copy ``cu_seqlens_cpu`` when given, else where :func:`checks_values`."""
    if cu_seqlens is None:
        return
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.is_floating_point():
        raise ValueError("`cu_seqlens` must be a 1-D integer tensor [N+1] of cumulative sequence lengths")
    if cu_seqlens.numel() < 2:
        raise ValueError("`cu_seqlens` must hold at least two entries [0, T]")
    if batch_size != 1:
        raise ValueError(
            f"with `cu_seqlens` the inputs must be packed into a batch of size 1, got batch size {batch_size}; "
            "flatten the sequences along time first"
        )
    if cu_seqlens.device != device:
        raise ValueError(f"`cu_seqlens` is on {cu_seqlens.device} but the inputs are on {device}")
    if cu_seqlens_cpu is not None:
        if cu_seqlens_cpu.shape != cu_seqlens.shape or cu_seqlens_cpu.device.type != "cpu":
            raise ValueError(f"`cu_seqlens_cpu` must be a CPU copy of `cu_seqlens` (shape {tuple(cu_seqlens.shape)}), "
                             f"got shape {tuple(cu_seqlens_cpu.shape)} on {cu_seqlens_cpu.device}")
        source = cu_seqlens_cpu
    elif checks_values(cu_seqlens):
        source = cu_seqlens
    else:
        return
    if not VALUE_CHECKS:
        return
    values = source.tolist()
    if values[0] != 0:
        raise ValueError(f"`cu_seqlens` must start at 0, got {values[0]}")
    if any(b < a for a, b in itertools.pairwise(values)):
        raise ValueError(f"`cu_seqlens` must be non-decreasing, got {values}")
    if values[-1] != seq_len:
        raise ValueError(f"`cu_seqlens` must end at the packed length T={seq_len}, got {values[-1]}")


def check_initial_state(
    initial_state: torch.Tensor | None, num_states: int, num_heads: int, key_dim: int, value_dim: int,
    device: torch.device,
) -> None:
    if initial_state is None:
        return
    layout = "[N, H, K, V]"
    check_tensor("initial_state", initial_state, 4, layout)
    check_dims("initial_state", initial_state, (num_states, num_heads, key_dim, value_dim), layout)
    check_same_device("q", torch.empty(0, device=device), initial_state=initial_state)


def document_index(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[T]`` int64: the packed sequence each token belongs to, from ``cu_seqlens`` ``[N + 1]`` (of empty sequences,
    which share their start with the next one, the last). A search rather than ``repeat_interleave``: under
    ``torch.compile`` that specialises on whether N is 1, which would compile a block again."""
    cu = cu_seqlens.long()
    return torch.searchsorted(cu, torch.arange(seq_len, device=cu.device), right=True) - 1


def document_offsets(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[1, T]`` int64: each packed token's index inside its own sequence, from ``cu_seqlens`` ``[N + 1]``."""
    cu = cu_seqlens.long()
    return (torch.arange(seq_len, device=cu.device) - cu[document_index(cu, seq_len)]).unsqueeze(0)


class Packing:
    """Turns a packed batch ``[1, T, ...]`` with ``cu_seqlens`` into a padded batch ``[N, T_max, ...]``.

    Padding goes at the end of each sequence, with zeros. The PyTorch kernels
    rely on that: a zero key with a zero log decay (and zero beta) leaves a
    recurrent state unchanged, and causal attention never looks forward, so
    padded positions change neither the outputs nor the final states.
    """

    def __init__(self, cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None = None):
        bounds = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
        lengths = (bounds[1:] - bounds[:-1]).tolist()
        self.num_seqs = len(lengths)
        self.max_len = max(max(lengths), 1)
        device = cu_seqlens.device
        offsets = torch.arange(self.max_len, device=device)
        lens = torch.tensor(lengths, device=device)
        self.valid = offsets[None, :] < lens[:, None]  # [N, T_max]
        self.index = (cu_seqlens[:-1, None] + offsets[None, :])[self.valid]  # packed position of each valid slot

    def pad(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """``[1, T, ...]`` -> ``[N, T_max, ...]``."""
        if x is None:
            return None
        out = x.new_zeros(self.num_seqs, self.max_len, *x.shape[2:])
        out[self.valid] = x[0, self.index]
        return out

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, T_max, ...]`` -> ``[1, T, ...]``."""
        return x[self.valid].unsqueeze(0)


def run_packed(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    cu_seqlens: torch.Tensor | None,
    sequence_args: dict[str, torch.Tensor | None],
    cu_seqlens_cpu: torch.Tensor | None = None,
    **other_args,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Calls ``fn(**sequence_args, **other_args)`` with each packed sequence as its own batch row."""
    if cu_seqlens is None:
        return fn(**sequence_args, **other_args)
    packing = Packing(cu_seqlens, cu_seqlens_cpu)
    padded = {name: packing.pad(x) for name, x in sequence_args.items()}
    o, final_state = fn(**padded, **other_args)
    return packing.unpad(o), final_state


def pad_time(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pads dim 1 (time) of ``[B, T, ...]`` up to a multiple of ``multiple``."""
    pad = (-x.shape[1]) % multiple
    if pad == 0:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)


# Chunk-heads per block of the chunked PyTorch kernels: a block's state-free work stays in cache until its part of
# the scan consumes it, where a pass over whole long inputs would run at memory speed; this keeps the time linear in
# T, which benchmarks/ops.py checks.
BLOCK_CHUNK_HEADS = 128


def to_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[B, T, H, *D]`` -> chunk-major ``[n, B*H, chunk, *D]``, contiguous, zero-padded at the end (n >= 1)."""
    B, T, H = x.shape[:3]
    x = pad_time(x, chunk) if T > 0 else x.new_zeros(B, chunk, *x.shape[2:])
    n = x.shape[1] // chunk
    x = x.view(B, n, chunk, H, *x.shape[3:]).transpose(2, 3).transpose(0, 1)
    return x.reshape(n, B * H, chunk, *x.shape[4:]).contiguous()


def time_blocks(chunk: int, *xs: torch.Tensor | None) -> Iterator[tuple[torch.Tensor | None, ...]]:
    """Cuts ``[B, T, H, *D]`` tensors along time into blocks of about BLOCK_CHUNK_HEADS chunk-heads and yields each
    in the chunk-major layout of :func:`to_chunks`. None entries stay None in every block.

    Lazily: each block is laid out just before the caller uses it, so the copy is still in cache when the block's
    matmuls read it, and no full-size chunk-major copy of an input (nor of its gradient) is ever made (see
    :mod:`rotarium.ops` on allocation). ``split``, not slicing: autograd joins the blocks' gradients with one cat
    instead of a zero-filled full-size gradient per block.
    """
    ref = next(x for x in xs if x is not None)
    B, T, H = ref.shape[:3]
    tokens = max(1, BLOCK_CHUNK_HEADS // (B * H)) * chunk
    if T <= tokens:
        yield tuple(None if x is None else to_chunks(x, chunk) for x in xs)
        return
    pieces = [x.split(tokens, dim=1) if x is not None else None for x in xs]
    for i in range(-(-T // tokens)):
        yield tuple(None if p is None else to_chunks(p[i], chunk) for p in pieces)


def join_time_blocks(outputs: list[torch.Tensor], batch_size: int, seq_len: int) -> torch.Tensor:
    """Inverse of :func:`time_blocks` for the blocks' ``[m, B*H, C, V]`` outputs: ``[B, T, H, V]``, padding dropped.

    One copy: the blocks go back to time-major order as they are concatenated.
    """
    views = []
    for o in outputs:
        m, BH, C, V = o.shape
        views.append(o.view(m, batch_size, BH // batch_size, C, V).permute(1, 0, 3, 2, 4))  # [B, m, C, H, V]
    o = views[0].contiguous() if len(views) == 1 else torch.cat(views, dim=1)
    o = o.view(batch_size, -1, *o.shape[3:])
    return o if o.shape[1] == seq_len else o[:, :seq_len]
