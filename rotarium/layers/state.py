"""The decoding states the layers hand back to continue a sequence: one typed record per kind of layer.

A mixer's forward returns its state when asked (``use_cache``) and takes it back at the next call; the cache
(:mod:`rotarium.models.cache`) stores it per block and only ever selects batch rows of it or lets it grow in place
again after a rollback, which every state does field by field. The records: :class:`LinearAttentionState` (GLA,
DeltaNet), :class:`AttentionState` (FoX, the Transformer) and the positional layer's, :class:`RotaryState` (RoPE,
RoVE) and :class:`SelectiveRoPEState`; NoPE has none. The softmax mixers' :class:`KVCache` lives here too.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from typing import Self


def _rows(value: Any, index: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor):
        return value.index_select(0, index.to(value.device))
    if hasattr(value, "select_rows"):
        return value.select_rows(index)
    return value


@dataclass
class DecodingState:
    """Base of the records. Every tensor field has the batch on dim 0; a field may also hold another state, or an
    object with ``select_rows`` and ``release_later_positions`` of its own (a :class:`KVCache`), or None."""

    def select_rows(self, index: torch.Tensor) -> Self:
        """The state of the batch rows ``index`` (int64 ``[B']``, repeats allowed): beam reordering, batch expansion
        and selection are this one gather."""
        return dataclasses.replace(self, **{f.name: _rows(getattr(self, f.name), index)
                                            for f in dataclasses.fields(self)})

    def release_later_positions(self) -> None:
        """Lets the state, taken back by a rollback, grow in place again (a KV cache's later positions belonged only
        to the states the rollback dropped); fixed-size fields have nothing to release."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if hasattr(value, "release_later_positions"):
                value.release_later_positions()


@dataclass
class RotaryState(DecodingState):
    """RoPE's and RoVE's state: the position the next token of each row takes."""

    offset: torch.Tensor  # [B] int64


@dataclass
class SelectiveRoPEState(DecodingState):
    """Selective RoPE's state: the angles accumulated so far and the window of its convolution over the rates."""

    theta: torch.Tensor  # [B, H_kv, K/2] float32
    conv: torch.Tensor | None  # [B, W - 1, H_kv * K/2]


@dataclass
class LinearAttentionState(DecodingState):
    """GLA's and DeltaNet's state: the recurrent state, the windows of the short convolutions (None without them)
    and the positional layer's state (None for NoPE)."""

    recurrent: torch.Tensor | None  # [B, H, K, V] float32
    conv_q: torch.Tensor | None = None  # [B, W - 1, H * K]
    conv_k: torch.Tensor | None = None  # [B, W - 1, H * K]
    conv_v: torch.Tensor | None = None  # [B, W - 1, H * V]
    positional: DecodingState | None = None


@dataclass
class AttentionState(DecodingState):
    """FoX's and the Transformer's state: the KV cache of the rotated keys and values (RoVE's values are stored
    rotated) and the positional layer's state (None for NoPE)."""

    kv: KVCache
    positional: DecodingState | None = None


@dataclass(eq=False)
class _Buffers:
    """Storage shared by the states of one decoding chain: time-major ``[capacity, B, ...]`` tensors, of which the
    first ``filled`` positions hold data."""

    keys: torch.Tensor
    values: torch.Tensor
    log_decay_cumsum: torch.Tensor | None
    key_mask: torch.Tensor | None
    filled: int

    @property
    def capacity(self) -> int:
        return self.keys.shape[0]

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.keys, self.values, self.log_decay_cumsum, self.key_mask


class KVCache:
    """The KV cache of a softmax mixer: the keys and values (as the positional layer left them), the cumulative log
    decay of every position and, once some padding was seen, the padding mask, for ``length`` positions.

    Decoding appends one token at a time. The buffers keep room beyond ``length`` and write new tokens in place;
    when they run out, the capacity doubles, so that n tokens cost O(n) copying in all rather than a copy of the
    whole cache per token. The buffers are time-major (``[capacity, B, ...]``), so the filled part is one
    contiguous block: fla's decoding kernel reads it where it lies (:func:`rotarium.ops.forgetting_attn_with_cache`
    folds the batch into its heads). ``keys``, ``values``, ``log_decay_cumsum`` and ``key_mask`` are views
    ``[B, length, ...]``. Whether any padding was seen is a Python fact (``key_mask`` is None until then), so
    choosing the unpadded path never reads the device.

    A state stays valid after it was continued: an append writes in place only into positions no state holds yet,
    and copies when another state was already appended to the same buffers (two continuations of one prefix) or
    when autograd records the step (it keeps the earlier views for the backward pass, and writing into their
    storage would invalidate them).
    """

    def __init__(self, buffers: _Buffers, length: int):
        self._buffers, self.length = buffers, length

    @classmethod
    def start(cls, k: torch.Tensor, v: torch.Tensor, log_decay_cumsum: torch.Tensor | None = None,
              mask: torch.Tensor | None = None) -> KVCache:
        """The cache of a first chunk ``k [B, T, H, K]``, ``v [B, T, H, V]``, ``log_decay_cumsum [B, T, HQ]``, ``mask
        [B, T]`` (None: no padding); it holds the tensors as given, without room to grow until the first append."""
        tensors = (k, v, log_decay_cumsum, mask)
        t_major = [None if t is None else t.transpose(0, 1) for t in tensors]
        return cls(_Buffers(*t_major, filled=k.shape[1]), k.shape[1])

    @property
    def batch_size(self) -> int:
        return self._buffers.keys.shape[1]

    @property
    def capacity(self) -> int:
        return self._buffers.capacity

    def _view(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[:self.length].transpose(0, 1)

    @property
    def keys(self) -> torch.Tensor:
        return self._view(self._buffers.keys)

    @property
    def values(self) -> torch.Tensor:
        return self._view(self._buffers.values)

    @property
    def log_decay_cumsum(self) -> torch.Tensor | None:
        return self._view(self._buffers.log_decay_cumsum)

    @property
    def key_mask(self) -> torch.Tensor | None:
        """``[B, length]`` bool, True for real tokens; None when no padding was ever seen."""
        return self._view(self._buffers.key_mask)

    def append(self, k: torch.Tensor, v: torch.Tensor, log_decay_cumsum: torch.Tensor | None = None,
               mask: torch.Tensor | None = None) -> KVCache:
        """This cache followed by T more positions (shapes as in :meth:`start`); ``self`` stays valid."""
        old, new = self._buffers, (k, v, log_decay_cumsum, mask)
        if (log_decay_cumsum is None) != (old.log_decay_cumsum is None):
            raise ValueError("`log_decay_cumsum` must be given at every step or at none")
        length = self.length + k.shape[1]
        records_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (*new, *old.tensors()))
        # (an inference-mode tensor cannot be written outside inference mode; torch.compile cannot trace either
        # probe, so a compiled block copies the cache, which costs what the attention over it costs)
        in_place = (old.filled == self.length and length <= old.capacity and not records_grad
                    and all(t is None or t.is_contiguous() for t in old.tensors())
                    and not torch.compiler.is_compiling()
                    and (torch.is_inference_mode_enabled() or not old.keys.is_inference()))
        if in_place:
            buffers = old
        else:
            # autograd keeps no spare room: it could not be written in place later
            capacity = length if records_grad else max(length, 2 * old.capacity)
            buffers = _Buffers(*[None if t is None else _grown(t, self.length, capacity) for t in old.tensors()],
                               filled=self.length)
        if mask is not None and buffers.key_mask is None:
            buffers.key_mask = torch.ones(buffers.capacity, self.batch_size, dtype=torch.bool, device=k.device)
        for buffer, t in zip(buffers.tensors(), new):
            if buffer is not None:
                buffer[self.length:length] = True if t is None else t.transpose(0, 1)
        buffers.filled = length
        return KVCache(buffers, length)

    def release_later_positions(self) -> None:
        """Lets the next append write in place after this state's positions: for a state taken back by a rollback
        (``RotariumCacheLayer.crop``), whose later positions only the dropped states held."""
        self._buffers.filled = self.length

    def select_rows(self, index: torch.Tensor) -> KVCache:
        """The cache of the batch rows ``index`` (int64 ``[B']``, repeats allowed): beam reordering, expansion and
        selection. The spare room is kept, so decoding goes on in place."""
        index = index.to(self._buffers.keys.device)
        buffers = _Buffers(*[None if t is None else t.index_select(1, index) for t in self._buffers.tensors()],
                           filled=self.length)
        return KVCache(buffers, self.length)


def _grown(buffer: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
    """A contiguous ``[capacity, ...]`` copy of ``buffer``'s first ``length`` positions; the rest is unset."""
    grown = buffer.new_empty(capacity, *buffer.shape[1:])
    grown[:length] = buffer[:length]
    return grown
