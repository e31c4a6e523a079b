"""Configurations of the four families: one shared base, a family adds its model type and defaults."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers import PretrainedConfig

from rotarium.layers import PositionalSettings, build_mixer
from rotarium.layers.mlp import default_intermediate_size

POSITIONAL_FIELDS = tuple(PositionalSettings().to_dict())


class RotariumConfig(PretrainedConfig):
    """Fields shared by every family, plus the positional layer's options (see :class:`PositionalSettings`).

    A family sets ``model_type``, ``family``, ``mixer_options`` (its mixer's own fields with their defaults) and
    ``family_defaults`` (its defaults for shared fields). Every field is validated here, at construction, with an
    error that names it.
    """

    family: ClassVar[str]
    mixer_options: ClassVar[dict[str, Any]] = {}
    family_defaults: ClassVar[dict[str, Any]] = {}
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        num_hidden_layers: int = 24,
        num_heads: int | None = None,
        intermediate_size: int | None = None,
        norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        max_position_embeddings: int = 2048,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        **kwargs,
    ):
        kwargs = {**self.family_defaults, **kwargs}
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_heads = num_heads if num_heads is not None else kwargs.pop("num_heads", 4)
        kwargs.pop("num_heads", None)
        self.intermediate_size = intermediate_size or default_intermediate_size(hidden_size)
        self.norm_eps = norm_eps
        self.initializer_range = initializer_range
        self.max_position_embeddings = max_position_embeddings
        self.use_cache = use_cache
        defaults = PositionalSettings().to_dict()
        for name in POSITIONAL_FIELDS:
            setattr(self, name, kwargs.pop(name, defaults[name]))
        for name, default in self.mixer_options.items():
            setattr(self, name, kwargs.pop(name, default))
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.check()

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> RotariumConfig:
        """A preset of ``rotarium.configs.PRESETS`` (of this family) with ``overrides`` applied."""
        from rotarium.configs.presets import PRESETS, preset_config

        family = PRESETS.get(name, (None,))[0]
        if family is not None and cls is not RotariumConfig and family != cls.family:
            raise ValueError(f"preset {name!r} is a {family} model, not {cls.family}; use {CONFIGS[family].__name__}")
        return preset_config(name, **overrides)

    @property
    def positional_settings(self) -> PositionalSettings:
        return PositionalSettings.from_dict({name: getattr(self, name) for name in POSITIONAL_FIELDS})

    def mixer_kwargs(self) -> dict[str, Any]:
        return {"hidden_size": self.hidden_size, "num_heads": self.num_heads, "norm_eps": self.norm_eps,
                "positional": self.positional_settings,
                **{name: getattr(self, name) for name in self.mixer_options}}

    def check(self) -> None:
        """Raises ``ValueError`` naming the first field that cannot work."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        if not 0 < self.initializer_range < 1:
            raise ValueError(f"`initializer_range` must be in (0, 1), got {self.initializer_range!r}")
        settings = self.positional_settings
        settings.validate()
        # Building the mixer on the meta device runs every shape check of the layers without allocating anything.
        with torch.device("meta"):
            build_mixer(self.family, **self.mixer_kwargs())


class GLAConfig(RotariumConfig):
    model_type = "rotarium_gla"
    family = "gla"
    mixer_options = {"expand_k": 0.5, "expand_v": 1.0, "use_short_conv": True, "conv_size": 4,
                     "gate_low_rank_dim": 16, "gate_logit_normalizer": 16.0}
    family_defaults = {"num_heads": 4}

    def __init__(self, **kwargs):  # transformers turns config subclasses without an __init__ into dataclasses
        super().__init__(**kwargs)


class FoXConfig(RotariumConfig):
    model_type = "rotarium_fox"
    family = "fox"
    mixer_options = {"num_kv_heads": None, "head_dim": None, "qk_norm": False, "output_gate": False,
                     "attention_bias": False}
    family_defaults = {"num_heads": 16}

    def __init__(self, **kwargs):
        super().__init__(**kwargs)


class DeltaNetConfig(RotariumConfig):
    model_type = "rotarium_deltanet"
    family = "deltanet"
    mixer_options = {"expand_k": 1.0, "expand_v": 1.0, "use_short_conv": True, "conv_size": 4,
                     "use_gated_delta": False, "use_output_gate": False}
    family_defaults = {"num_heads": 8}

    def __init__(self, **kwargs):
        super().__init__(**kwargs)


class TransformerConfig(RotariumConfig):
    model_type = "rotarium_transformer"
    family = "transformer"
    mixer_options = {"num_kv_heads": None, "head_dim": None, "attention_bias": False}
    family_defaults = {"num_heads": 16, "position_encoding": "rope"}

    def __init__(self, **kwargs):
        super().__init__(**kwargs)


CONFIGS: dict[str, type[RotariumConfig]] = {c.family: c for c in (GLAConfig, FoXConfig, DeltaNetConfig,
                                                                   TransformerConfig)}
