"""The decoding cache: a transformers ``Cache`` of one :class:`RotariumCacheLayer` per block.

A layer holds whatever its mixer needs to continue a sequence, as the mixer's typed state
(:mod:`rotarium.layers.state`): recurrent states ``[B, H, K, V]``, short-convolution windows, the positional layer's
offsets and cumulative angles, or the KV cache of a softmax mixer. Every state selects its batch rows with
``select_rows(index)``, so beam search, batch expansion and selection are one row gather for every family alike.

``generate`` builds a :class:`RotariumCache` (the models' ``_prepare_cache_for_generation``); the model also
takes transformers' own empty caches (``DynamicCache()``, ``DynamicCache(config=model.config)``) and fills them with
these layers.

Rolling back (assisted and prompt-lookup decoding, which verify drafted tokens and drop the rejected ones): a
recurrent state cannot be run backwards, so after ``activate_past_recording(recurrent_states_to_keep=n)`` the model
feeds the last n tokens of each forward one at a time, and each layer keeps the state it had before each forward
and before each of those tokens (:meth:`RotariumCacheLayer.set_state`). ``crop(-r)`` then takes back the state
from before the r newest tokens: recurrent states, convolution windows, RoPE offsets and Selective RoPE's angles as
they were, and the KV cache at its earlier length.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

from rotarium.layers.state import DecodingState


class RotariumCacheLayer(CacheLayerMixin):
    """The decoding state of one block, with the model settings and batch size that wrote it.

    The model records (:meth:`set_state`) its settings (family, depth, the mixers' options) and the batch size at
    every step, so that a cache handed to another model, or to inputs of another batch size, is refused by name
    (:meth:`check_fits`) instead of being misread.
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False
    supports_early_init = False  # the mixers create their states; there are no key/value shapes to allocate

    def __init__(self):
        # not CacheLayerMixin's __init__: its key and value tensors stay None, and whether the layer holds anything
        # is a property of its state
        self.keys = self.values = None
        self.state: DecodingState | None = None
        self.length = 0
        self.built_for: dict[str, Any] | None = None
        self._num_rows: int | None = None
        self.record_past = False
        self.recurrent_states_to_keep = 0
        # (state, length) before each recorded forward or token, oldest first
        self.history: list[tuple[DecodingState | None, int]] = []

    def __repr__(self) -> str:
        return f"RotariumCacheLayer(length={self.length})"

    @property
    def is_initialized(self) -> bool:
        return self.state is not None

    @property
    def batch_size(self) -> int:
        """The batch size of the state held; -1 before the first step (transformers' convention)."""
        return -1 if self._num_rows is None else self._num_rows

    def set_state(self, state: DecodingState | None, num_tokens: int, built_for: dict[str, Any],
                  batch_size: int) -> None:
        """The state after ``num_tokens`` more tokens, written by a model with settings ``built_for``."""
        if self.record_past:  # kept until the next crop, as transformers' linear-attention layers keep theirs
            self.history.append((self.state, self.length))
        self.state, self.length = state, self.length + num_tokens
        self.built_for, self._num_rows = built_for, batch_size

    def check_fits(self, built_for: dict[str, Any], batch_size: int, argument: str) -> None:
        """Raises ``ValueError`` naming ``argument`` when the state held was written by a model with other settings
        than ``built_for`` or for a batch of another size; an empty layer fits every model."""
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

    # transformers' layer interface
    def lazy_initialization(self, *args, **kwargs) -> None:
        raise ValueError("a rotarium cache layer is filled by rotarium's mixers (set_state), not from keys and values")

    def update(self, *args, **kwargs):
        raise ValueError("a rotarium cache layer is updated by rotarium's mixers (set_state), not by update()")

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def offload(self) -> None:
        pass  # states stay where the mixers made them

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        self.state, self.length, self.history = None, 0, []
        self.built_for = self._num_rows = None

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None) -> None:
        """Keeps, from now on and until the next :meth:`crop`, the state before each forward and before each of the
        last ``recurrent_states_to_keep`` tokens of a longer one (the model feeds those one by one), so that
        :meth:`crop` can drop the tokens of any number of one-token forwards (an assistant's drafts) or up to that
        many of one forward (a verification of drafts)."""
        self.record_past = True
        self.recurrent_states_to_keep = max(recurrent_states_to_keep or 0, self.recurrent_states_to_keep)

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the ``-tokens_to_remove`` newest tokens (transformers' negative count) and forgets the states
        recorded before them; ``crop(0)`` only forgets."""
        if tokens_to_remove > 0:
            raise ValueError(f"`crop` takes the negative number of tokens to remove, got {tokens_to_remove}")
        remove = -tokens_to_remove
        if remove:
            target = self.length - remove
            earlier = [s for s, n in self.history if n == target]
            if not earlier:
                kept = sorted(self.length - n for _, n in self.history)
                raise ValueError(
                    f"cannot drop the {remove} newest tokens: a recurrent state cannot be run backwards, and this "
                    f"cache recorded the states {kept} tokens back (none without activate_past_recording()); call "
                    f"activate_past_recording(recurrent_states_to_keep={remove}) or more before the forward")
            self.state, self.length = earlier[-1], target
            if self.state is not None:
                self.state.release_later_positions()
        self.history = []

    def _select(self, index: torch.Tensor) -> None:
        """Keeps the batch rows ``index`` (int64 ``[B']``, repeats allowed) of the state and the recorded ones."""
        self.state = _rows_of(self.state, index)
        self.history = [(_rows_of(s, index), n) for s, n in self.history]
        self._num_rows = len(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self._select(beam_idx)

    # Expansion and selection count the rows the model recorded; a layer no model has written to holds none.
    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._num_rows is not None:
            self._select(torch.arange(self._num_rows).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._num_rows is not None:
            self._select(torch.arange(self._num_rows, device=indices.device)[indices])  # indices or a bool mask


def _rows_of(state: DecodingState | None, index: torch.Tensor) -> DecodingState | None:
    return None if state is None else state.select_rows(index)


class RotariumCache(DynamicCache):
    """transformers' ``DynamicCache`` of ``num_layers`` :class:`RotariumCacheLayer`, one per block."""

    def __init__(self, num_layers: int = 0):
        Cache.__init__(self, layers=[RotariumCacheLayer() for _ in range(num_layers)])


def rotarium_layers(cache: Any, num_layers: int, argument: str) -> list[RotariumCacheLayer]:
    """The layers of ``cache``, a transformers ``Cache`` for a model of ``num_layers`` blocks: one
    :class:`RotariumCacheLayer` per block. transformers' empty caches (``DynamicCache()``, and
    ``DynamicCache(config=...)`` before any forward) get them here, in place; anything else raises ``ValueError``
    naming ``argument``."""
    advice = "pass the cache this model returned, an empty DynamicCache(), or None"
    if not isinstance(cache, Cache):
        # a ValueError like every other input error of the model, so that callers catch one type
        raise ValueError(f"`{argument}` must be a transformers Cache, got {type(cache).__name__}; {advice}")  # noqa: TRY004
    if all(type(layer) is DynamicLayer and not layer.is_initialized for layer in cache.layers):
        cache.layers[:] = [RotariumCacheLayer() for _ in range(num_layers)]
    others = sorted({type(layer).__name__ for layer in cache.layers if not isinstance(layer, RotariumCacheLayer)})
    if others:
        raise ValueError(f"`{argument}` holds {', '.join(others)} layers, which cannot hold the recurrent states of "
                         f"rotarium's mixers; {advice}")
    if len(cache.layers) != num_layers:
        raise ValueError(f"`{argument}` has {len(cache.layers)} layers, but this model has {num_layers} blocks; "
                         f"{advice}")
    return cache.layers
