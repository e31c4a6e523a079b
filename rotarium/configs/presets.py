"""The 370M and 1.3B presets of every family, by name; each family's config class lists its own.

Each combines with any positional option: ``preset_config("gla-370m", position_encoding="selective_rope")``.
"""
from __future__ import annotations

from typing import Any

from rotarium.models.configuration import CONFIGS, RotariumConfig

# name -> (family, the preset's fields beyond those every preset shares)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    name: (family, values) for family, config in CONFIGS.items() for name, values in config.presets.items()}


def preset_config(name: str, **overrides: Any) -> RotariumConfig:
    """The config of preset ``name`` with ``overrides`` (any config field, e.g. ``position_encoding``) applied."""
    return RotariumConfig.from_preset(name, **overrides)
