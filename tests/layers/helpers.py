"""Small mixers of every family x positional option, for the layer tests."""
from __future__ import annotations

import torch

from rotarium.layers import POSITION_ENCODINGS, PositionalSettings, SequenceInfo
from rotarium.models import MIXERS, build_mixer

FAMILIES = tuple(MIXERS)
COMBINATIONS = [(f, p) for f in FAMILIES for p in POSITION_ENCODINGS]
HIDDEN, HEADS = 32, 4


def make_mixer(family: str, position_encoding: str, **overrides) -> torch.nn.Module:
    positional_prefixes = ("selective", "rope", "partial", "max_position")
    positional = {k: overrides.pop(k) for k in list(overrides) if k.startswith(positional_prefixes)}
    settings = PositionalSettings(position_encoding=position_encoding, **positional)
    kwargs = {"hidden_size": HIDDEN, "num_heads": HEADS, "positional": settings}
    if family == "transformer":
        kwargs["num_kv_heads"] = 2  # grouped-query attention on purpose
    if family == "fox":
        kwargs |= {"qk_norm": True, "output_gate": True}
    kwargs |= overrides
    torch.manual_seed(0)
    mixer = build_mixer(family, **kwargs)
    # Give every parameter a generic value so no option hides behind a zero or identity initialisation.
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn_like(p) * 0.1)
    return mixer


def run(mixer, x, state=None, use_cache=False, **seq_kwargs):
    return mixer(x, SequenceInfo.build(x, **seq_kwargs), state, use_cache)
