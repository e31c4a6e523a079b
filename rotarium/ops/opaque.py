"""The token mixers' kernels as single operators of a ``torch.compile`` graph (``train.compile``).

Dynamo cannot trace into them: the PyTorch kernels choose their path from the values of the gates, cut packed
batches by the values of ``cu_seqlens`` and loop over a number of chunks that depends on T; fla's Triton kernels are
marked ``torch.compiler.disable``. Traced, each would break the graph, and each new T or number of packed documents
would compile again. So a kernel marked :func:`opaque_to_compiler` enters the graph as one call of the custom
operator ``rotarium_ops_opaque::kernel``, whose output shapes the kernel states symbolically (the compiled block then
takes any T and any number of documents), and runs exactly as in eager mode when the compiled graph reaches it.

Backward: the kernels get their gradients from autograd's graph of their own operations, which no operator can hand
across the graph's boundary. ``rotarium_ops_opaque::kernel_backward`` runs the kernel again under autograd and
differentiates that, as activation checkpointing would: the compiled step pays one more forward of each kernel, in
exchange for fused code around it. Outside ``torch.compile`` nothing of this runs: the decorated function is called
as it is.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch
from torch._C import DispatchKey

FunctionT = TypeVar("FunctionT", bound=Callable[..., Any])


class Output(NamedTuple):
    """One tensor a kernel returns, as its output function states it: shape (symbolic sizes welcome) and dtype."""

    shape: Sequence[int | torch.SymInt]
    dtype: torch.dtype


OutputSpec = Output | tuple[Output | None, ...]


@dataclass(frozen=True)
class _Kernel:
    fn: Callable[..., Any]
    outputs: Callable[..., OutputSpec]
    defaults: dict[str, Any]
    names: tuple[str, ...]


_KERNELS: dict[str, _Kernel] = {}
# The operators' namespace is this module's name, so that a copy of it (a checkpoint's remote code, loaded beside
# rotarium) registers operators of its own, which read its own table of kernels.
_NAMESPACE = __name__.replace(".", "_")


def opaque_to_compiler(outputs: Callable[..., OutputSpec]) -> Callable[[FunctionT], FunctionT]:
    """Marks a kernel that returns a tensor, or a tuple of tensors and Nones, to enter ``torch.compile`` graphs as
    one operator. ``outputs`` takes the kernel's arguments and returns an :class:`Output` for each tensor it would
    return (a tuple of them, None where the kernel returns None, where the kernel returns a tuple). The kernel's
    non-tensor arguments must be Python literals (numbers, strings, bools, None), which the operator's arguments
    carry as text: constants of the caller, not numbers held by a module, which torch.compile with dynamic shapes
    makes symbolic (a graph break)."""

    def mark(fn: FunctionT) -> FunctionT:
        name = f"{fn.__module__}.{fn.__qualname__}"
        parameters = inspect.signature(fn).parameters
        defaults = {n: p.default for n, p in parameters.items() if p.default is not inspect.Parameter.empty}
        kernel = _Kernel(fn, outputs, defaults, tuple(parameters))
        _KERNELS[name] = kernel

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            return _call(name, kernel, {**kernel.defaults, **dict(zip(kernel.names, args)), **kwargs})

        return wrapper

    return mark


def _call(name: str, kernel: _Kernel, call: dict[str, Any]) -> Any:
    tensors = {key: value for key, value in call.items() if isinstance(value, torch.Tensor)}
    options = {key: value for key, value in call.items() if not isinstance(value, torch.Tensor)}
    results = _kernel(name, list(tensors.values()),
                      repr({"tensors": list(tensors), "options": options}))
    spec = kernel.outputs(**call)
    if isinstance(spec, Output):
        return results[0]
    return tuple(None if out is None else result for out, result in zip(spec, results))


def _arguments(name: str, tensors: Sequence[torch.Tensor], arguments: str) -> tuple[_Kernel, dict[str, Any], dict]:
    """The kernel, its call's keyword arguments and the operator's description of them."""
    described = ast.literal_eval(arguments)
    return _KERNELS[name], {**dict(zip(described["tensors"], tensors)), **described["options"]}, described


def _as_tuple(result: Any) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def _placeholder(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """What the operator returns where the kernel returns None (an operator's list of outputs holds only tensors)."""
    return tensors[0].new_empty(0, dtype=torch.float32)


@torch.library.custom_op(f"{_NAMESPACE}::kernel", mutates_args=())
def _kernel(name: str, tensors: list[torch.Tensor], arguments: str) -> list[torch.Tensor]:
    kernel, call, _ = _arguments(name, tensors, arguments)
    results = _as_tuple(kernel.fn(**call))
    # an operator's outputs may not share memory with its inputs (a kernel may hand back a state it was given), and
    # are contiguous as the fake says: compiled code addresses them by the fake's strides
    inputs = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
    return [_placeholder(tensors) if r is None else r.clone(memory_format=torch.contiguous_format)
            if r.numel() and r.untyped_storage().data_ptr() in inputs else r.contiguous() for r in results]


@_kernel.register_fake
def _(name: str, tensors: list[torch.Tensor], arguments: str) -> list[torch.Tensor]:
    kernel, call, _ = _arguments(name, tensors, arguments)
    spec = kernel.outputs(**call)
    return [_placeholder(tensors) if out is None else tensors[0].new_empty(out.shape, dtype=out.dtype)
            for out in ((spec,) if isinstance(spec, Output) else spec)]


@contextlib.contextmanager
def _autograd_inside_operator() -> Iterator[None]:
    """Records autograd's graph inside an operator's implementation. The dispatcher runs an implementation with
    autograd's dispatch keys excluded (the operator's own formula stands for whatever it computes), so that
    ``enable_grad`` alone records nothing there; the recomputation needs them back for its duration."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in (DispatchKey.AutogradFunctionality, DispatchKey.AutogradOther, DispatchKey.AutogradNestedTensor):
        excluded = excluded.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded), torch.enable_grad():
        yield


@torch.library.custom_op(f"{_NAMESPACE}::kernel_backward", mutates_args=())
def _kernel_backward(name: str, tensors: list[torch.Tensor], grads: list[torch.Tensor],
                     arguments: str) -> list[torch.Tensor]:
    """The gradients of the inputs marked ``wanted`` in ``arguments``, from the kernel run again under autograd;
    ``grads`` are those of the outputs listed as ``graded``."""
    inputs = [t.detach().requires_grad_(wanted) for t, wanted in zip(tensors, ast.literal_eval(arguments)["wanted"])]
    kernel, call, described = _arguments(name, inputs, arguments)
    with _autograd_inside_operator():
        results = _as_tuple(kernel.fn(**call))
    pairs = [(results[i], g) for i, g in zip(described["graded"], grads)
             if results[i] is not None and results[i].requires_grad]
    differentiated = [t for t in inputs if t.requires_grad]
    found = torch.autograd.grad([out for out, _ in pairs], differentiated, [g for _, g in pairs],
                                allow_unused=True) if pairs else [None] * len(differentiated)
    # contiguous as the fake says: a kernel's gradients come in its own layouts, compiled code reads the fake's
    return [t.new_zeros(t.shape) if g is None else g.contiguous() for t, g in zip(differentiated, found)]


@_kernel_backward.register_fake
def _(name: str, tensors: list[torch.Tensor], grads: list[torch.Tensor], arguments: str) -> list[torch.Tensor]:
    wanted = ast.literal_eval(arguments)["wanted"]
    return [t.new_empty(t.shape) for t, w in zip(tensors, wanted) if w]


def _setup_context(ctx, inputs: tuple, output: list[torch.Tensor]) -> None:
    name, tensors, arguments = inputs
    ctx.name, ctx.arguments = name, arguments
    ctx.wanted = [t.requires_grad for t in tensors]
    ctx.save_for_backward(*tensors)


def _backward(ctx, grads: Sequence[torch.Tensor | None]) -> tuple[None, list[torch.Tensor | None], None]:
    tensors = ctx.saved_tensors
    graded = [i for i, g in enumerate(grads) if g is not None]
    if not any(ctx.wanted) or not graded:
        return None, [None] * len(tensors), None
    arguments = repr({**ast.literal_eval(ctx.arguments), "wanted": ctx.wanted, "graded": graded})
    found = iter(_kernel_backward(ctx.name, list(tensors), [grads[i] for i in graded], arguments))
    return None, [next(found) if wanted else None for wanted in ctx.wanted], None


_kernel.register_autograd(_backward, setup_context=_setup_context)


def recurrent_outputs(q: torch.Tensor, v: torch.Tensor, output_final_state: bool,
                      cu_seqlens: torch.Tensor | None, **_: Any) -> tuple[Output, Output | None]:
    """What the chunked recurrent kernels return: ``o`` like v, and the float32 final state ``[N, H, K, V]`` (N = B,
    or the number of packed sequences) where asked."""
    B, _, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return Output(v.shape, v.dtype), Output((N, H, K, v.shape[-1]), torch.float32) if output_final_state else None
