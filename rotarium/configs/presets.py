"""The 370M and 1.3B presets of each family. Untied embeddings, vocabulary 32000, 24 layers.

Each combines with any positional option: ``preset_config("gla-370m", position_encoding="selective_rope")``.
"""
from __future__ import annotations

from typing import Any

COMMON = {"vocab_size": 32000, "num_hidden_layers": 24, "tie_word_embeddings": False}

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "gla-370m": ("gla", {"hidden_size": 1024, "num_heads": 4, "expand_k": 0.5, "expand_v": 1.0,
                         "use_short_conv": True}),
    "gla-1.3b": ("gla", {"hidden_size": 2048, "num_heads": 4, "expand_k": 0.5, "expand_v": 1.0,
                         "use_short_conv": True}),
    "deltanet-370m": ("deltanet", {"hidden_size": 1024, "num_heads": 8, "expand_k": 1.0, "expand_v": 1.0,
                                   "use_short_conv": True}),
    "deltanet-1.3b": ("deltanet", {"hidden_size": 2048, "num_heads": 16, "expand_k": 1.0, "expand_v": 1.0,
                                   "use_short_conv": True}),
    "fox-370m": ("fox", {"hidden_size": 1024, "num_heads": 16}),
    "fox-1.3b": ("fox", {"hidden_size": 2048, "num_heads": 32}),
    "transformer-370m": ("transformer", {"hidden_size": 1024, "num_heads": 16, "rope_theta": 10000.0}),
    "transformer-1.3b": ("transformer", {"hidden_size": 2048, "num_heads": 32, "rope_theta": 10000.0}),
}


def preset_config(name: str, **overrides: Any):
    """The config of preset ``name`` with ``overrides`` (any config field, e.g. ``position_encoding``) applied."""
    from rotarium.models.configuration import CONFIGS

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    family, values = PRESETS[name]
    return CONFIGS[family](**{**COMMON, **values, **overrides})
