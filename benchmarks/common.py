"""Timing helpers shared by the benchmark scripts.

This machine is shared: its speed drifts by 20-50% over seconds to minutes. So contenders are timed
round-robin (one call each per round, in the same conditions, in a shuffled order), a time is the best of its
rounds, and a ratio is the median over rounds of the two contenders' times in the same round, which cancels the
drift instead of trusting whichever run happened to be lucky.
"""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Hashable

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_rounds(fns: dict[Hashable, Callable[[], object]], repeats: int = 3,
                warmup: int = 1) -> dict[Hashable, list[float]]:
    """Wall-clock seconds of every call of each function, over ``repeats`` round-robin rounds."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[Hashable, list[float]] = {key: [] for key in fns}
    order, shuffler = list(fns), random.Random(0)
    for _ in range(repeats):
        # A fresh order each round (the same in every run): a call inherits the heap the previous call left (how much
        # memory glibc kept, hence its page faults), so a fixed order favours whichever contender follows the
        # heaviest one (two mixers timed in both orders: 1.25 against 1.18).
        shuffler.shuffle(order)
        for key in order:
            fn = fns[key]
            _sync()
            start = time.perf_counter()
            fn()
            _sync()
            samples[key].append(time.perf_counter() - start)
    return samples


def best(samples: dict[Hashable, list[float]]) -> dict[Hashable, float]:
    """The least noisy single-contender estimate: each one's fastest round."""
    return {key: min(times) for key, times in samples.items()}


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of ``numerator / denominator`` timed in the same round."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"
