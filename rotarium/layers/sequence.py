"""Where the tokens of one forward call sit: padding, packing boundaries and positions.

Built once per forward (by the model, or by hand in tests) and handed to every
mixer, the positional layer and the short convolutions, so that they all agree
on which tokens are real and where each document starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rotarium.ops.utils import check_cu_seqlens, document_offsets


@dataclass
class SequenceInfo:
    """``mask``: ``[B, T]`` bool, True for real tokens, None when every token is real.
    ``cu_seqlens``: int64 ``[N+1]`` boundaries of documents packed into a batch of size 1, or None.
    ``position_ids``: ``[B, T]`` explicit positions, or None to count them (see ``token_positions``).
    ``device``: where the layers create tensors of their own (positions, masks).
    ``cu_seqlens_cpu``: a host copy of ``cu_seqlens``, taken once per forward so that no layer reads the device
    tensor (each read is a host-device synchronisation on CUDA); None where its values cannot be read (meta tensors).

    Everything here that reads tensor values does so in :meth:`build`, once per forward: the layers afterwards
    only launch work on the device.
    """

    batch_size: int
    seq_len: int
    mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    cu_seqlens_cpu: torch.Tensor | None = None
    _counted_positions: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cu_seqlens_cpu: torch.Tensor | None = None,
    ) -> SequenceInfo:
        """Validates and normalises the usual HF inputs for ``hidden_states`` of shape ``[B, T, d]``.

        ``attention_mask`` may be ``[B, T]`` or HF's ``[B, past + T]``: only the current tokens' columns are kept
        (the softmax mixers remember the mask of cached keys themselves). ``cu_seqlens_cpu``, a host copy of
        ``cu_seqlens`` the caller already has, spares the one copy this makes otherwise.

        Without ``cu_seqlens``, one unpadded row whose ``position_ids`` restart (transformers' padding-free packing,
        ``DataCollatorWithFlattening``) holds packed documents: each starts where the positions take their smallest
        value, transformers' own rule (``prepare_fa_kwargs_from_position_ids``), and the tokens before the first
        such start form a document of their own.
        """
        B, T = hidden_states.shape[:2]
        device = hidden_states.device
        mask = None
        if attention_mask is not None:
            if attention_mask.ndim != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
                raise ValueError(
                    f"`attention_mask` must have shape [batch, past + seq_len] = [{B}, >= {T}] "
                    f"(1 = token, 0 = padding), got {tuple(attention_mask.shape)}"
                )
            mask = attention_mask[:, -T:].to(device=device, dtype=torch.bool)
        if position_ids is not None:
            if position_ids.ndim != 2 or position_ids.shape[1] != T or position_ids.shape[0] not in (1, B):
                raise ValueError(f"`position_ids` must have shape [{B} or 1, {T}], got {tuple(position_ids.shape)}")
            position_ids = position_ids.to(device).expand(B, T)
        # The one read of the inputs' values per forward: the mask (unpadded inputs take the fast paths) and, where
        # they could mark packed documents, the positions, copied to the host together.
        positions_cpu = None
        if position_ids is not None and cu_seqlens is None and B == 1 and T > 1:
            read = host_copy(position_ids[0] if mask is None else torch.stack([mask[0].long(), position_ids[0].long()]))
            if read is not None:
                if mask is not None and bool(read[0].all()):
                    mask = None
                positions_cpu = read if read.ndim == 1 else read[1]
        elif mask is not None and bool(mask.all()):
            mask = None
        if positions_cpu is not None and mask is None:
            cu_seqlens_cpu = document_starts(positions_cpu)
            if cu_seqlens_cpu is not None:
                cu_seqlens = cu_seqlens_cpu.to(device)
        if cu_seqlens is not None:
            if cu_seqlens_cpu is None:
                cu_seqlens_cpu = host_copy(cu_seqlens)
            check_cu_seqlens(cu_seqlens, B, T, device, cu_seqlens_cpu)
            if mask is not None:
                raise ValueError("pass either `cu_seqlens` (packed documents) or a padding `attention_mask`, not both")
        return cls(B, T, mask, cu_seqlens, position_ids, device, cu_seqlens_cpu)

    def slice(self, start: int, end: int) -> SequenceInfo:
        """The tokens ``[start, end)`` of an unpacked input, read nothing more: for feeding an input in pieces."""
        if self.cu_seqlens is not None:
            raise ValueError("packed inputs (`cu_seqlens`) cannot be split: each piece would cut documents")
        mask = None if self.mask is None else self.mask[:, start:end]
        positions = None if self.position_ids is None else self.position_ids[:, start:end]
        return SequenceInfo(self.batch_size, end - start, mask, None, positions, self.device)

    def document_offsets(self) -> torch.Tensor:
        """``[1, T]``: each packed token's index inside its own document (requires ``cu_seqlens``)."""
        assert self.cu_seqlens is not None
        return document_offsets(self.cu_seqlens, self.seq_len)

    def token_positions(self, offset: torch.Tensor | None) -> torch.Tensor:
        """``[B, T]`` long: the true position of every token.

        Explicit ``position_ids`` win. Otherwise positions count real tokens only (so a left-padded prompt starts at
        0 like the same prompt alone) from ``offset`` ``[B]``, the number of real tokens already seen (decoding),
        and restart at every packed document boundary. Computed once per forward and shared by the layers.
        """
        if self.position_ids is not None:
            return self.position_ids.long()
        positions = self._counted_positions
        if positions is None:
            if self.cu_seqlens is not None:
                positions = self.document_offsets().expand(self.batch_size, -1)
            elif self.mask is not None:
                positions = (self.mask.long().cumsum(1) - 1).clamp_min(0)
            else:
                positions = torch.arange(self.seq_len, device=self.device).unsqueeze(0).expand(self.batch_size, -1)
            # A compiled block computes them in its own graph: kept on this object, the next block's graph would
            # differ from the first's (another compilation) for the sake of a few fused integer ops.
            if not torch.compiler.is_compiling():
                self._counted_positions = positions
        return positions if offset is None or self.cu_seqlens is not None else positions + offset[:, None]

    def next_offset(self, offset: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        """``[B]``: the position the next token of each row will take."""
        if self.position_ids is not None:
            return positions[:, -1] + 1
        seen = self.mask.long().sum(1) if self.mask is not None else torch.full(
            (self.batch_size,), self.seq_len, device=self.device)
        return seen if offset is None else offset + seen

    def zero_padding(self, x: torch.Tensor) -> torch.Tensor:
        """Zeroes padded tokens of ``[B, T, ...]`` so that they feed nothing into states or windows."""
        if self.mask is None:
            return x
        return x * self.mask.view(*self.mask.shape, *([1] * (x.ndim - 2))).to(x.dtype)


def document_starts(positions: torch.Tensor) -> torch.Tensor | None:
    """int64 ``[N+1]`` boundaries of the documents packed in one row of ``positions`` ``[T]`` (a host tensor): a
    document starts wherever the positions take their smallest value, and at 0. None for a single document."""
    starts = (positions == positions.min()).nonzero().flatten()
    T = positions.shape[0]
    cu = torch.cat([starts.new_zeros(int(starts[0] != 0)), starts, starts.new_tensor([T])]).long()
    return cu if cu.numel() > 2 else None


def host_copy(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` on the CPU (x itself when it is there already); None for meta tensors, whose values do not exist."""
    if x.device.type == "cpu":
        return x
    if x.device.type == "meta":
        return None
    return x.cpu()
