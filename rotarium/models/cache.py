"""The decoding cache: a transformers ``Cache`` holding one state dict per layer.

A layer's state is whatever its mixer needs to continue a sequence: recurrent states ``[B, H, K, V]``,
short-convolution windows, the positional layer's offsets and cumulative angles, or the KV cache of a softmax
mixer. Every entry has the batch on dim 0, so beam search, batch expansion and selection are index operations on
dim 0 for every family alike.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache


def _map_tensors(value, fn: Callable[[torch.Tensor], torch.Tensor]):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


class RotariumCache(Cache):
    is_compileable = False

    def __init__(self, num_layers: int = 0):
        # transformers' Cache wants layer objects; ours are plain state dicts, so its per-layer machinery stays unused
        super().__init__(layers=[])
        self.states: list[dict | None] = [None] * num_layers
        self.seen_tokens = 0

    def __len__(self) -> int:
        return len(self.states)

    def __repr__(self) -> str:
        return f"RotariumCache(layers={len(self.states)}, seen_tokens={self.seen_tokens})"

    def layer_state(self, layer_idx: int) -> dict | None:
        return self.states[layer_idx] if layer_idx < len(self.states) else None

    def set_layer_state(self, layer_idx: int, state: dict | None) -> None:
        while len(self.states) <= layer_idx:
            self.states.append(None)
        self.states[layer_idx] = state

    # transformers' Cache interface
    def get_seq_length(self, layer_idx: int = 0, *args, **kwargs) -> int:
        return self.seen_tokens

    def get_max_length(self, *args, **kwargs) -> int:
        return -1

    def get_max_cache_shape(self, *args, **kwargs) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def has_previous_state(self, *args, **kwargs) -> bool:
        return self.seen_tokens > 0

    @property
    def is_initialized(self) -> bool:
        return any(s is not None for s in self.states)

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.states)

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.states)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.states)

    @property
    def is_croppable(self) -> bool:
        return False

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.states = [_map_tensors(s, fn) for s in self.states]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices.to(t.device)])

    def crop(self, max_length: int) -> None:
        raise ValueError(
            "a rotarium cache holds recurrent states, which cannot be rolled back to an earlier length; decoding "
            "strategies that crop the cache (assisted / speculative decoding) are not supported")

    def reset(self) -> None:
        self.states = [None] * len(self.states)
        self.seen_tokens = 0

    def update(self, *args, **kwargs):
        raise ValueError("RotariumCache is updated by rotarium's mixers through set_layer_state, not update()")
