"""Configs, the shared model and causal-LM head, the cache; registered with transformers' Auto classes."""
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from rotarium.models.cache import RotariumCache
from rotarium.models.configuration import CONFIGS, NoFlaPeer, RotariumConfig
from rotarium.models.loading import load_pretrained, loading_problems, with_rope_parameters
from rotarium.models.modeling import (
    FAMILY_MODELS,
    MIXERS,
    FamilyClasses,
    RotariumForCausalLM,
    RotariumModel,
    RotariumPreTrainedModel,
    build_mixer,
    set_activation_checkpointing,
)
from rotarium.models.remote_code import prepare_save

# Each family's config, model and causal-LM classes under their names (GLAConfig, GLAModel, GLAForCausalLM, ...),
# read from the families' registry.
FAMILY_CLASSES: dict[str, type] = {cls.__name__: cls for record in FAMILY_MODELS.values() for cls in record}
globals().update(FAMILY_CLASSES)


def register_auto_classes() -> None:
    """Makes ``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM`` know every family's model type.

    The ``rotarium_*`` model types never collide with fla's own (``gla``, ``delta_net``, ...)."""
    for config_class, model_class, lm_class in FAMILY_MODELS.values():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModel.register(config_class, model_class, exist_ok=True)
        AutoModelForCausalLM.register(config_class, lm_class, exist_ok=True)


register_auto_classes()
# save_pretrained writes the self-contained model code; the bundler is handed to the models here rather than
# imported by them, so that it is not part of the code it writes.
RotariumPreTrainedModel.code_writer = staticmethod(prepare_save)

__all__ = [  # noqa: PLE0604  (the families' class names, read from the registry)
    "CONFIGS", "FAMILY_CLASSES", "FAMILY_MODELS", "MIXERS", "FamilyClasses", "NoFlaPeer", "RotariumCache",
    "RotariumConfig", "RotariumForCausalLM", "RotariumModel", "RotariumPreTrainedModel", "build_mixer",
    "load_pretrained", "loading_problems", "register_auto_classes", "set_activation_checkpointing",
    "with_rope_parameters", *FAMILY_CLASSES,
]
