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


def __getattr__(name: str):
    # The converter lives with the Hub tools, which a plain `import rotarium` (model loading) does not need.
    if name == "convert_checkpoint":
        from rotarium.hub.convert import convert_checkpoint

        return convert_checkpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "PRESETS", "DeltaNetConfig", "DeltaNetForCausalLM", "DeltaNetModel", "FoXConfig", "FoXForCausalLM", "FoXModel",
    "GLAConfig", "GLAForCausalLM", "GLAModel", "RotariumCache", "RotariumConfig", "TransformerConfig",
    "TransformerForCausalLM", "TransformerModel", "convert_checkpoint", "preset_config",
]
