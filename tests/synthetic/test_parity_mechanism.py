"""The mechanism behind the papers' state-tracking claim, checked in our code: with hand-set weights, one GLA mixer
with Selective RoPE computes the parity of its input at every position of a 512-token word, and the same mixer with
RoPE cannot (its angles do not depend on the input). If trained models fail at parity, the cause is learning, not
the positional layer."""
import math

import torch

from rotarium.layers import PositionalSettings, SequenceInfo
from rotarium.models import build_mixer

BOS, ZERO, ONE = 0, 1, 2  # rows of the identity: orthonormal token embeddings in R^8


def _parity_mixer(position_encoding: str) -> torch.nn.Module:
    settings = PositionalSettings(position_encoding=position_encoding, selective_rope_rank=None,
                                  selective_rope_conv_size=1, selective_rope_activation=None)
    mixer = build_mixer("gla", hidden_size=8, num_heads=1, positional=settings, expand_k=0.5, use_short_conv=False)
    with torch.no_grad():
        for p in mixer.parameters():
            p.zero_()
        # every token queries with pair 0; only <bos> has a key and a value
        mixer.q_proj.weight[0, [BOS, ZERO, ONE]] = 1.0
        mixer.k_proj.weight[0, BOS] = 1.0
        mixer.v_proj.weight[0, BOS] = 1.0
        mixer.gk_proj[1].bias.fill_(30.0)  # no decay: log-decay ~ -1e-13
        mixer.g_proj.weight[0, [BOS, ZERO, ONE]] = 5.0  # the output gate lets feature 0 through
        mixer.o_proj.weight[0, 0] = 1.0
        mixer.o_norm.weight.fill_(1.0)
        if position_encoding == "selective_rope":
            # omega on pair 0 (temperature 1) is pi for a one and 0 otherwise: theta_t = pi * (ones so far)
            mixer.positional.phi_direction[0, 0, ONE] = 1.0
            mixer.positional.phi_direction[0, 1, ONE] = 1.0
            mixer.positional.phi_gain[0, 0] = math.pi
            mixer.positional.conv.weight.fill_(1.0)
    return mixer


def _words(length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (4, length), generator=g)
    tokens = torch.cat([torch.full((4, 1), BOS), torch.where(bits == 1, ONE, ZERO)], dim=1)
    return torch.eye(8)[tokens], bits.cumsum(1) % 2


def test_selective_rope_gla_computes_parity_at_any_length():
    mixer = _parity_mixer("selective_rope")
    x, parity = _words(512)
    out, _ = mixer(x, SequenceInfo.build(x))
    sign = out[:, 1:, 0]
    assert sign.abs().min() > 1.0  # a decisive output at every position, the 512th included
    assert torch.equal((sign < 0).long(), parity)


def test_rope_gla_cannot():
    mixer = _parity_mixer("rope")
    x, parity = _words(512)
    out, _ = mixer(x, SequenceInfo.build(x))
    # the output depends on the position only, not on the bits: the same for every word
    assert torch.allclose(out[0], out[1], atol=1e-5)
    assert (((out[:, 1:, 0] < 0).long() == parity).float().mean() - 0.5).abs() < 0.1
