"""Timing helpers shared by the benchmark scripts.

A shared machine's speed drifts within minutes by more than the targets' margins. So contenders are timed
round-robin (one call each per round, in the same conditions, in a shuffled order), a time is the best of its
rounds, and a ratio is the median over rounds of the two contenders' times in the same round, which cancels the
drift instead of trusting whichever run happened to be lucky.
"""
from __future__ import annotations

import copy
import inspect
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
    """Wall-clock seconds of every call of each function, over ``repeats`` round-robin rounds. A function with a
    ``reset`` method (a :class:`Decoder`) has it called, untimed, before each of its calls, warm-up included, so that
    every call does the same work."""
    for fn in fns.values():
        for _ in range(warmup):
            _reset(fn)
            fn()
    samples: dict[Hashable, list[float]] = {key: [] for key in fns}
    order, shuffler = list(fns), random.Random(0)
    for _ in range(repeats):
        # A fresh order each round (the same in every run): a call inherits the heap the previous call left (how much
        # memory glibc kept, hence its page faults), so a fixed order favours whichever contender follows the
        # heaviest one.
        shuffler.shuffle(order)
        for key in order:
            fn = fns[key]
            _reset(fn)
            _sync()
            start = time.perf_counter()
            fn()
            _sync()
            samples[key].append(time.perf_counter() - start)
    return samples


def _reset(fn: Callable[[], object]) -> None:
    reset = getattr(fn, "reset", None)
    if reset is not None:
        reset()


class Decoder:
    """After a prefill of ``context`` random tokens, a call that decodes ``steps`` more greedily, one at a time (batch
    1), through the model's cache (rotarium's or transformers'). :meth:`reset` puts back the cache and the next token
    as the prefill left them: a call extends the cache, and a decoding step costs more (attention) or as much
    (recurrent state) with a longer one, so without it each round would time a longer context than the last."""

    def __init__(self, model: torch.nn.Module, context: int, steps: int):
        model.eval()
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            out = model(input_ids=torch.randint(0, model.config.vocab_size, (1, context), generator=generator),
                        use_cache=True)
        self.model, self.steps = model, steps
        self.prefilled = out.cache if hasattr(out, "cache") else out.past_key_values
        # transformers renamed `past_key_values` to `cache` (the old name warns); rotarium's models take both
        self.name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.first = out.logits[:, -1:].argmax(-1)
        self.reset()

    def reset(self) -> None:
        self.cache, self.token = copy.deepcopy(self.prefilled), self.first

    @torch.no_grad()
    def __call__(self) -> None:
        for _ in range(self.steps):
            logits = self.model(input_ids=self.token, use_cache=True, **{self.name: self.cache}).logits
            self.token = logits[:, -1:].argmax(-1)


def best(samples: dict[Hashable, list[float]]) -> dict[Hashable, float]:
    """The least noisy single-contender estimate: each one's fastest round."""
    return {key: min(times) for key, times in samples.items()}


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of ``numerator / denominator`` timed in the same round."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def release_freed_memory() -> bool:
    """Makes glibc map every allocation of 64 KiB or more on its own and unmap it when freed; False where that is not
    glibc.

    The resident set then follows the live tensors, which a peak measured by the resident set (VmHWM) needs: under
    glibc's defaults, memory freed by a warm-up step stays in the process below an adaptive threshold and is reused
    unseen, so the same step's measured peak depends on which of its buffers happened to fit what the warm-up left.
    """
    return _mallopt((M_MMAP_THRESHOLD, 64 << 10))  # setting it also stops glibc adapting it


def keep_freed_memory() -> bool:
    """Makes glibc keep freed memory for reuse instead of handing it back to the OS; False where that is not glibc.

    For the rest of the process (glibc's adaptive thresholds cannot be restored), so the scripts measure the default
    allocator in another process. Under glibc's defaults a call reuses freed pages up to a threshold that adapts to
    the biggest tensors freed so far and gets fresh zero-filled pages from the OS beyond it: which contender pays
    depends on its temporaries' sizes and on what ran before it, not on its arithmetic. Kept memory is what jemalloc /
    tcmalloc give (PyTorch's CPU tuning guide recommends them) and what PyTorch's caching allocator does on GPUs.
    """
    return _mallopt((M_MMAP_THRESHOLD, 256 << 20), (M_TRIM_THRESHOLD, 1 << 30))


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h's


def _mallopt(*settings: tuple[int, int]) -> bool:
    """glibc's mallopt for each (option, value); False where the C library is not glibc or refuses one."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        return all(bool(libc.mallopt(option, value)) for option, value in settings)
    except (OSError, AttributeError):
        return False
