"""The closeness assertions of the tests."""
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


def assert_close_at_scale(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    """Elementwise ``|actual - expected| <= tol * max(1, max |expected|)``: the bound for float results of many
    accumulated operations (a kernel against its reference, a model's logits, a loss, gradients). Their rounding
    error grows with the size of the values summed, on every element alike (a logit near 0 carries the error of the
    products that formed it), and another CPU's kernels sum in another order; so a fixed absolute bound that holds
    on one CPU fails on another once the values exceed 1, and a bound relative to each element fails near 0."""
    scale = max(1.0, float(expected.detach().abs().max()))
    assert_close(actual, expected, tol * scale, rtol=0, what=what)
