"""Timing helpers shared by the benchmark scripts."""
from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_calls(fns: dict[Hashable, Callable[[], object]], repeats: int = 3, warmup: int = 1) -> dict[Hashable, float]:
    """Best wall-clock seconds of each function over ``repeats`` rounds.

    The functions are timed round-robin, one call each per round, so that a slow spell of a shared
    machine hits every contender of a ratio alike instead of whichever was being timed at the
    time; the minimum is the least noisy estimate of each.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for key, fn in fns.items():
            _sync()
            start = time.perf_counter()
            fn()
            _sync()
            best[key] = min(best[key], time.perf_counter() - start)
    return best


def time_call(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Best wall-clock seconds of one function over ``repeats`` runs."""
    return time_calls({None: fn}, repeats, warmup)[None]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"
