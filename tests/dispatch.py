"""What the ops run inside a block of code make, seen below autograd (tests of which tensors a kernel creates)."""
from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class OpOutputs(TorchDispatchMode):
    """Every op run inside the mode: ``(op name, shape, new)`` for each tensor it returns, ``new`` when its memory is
    not one of the op's inputs' (a fresh tensor, not a view or an in-place result)."""

    def __init__(self):
        super().__init__()
        self.outputs: list[tuple[str, tuple[int, ...], bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        self.outputs += [(func.overloadpacket.__name__, tuple(t.shape), t.untyped_storage().data_ptr() not in given)
                         for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out

    def shapes(self, *names: str) -> list[tuple[int, ...]]:
        """The shapes of the tensors the ops called ``names`` returned."""
        return [shape for name, shape, _ in self.outputs if name in names]

    def new_sizes(self) -> list[int]:
        """The number of elements of every new tensor."""
        return [math.prod(shape) for _, shape, new in self.outputs if new]
