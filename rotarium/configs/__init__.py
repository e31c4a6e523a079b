"""Ready-made model presets (docs/design.md §4); training recipes and accelerate configs live beside them."""
from rotarium.configs.presets import PRESETS, preset_config

__all__ = ["PRESETS", "preset_config"]
