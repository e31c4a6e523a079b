"""The linear-attention mixers: GLA and DeltaNet, on one shared skeleton.

Both project q, k, v (optionally through SiLU short convolutions), hand them to the positional layer, run a
recurrent kernel from :mod:`rotarium.ops`, rotate the outputs back (RoVE), normalise each head, optionally gate
and project out. A family adds only its gates and its kernel call. The kernels are imported from their own modules,
not the ops packages (which also gather the naive references): an exported checkpoint ships what the model's
modules import (:mod:`rotarium.models.remote_code`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rotarium.layers.conv import ShortConvolution
from rotarium.layers.norm import RMSNorm
from rotarium.layers.positional import MixerSpec, PositionalOutput, PositionalSettings, build_positional
from rotarium.layers.sequence import SequenceInfo
from rotarium.layers.state import LinearAttentionState
from rotarium.ops.delta_rule.chunk import chunk_delta_rule, chunk_gated_delta_rule
from rotarium.ops.delta_rule.fused_recurrent import fused_recurrent_delta_rule, fused_recurrent_gated_delta_rule
from rotarium.ops.gla.chunk import CHUNK_SIZE, chunk_gla
from rotarium.ops.gla.fused_recurrent import fused_recurrent_gla
from rotarium.ops.l2norm import l2norm

# The most tokens a mixer continuing from a state hands to the step-wise kernels: past one chunk, the chunked kernels
# compute the same recurrence faster than a loop over time.
MAX_STEPS = 64


def head_size(name: str, width: int, expand: float, num_heads: int) -> int:
    total = width * expand
    if total != int(total) or int(total) % num_heads:
        raise ValueError(
            f"`{name}` * hidden_size = {expand} * {width} = {total} must be an integer divisible by "
            f"`num_heads` ({num_heads})")
    return int(total) // num_heads


def head_sizes(hidden_size: int, num_heads: int, expand_k: float, expand_v: float,
               head_dim: int | None) -> tuple[int, int]:
    """``(key head size, value head size)``: from ``expand_k`` / ``expand_v`` times ``hidden_size`` split over the
    heads, or, given ``head_dim``, ``head_dim`` and ``head_dim * expand_v`` (Gated DeltaNet's sizing, whose heads
    need not divide the width)."""
    if num_heads < 1:
        raise ValueError(f"`num_heads` must be positive, got {num_heads}")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"`num_heads` ({num_heads}) must divide `hidden_size` ({hidden_size}), "
                             "or give `head_dim` explicitly")
        return (head_size("expand_k", hidden_size, expand_k, num_heads),
                head_size("expand_v", hidden_size, expand_v, num_heads))
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
        raise ValueError(f"`head_dim` must be a positive integer, got {head_dim!r}")
    value = head_dim * expand_v
    if value != int(value) or value < 1:
        raise ValueError(f"`expand_v` * head_dim = {expand_v} * {head_dim} = {value} must be a positive integer "
                         "(with `head_dim`, `expand_v` sizes the value heads relative to the key heads)")
    return head_dim, int(value)


class LinearAttentionMixer(nn.Module):
    """Skeleton shared by GLA and DeltaNet. Subclasses implement ``prepare_qk`` and ``mix``. ``silu_output_gate``
    multiplies each head's normalised output by ``silu(W x)`` (always on in GLA, DeltaNet's ``use_output_gate``);
    ``head_k_dim``, given, sizes the key heads (the configs' ``head_dim``)."""

    silu_output_gate: bool

    def __init__(self, hidden_size: int, num_heads: int, expand_k: float, expand_v: float, use_short_conv: bool,
                 conv_size: int, silu_output_gate: bool, has_decay: bool, positional: PositionalSettings,
                 norm_eps: float = 1e-6, head_k_dim: int | None = None):
        super().__init__()
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.head_k_dim, self.head_v_dim = head_sizes(hidden_size, num_heads, expand_k, expand_v, head_k_dim)
        key_dim, value_dim = self.head_k_dim * num_heads, self.head_v_dim * num_heads
        self.q_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, value_dim, bias=False)
        self.use_short_conv = use_short_conv
        if use_short_conv:
            self.q_conv = ShortConvolution(key_dim, conv_size, "silu")
            self.k_conv = ShortConvolution(key_dim, conv_size, "silu")
            self.v_conv = ShortConvolution(value_dim, conv_size, "silu")
        self.positional = build_positional(positional, MixerSpec(
            hidden_size, num_heads, num_heads, self.head_k_dim, self.head_v_dim, has_decay))
        self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps)
        self.silu_output_gate = silu_output_gate
        if silu_output_gate:
            self.g_proj = nn.Linear(hidden_size, value_dim, bias=False)
        self.o_proj = nn.Linear(value_dim, hidden_size, bias=False)

    def prepare_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def mix(self, enc: PositionalOutput, x: torch.Tensor, seq: SequenceInfo, recurrent: torch.Tensor | None,
            use_cache: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs the kernel on the encoded q, k, v: returns ``(o [B, T, H, V], final state or None)``."""
        raise NotImplementedError

    def forward(self, hidden_states: torch.Tensor, seq: SequenceInfo, state: LinearAttentionState | None = None,
                use_cache: bool = False, output_attentions: bool = False
                ) -> tuple[torch.Tensor, LinearAttentionState | None]:
        """hidden_states ``[B, T, d]`` -> ``([B, T, d], the layer's new cache state when use_cache)``.
        ``output_attentions`` is refused: tokens meet through the recurrent state, and no attention weights exist."""
        if output_attentions:
            raise ValueError(
                f"`output_attentions=True` asks for attention weights, but {type(self).__name__} is a linear "
                "recurrent mixer: its tokens meet through a recurrent state and it forms none; leave "
                "`output_attentions` False (the Transformer and FoX families return theirs)")
        x = hidden_states
        B, T, _ = x.shape
        if seq.cu_seqlens is not None and state is not None:
            raise ValueError("packed inputs (`cu_seqlens`) cannot continue from a cache; run them without one")
        past = state if state is not None else LinearAttentionState(None)
        new_state = LinearAttentionState(None)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.use_short_conv:
            q, new_state.conv_q = self.q_conv(q, seq, past.conv_q)
            k, new_state.conv_k = self.k_conv(k, seq, past.conv_k)
            v, new_state.conv_v = self.v_conv(v, seq, past.conv_v)
        q = q.view(B, T, self.num_heads, self.head_k_dim)
        k = seq.zero_padding(k.view(B, T, self.num_heads, self.head_k_dim))
        v = seq.zero_padding(v.view(B, T, self.num_heads, self.head_v_dim))
        q, k = self.prepare_qk(q, k)
        enc = self.positional(q, k, v, x, seq, past.positional)
        o, new_state.recurrent = self.mix(enc, x, seq, past.recurrent, use_cache)
        o = self.o_norm(enc.restore(o))
        if self.silu_output_gate:
            o = o * F.silu(self.g_proj(x)).view(B, T, self.num_heads, self.head_v_dim)
        out = self.o_proj(o.reshape(B, T, -1))
        new_state.positional = enc.state
        return out, (new_state if use_cache else None)

    @staticmethod
    def runs_step_wise(recurrent: torch.Tensor | None, enc: PositionalOutput, *gates: torch.Tensor | None) -> bool:
        """Whether to continue from the state with the step-wise (``fused_recurrent_*``) kernels rather than the
        chunked ones; this is the one place that chooses, and the ops run the kernel they are called as. Step-wise:
        at most MAX_STEPS tokens after a state, and only without gradients, because some of fla's step-wise kernels
        cannot train (:data:`rotarium.ops.backend.FLA_KERNELS` says which and why) while the chunked kernels compute
        the same recurrence and train; every mixer follows the one rule."""
        if recurrent is None or enc.q.shape[1] > MAX_STEPS:
            return False
        if not torch.is_grad_enabled():
            return True
        return not any(t is not None and t.requires_grad for t in (enc.q, enc.k, enc.v, recurrent, *gates))


class GatedLinearAttention(LinearAttentionMixer):
    """GLA (Yang et al., 2024): a low-rank per-key-channel gate ``g = logsigmoid(W2 W1 x + b) / 16``."""

    def __init__(self, hidden_size: int, num_heads: int, positional: PositionalSettings, expand_k: float = 0.5,
                 expand_v: float = 1.0, use_short_conv: bool = True, conv_size: int = 4,
                 gate_low_rank_dim: int = 16, gate_logit_normalizer: float = 16.0, norm_eps: float = 1e-6,
                 head_dim: int | None = None, rotary_gate_per_pair: bool = True):
        super().__init__(hidden_size, num_heads, expand_k, expand_v, use_short_conv, conv_size,
                         silu_output_gate=True, has_decay=True, positional=positional, norm_eps=norm_eps,
                         head_k_dim=head_dim)
        self.gate_logit_normalizer = gate_logit_normalizer
        # A rotated feature pair (i, i + R/2) is one complex channel: it must decay as one, or the decay would not
        # commute with the rotation and RoPE would stop depending on relative positions only. The transition is then
        # the complex diagonal lambda * exp(i omega) of Selective RoPE (docs/design.md §3.4). So the gate has one
        # output per pair, unless ``rotary_gate_per_pair`` is off: one per key channel, as fla's GLA, which the
        # Selective RoPE reference rotates.
        self.tied_pairs = self.positional.rotary_dim // 2 if rotary_gate_per_pair else 0
        self.gk_proj = nn.Sequential(nn.Linear(hidden_size, gate_low_rank_dim, bias=False),
                                     nn.Linear(gate_low_rank_dim, (self.head_k_dim - self.tied_pairs) * num_heads,
                                               bias=True))

    def unweighted_flops_per_token(self, seq_len: int) -> int:
        """The forward FLOPs per token that no weight counts (rotarium.training.flops), chunkwise: the state's update
        and read, and within a chunk the scores and their values."""
        K, V = self.head_k_dim, self.head_v_dim
        return self.num_heads * (4 * K * V + 2 * CHUNK_SIZE * (K + V))

    def mix(self, enc: PositionalOutput, x: torch.Tensor, seq: SequenceInfo, recurrent: torch.Tensor | None,
            use_cache: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, _ = x.shape
        g = F.logsigmoid(self.gk_proj(x).float()) / self.gate_logit_normalizer
        g = g.view(B, T, self.num_heads, self.head_k_dim - self.tied_pairs)
        if self.tied_pairs:
            g = torch.cat([g[..., :self.tied_pairs], g], dim=-1)
        g = seq.zero_padding(g)
        if self.runs_step_wise(recurrent, enc, g):
            return fused_recurrent_gla(enc.q, enc.k, enc.v, gk=g, initial_state=recurrent,
                                       output_final_state=use_cache)
        return chunk_gla(enc.q, enc.k, enc.v, g, initial_state=recurrent, output_final_state=use_cache,
                         cu_seqlens=seq.cu_seqlens, cu_seqlens_cpu=seq.cu_seqlens_cpu)


class DeltaNet(LinearAttentionMixer):
    """DeltaNet (Yang et al., 2024) with L2-normalised q, k and ``beta = sigmoid(W_beta x)``; ``use_gated_delta``
    switches to Gated DeltaNet's decay ``log a = -exp(A_log) * softplus(W_a x + dt_bias)``. Without a decay of its
    own, Selective RoPE's decay turns it into the gated delta rule as well."""

    def __init__(self, hidden_size: int, num_heads: int, positional: PositionalSettings, expand_k: float = 1.0,
                 expand_v: float = 1.0, use_short_conv: bool = True, conv_size: int = 4,
                 use_gated_delta: bool = False, use_output_gate: bool = False, norm_eps: float = 1e-6,
                 head_dim: int | None = None):
        super().__init__(hidden_size, num_heads, expand_k, expand_v, use_short_conv, conv_size,
                         silu_output_gate=use_output_gate, has_decay=use_gated_delta, positional=positional,
                         norm_eps=norm_eps, head_k_dim=head_dim)
        self.use_gated_delta = use_gated_delta
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        if use_gated_delta:
            self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)
            self.A_log = nn.Parameter(torch.empty(num_heads))
            self.dt_bias = nn.Parameter(torch.empty(num_heads))
            self.reset_decay()

    def unweighted_flops_per_token(self, seq_len: int) -> int:
        """The forward FLOPs per token that no weight counts (rotarium.training.flops), chunkwise in the WY form: the
        chunk's products, the three with the state, and inverting the chunk's triangular matrix."""
        K, V, C = self.head_k_dim, self.head_v_dim, CHUNK_SIZE
        return self.num_heads * (6 * K * V + 6 * C * K + 4 * C * V + 2 * C * C // 3)

    def special_init(self) -> dict[str, torch.Tensor]:
        """Mamba-2 / Gated DeltaNet initialisation: A ~ U(1, 16), dt ~ logU(1e-3, 1e-1) through softplus^-1."""
        if not self.use_gated_delta:
            return {}
        dt = torch.exp(torch.empty(self.num_heads).uniform_(math.log(1e-3), math.log(1e-1))).clamp_min(1e-4)
        return {"A_log": torch.empty(self.num_heads).uniform_(1, 16).log(),
                "dt_bias": dt + torch.log(-torch.expm1(-dt))}

    def reset_decay(self) -> None:
        with torch.no_grad():
            for name, value in self.special_init().items():
                getattr(self, name).copy_(value)

    def prepare_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return l2norm(q), l2norm(k)

    def mix(self, enc: PositionalOutput, x: torch.Tensor, seq: SequenceInfo, recurrent: torch.Tensor | None,
            use_cache: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        beta = seq.zero_padding(torch.sigmoid(self.b_proj(x).float()))
        if self.use_gated_delta:
            g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
            g = seq.zero_padding(g)
        else:
            g = enc.log_decay
        step_wise = self.runs_step_wise(recurrent, enc, g, beta)
        if g is None:
            kernel = fused_recurrent_delta_rule if step_wise else chunk_delta_rule
            gate = {}
        else:
            kernel = fused_recurrent_gated_delta_rule if step_wise else chunk_gated_delta_rule
            gate = {"g": g}
        extra = {} if step_wise else {"cu_seqlens": seq.cu_seqlens, "cu_seqlens_cpu": seq.cu_seqlens_cpu}
        # beta by name: the fused gated op takes fla's gk and gv before it
        return kernel(enc.q, enc.k, enc.v, beta=beta, initial_state=recurrent, output_final_state=use_cache, **gate,
                      **extra)
