"""Timing helpers shared by the benchmark scripts."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch


def time_call(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Best wall-clock seconds of ``fn`` over ``repeats`` runs (the minimum is the least noisy estimate)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"
