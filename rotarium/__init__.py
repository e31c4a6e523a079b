"""rotarium: linear recurrent sequence models with one pluggable positional layer.

``import rotarium`` registers the four model types with transformers' Auto classes.
"""
from rotarium.configs import PRESETS, preset_config
from rotarium.models import (
    DeltaNetConfig,
    DeltaNetForCausalLM,
    DeltaNetModel,
    FoXConfig,
    FoXForCausalLM,
    FoXModel,
    GLAConfig,
    GLAForCausalLM,
    GLAModel,
    RotariumCache,
    RotariumConfig,
    TransformerConfig,
    TransformerForCausalLM,
    TransformerModel,
)

__version__ = "0.1.0"

__all__ = [
    "PRESETS", "DeltaNetConfig", "DeltaNetForCausalLM", "DeltaNetModel", "FoXConfig", "FoXForCausalLM", "FoXModel",
    "GLAConfig", "GLAForCausalLM", "GLAModel", "RotariumCache", "RotariumConfig", "TransformerConfig",
    "TransformerForCausalLM", "TransformerModel", "preset_config",
]
