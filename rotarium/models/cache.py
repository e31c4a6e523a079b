"""The decoding cache: a transformers ``Cache`` holding one state dict per layer.

A layer's state is whatever its mixer needs to continue a sequence: recurrent states ``[B, H, K, V]``,
short-convolution windows, the positional layer's offsets and cumulative angles, or the KV cache of a softmax
mixer. Every tensor entry has the batch on dim 0, and an entry that is an object (the softmax mixers' KV cache)
selects its rows with ``select_rows(index)``, so beam search, batch expansion and selection are one row gather
for every family alike.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache


def _select_rows(value: Any, index: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor):
        return value.index_select(0, index.to(value.device))
    if isinstance(value, dict):
        return {k: _select_rows(v, index) for k, v in value.items()}
    if hasattr(value, "select_rows"):
        return value.select_rows(index)
    return value


class RotariumCache(Cache):
    """The states of every layer of one model, for one batch of sequences.

    The model records (:meth:`record`) its settings (family, depth, the mixers' options) and the batch size at every
    step, so that a cache handed to another model, or to inputs of another batch size, is refused by name
    (:meth:`check_fits`) instead of being misread.
    """

    is_compileable = False

    def __init__(self, num_layers: int = 0):
        # transformers' Cache wants layer objects; ours are plain state dicts, so its per-layer machinery stays unused
        super().__init__(layers=[])
        self.states: list[dict | None] = [None] * num_layers
        self.seen_tokens = 0
        self.built_for: dict[str, Any] | None = None
        self._num_rows: int | None = None

    @property
    def batch_size(self) -> int:
        """The batch size of the states held; -1 before the first step (transformers' convention)."""
        return -1 if self._num_rows is None else self._num_rows

    def record(self, built_for: dict[str, Any], batch_size: int) -> None:
        self.built_for, self._num_rows = built_for, batch_size

    def check_fits(self, built_for: dict[str, Any], batch_size: int, argument: str) -> None:
        """Raises ``ValueError`` naming ``argument`` when the states held were written by a model with other
        settings than ``built_for`` or for a batch of another size; an empty cache fits every model."""
        advice = "pass the cache this model returned for these sequences, or None to start afresh"
        if self.built_for is not None and self.built_for != built_for:
            family, ours = self.built_for.get("family"), built_for.get("family")
            if family != ours:
                raise ValueError(f"`{argument}` holds the states of a {family} model, but this is a {ours} model; "
                                 f"{advice}")
            differ = [k for k in sorted(built_for.keys() | self.built_for.keys())
                      if self.built_for.get(k) != built_for.get(k)]
            details = "; ".join(f"{k}: {self.built_for.get(k)!r} in the cache, {built_for.get(k)!r} here"
                                for k in differ)
            raise ValueError(f"`{argument}` holds the states of a {family} model with other settings ({details}); "
                             f"{advice}")
        if self._num_rows is not None and self._num_rows != batch_size:
            raise ValueError(f"`{argument}` holds states for a batch of {self.batch_size} sequences, but the inputs "
                             f"have a batch of {batch_size}; {advice}")

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

    def _select(self, index: torch.Tensor) -> None:
        """Keeps the batch rows ``index`` (int64 ``[B']``, repeats allowed) of every state."""
        self.states = [_select_rows(s, index) for s in self.states]
        self._num_rows = len(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    # Expansion and selection count the rows the model recorded; a cache no model has written to holds none.
    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._num_rows is not None:
            self._select(torch.arange(self._num_rows).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._num_rows is not None:
            self._select(torch.arange(self._num_rows, device=indices.device)[indices])  # indices or a bool mask

    def crop(self, max_length: int) -> None:
        raise ValueError(
            "a rotarium cache holds recurrent states, which cannot be rolled back to an earlier length; decoding "
            "strategies that crop the cache (assisted / speculative decoding) are not supported")

    def reset(self) -> None:
        self.states = [None] * len(self.states)
        self.seen_tokens = 0
        self.built_for = self._num_rows = None

    def update(self, *args, **kwargs):
        raise ValueError("RotariumCache is updated by rotarium's mixers through set_layer_state, not update()")
