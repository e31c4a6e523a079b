"""The one closeness assertion of the tests."""
from __future__ import annotations

import torch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float = 1e-4,
                 what: str = "") -> None:
    """Same shape and, elementwise, ``|actual - expected| <= atol + rtol * |expected|`` (torch.testing's rule),
    compared in at least float32 whatever the two dtypes (a kernel's bf16 output against a float32 oracle).
    ``what`` names the compared quantity in the failure message."""
    dtype = torch.promote_types(torch.promote_types(actual.dtype, expected.dtype), torch.float32)
    torch.testing.assert_close(actual.to(dtype), expected.to(dtype), atol=atol, rtol=rtol,
                               msg=(lambda message: f"{what}: {message}") if what else None)
