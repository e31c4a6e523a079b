"""Configs, the shared model and causal-LM head, the cache; registered with transformers' Auto classes."""
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from rotarium.models.cache import RotariumCache
from rotarium.models.configuration import (
    CONFIGS,
    DeltaNetConfig,
    FoXConfig,
    GLAConfig,
    RotariumConfig,
    TransformerConfig,
)
from rotarium.models.loading import load_pretrained, loading_problems, with_rope_parameters
from rotarium.models.modeling import (
    FAMILY_MODELS,
    DeltaNetForCausalLM,
    DeltaNetModel,
    FamilyClasses,
    FoXForCausalLM,
    FoXModel,
    GLAForCausalLM,
    GLAModel,
    RotariumForCausalLM,
    RotariumModel,
    RotariumPreTrainedModel,
    TransformerForCausalLM,
    TransformerModel,
    set_activation_checkpointing,
)
from rotarium.models.remote_code import prepare_save


def register_auto_classes() -> None:
    """Makes ``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM`` know the four model types.

    The ``rotarium_*`` model types never collide with fla's own (``gla``, ``delta_net``, ...)."""
    for config_class, model_class, lm_class in FAMILY_MODELS.values():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModel.register(config_class, model_class, exist_ok=True)
        AutoModelForCausalLM.register(config_class, lm_class, exist_ok=True)


register_auto_classes()
# save_pretrained writes the self-contained model code; the bundler is handed to the models here rather than
# imported by them, so that it is not part of the code it writes.
RotariumPreTrainedModel.code_writer = staticmethod(prepare_save)

__all__ = [
    "CONFIGS", "FAMILY_MODELS", "DeltaNetConfig", "DeltaNetForCausalLM", "DeltaNetModel", "FamilyClasses", "FoXConfig",
    "FoXForCausalLM", "FoXModel", "GLAConfig", "GLAForCausalLM", "GLAModel", "RotariumCache", "RotariumConfig",
    "RotariumForCausalLM", "RotariumModel", "RotariumPreTrainedModel", "TransformerConfig", "TransformerForCausalLM",
    "TransformerModel", "load_pretrained", "loading_problems", "register_auto_classes",
    "set_activation_checkpointing", "with_rope_parameters",
]
