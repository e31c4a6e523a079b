from __future__ import annotations

import torch

import rotarium  # noqa: F401  (registers the Auto classes)
from rotarium.layers import POSITION_ENCODINGS
from rotarium.models import CONFIGS, FAMILY_MODELS

FAMILIES = tuple(FAMILY_MODELS)
ENCODINGS = POSITION_ENCODINGS
COMBINATIONS = [(f, p) for f in FAMILIES for p in ENCODINGS]
VOCAB = 61


def one_option_each(options: dict[str, str]) -> list[tuple[str, str]]:
    """Every family with one positional option, where a test runs one per family rather than every combination:
    the option that ``options`` gives it (chosen so that the options spread over the families), else RoPE, so that a
    family added to the registry is tested too."""
    unknown = set(options) - set(FAMILIES)
    if unknown:
        raise ValueError(f"not families of the registry: {sorted(unknown)}")
    return [(family, options.get(family, "rope")) for family in FAMILIES]


def tiny_config(family: str, position_encoding: str, **overrides):
    values = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 4,
              "intermediate_size": 64, "position_encoding": position_encoding, "pad_token_id": 0,
              "bos_token_id": 1, "eos_token_id": None}
    if family == "transformer":
        values["num_kv_heads"] = 2
    return CONFIGS[family](**{**values, **overrides})


def tiny_model(family: str, position_encoding: str, **overrides):
    torch.manual_seed(0)
    model = FAMILY_MODELS[family].lm(tiny_config(family, position_encoding, **overrides))
    # Larger weights than the 0.02 initialisation, so that greedy decoding is not trivially constant.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0, 0.3)
    return model.eval()
