"""rotarium: linear recurrent sequence models with one pluggable positional layer.

``import rotarium`` registers the four model types with transformers' Auto classes.
"""
from rotarium.configs import PRESETS, preset_config
from rotarium.models import FAMILY_CLASSES, RotariumCache, RotariumConfig

# Each family's config, model and causal-LM classes under their names (GLAConfig, GLAModel, GLAForCausalLM, ...)
globals().update(FAMILY_CLASSES)

__version__ = "0.1.0"


def __getattr__(name: str):
    # The converter lives with the Hub tools, which a plain `import rotarium` (model loading) does not need.
    if name == "convert_checkpoint":
        from rotarium.hub.convert import convert_checkpoint

        return convert_checkpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [  # noqa: PLE0604  (the families' class names, read from the registry)
    "PRESETS", "RotariumCache", "RotariumConfig", "convert_checkpoint", "preset_config", *FAMILY_CLASSES,
]
