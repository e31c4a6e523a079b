"""Configurations of the four families: the shared fields on :class:`RotariumConfig`, a family's own on its class.

Every field is an argument of the ``__init__`` of the one class that defines it, typed and documented there (as
transformers' configs do), so that ``help(GLAConfig)`` shows it. The model's fields belong to :class:`RotariumConfig`;
the positional layer's are declared once, by :class:`rotarium.layers.PositionalSettings`, and :class:`RotariumConfig`
takes them as keyword arguments whose signature and documentation are derived from that declaration. A family class
defines its mixer's options and its presets, and repeats a shared field only to change its default
(``TransformerConfig.position_encoding``).

A family's config class is its declaration (docs/design.md §6): besides its fields and presets it names its mixer
class (``mixer_class``) and fla's model computing the same (:meth:`RotariumConfig.fla_peer`), and
:data:`FAMILY_CONFIGS` lists it; ``rotarium.models.modeling`` derives its model classes and its record from it.
"""
from __future__ import annotations

import difflib
import inspect
import json
import textwrap
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, fields
from functools import cache
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from rotarium.layers import PositionalSettings
from rotarium.layers.attention import ForgettingAttention, TransformerAttention
from rotarium.layers.linear_attention import DeltaNet, GatedLinearAttention
from rotarium.layers.mlp import default_intermediate_size
from rotarium.layers.positional import (
    ROPE_FREQUENCY_ENCODINGS,
    ROPE_PARAMETERS_FIELDS,
    config_field,
    rope_fields_in,
    rope_type_of,
)

# What every preset shares: untied embeddings, the Llama-2 / Mistral vocabulary, 24 layers.
PRESET_BASE: dict[str, Any] = {"vocab_size": 32000, "num_hidden_layers": 24, "tie_word_embeddings": False}
# What GPT-2-shaped presets share over the base: GPT-2's vocabulary, its special token (<|endoftext|> begins and ends
# every document) and context, tied embeddings.
GPT2_SHAPE: dict[str, Any] = {"vocab_size": 50257, "bos_token_id": 50256, "eos_token_id": 50256,
                              "max_position_embeddings": 1024, "tie_word_embeddings": True, "rope_theta": 10000.0}
# fla fixes the epsilon of its QK-norms (its RMSNorm's and GroupNorm's default), whatever `norm_eps` says.
FLA_QK_NORM_EPS = 1e-5


class NoFlaPeer(Exception):
    """fla has no model that computes what a config does (:meth:`RotariumConfig.fla_peer`): the message says why."""


@cache
def transformers_config_keys() -> frozenset[str]:
    """The keys every transformers config has (``dtype``, ``architectures``, ...), which a config keeps but which are
    not rotarium fields."""
    return frozenset(PretrainedConfig().to_dict())


# Where RotariumConfig's docstring lists the positional fields, and a family's its own, filled from their
# declarations (PositionalSettings, the family's `family_fields`)
POSITIONAL_DOCS_PLACEHOLDER = "        {positional fields}\n"
FAMILY_DOCS_PLACEHOLDER = "        {family fields}\n"


class RotariumConfig(PretrainedConfig):
    r"""The fields every family shares: the model's sizes, its special tokens and the positional layer's options.

    A family's class sets ``model_type``, ``family``, ``description``, ``default_num_heads``, ``presets``,
    ``mixer_class`` (its token mixer, built from :meth:`mixer_kwargs`), :meth:`fla_peer` and ``family_fields``, a
    frozen dataclass that declares its own fields once (as :class:`PositionalSettings` does the positional ones): its
    ``__init__``, signature, documented arguments and ``mixer_fields`` (those of its fields that go to the mixer) are
    derived from it when the class is defined; its entry in :data:`FAMILY_CONFIGS` registers it. Every field is
    validated at construction, with a ``ValueError`` that names it.

    A family's ``fla_peer(head_k_dim, head_v_dim)`` returns ``(fla model type, fla config kwargs)`` of fla's model
    that computes what the config does, the inverse of ``rotarium.hub.convert.map_fla_config`` (fla's fused kernels
    and loss left at fla's defaults, how fla trains; ``head_*_dim``: the head sizes its mixer builds), or raises
    :class:`NoFlaPeer` saying why fla has none: the GPU check compares rotarium's training with it.

    Args:
        vocab_size (`int`, *optional*, defaults to 32000):
            Number of tokens: the rows of the embedding and of the LM head.
        hidden_size (`int`, *optional*, defaults to 1024):
            Width of the residual stream.
        num_hidden_layers (`int`, *optional*, defaults to 24):
            Number of blocks (mixer and feed-forward network, each behind a pre-norm).
        num_heads (`int`, *optional*):
            Query heads of every mixer. `None` takes the family's `default_num_heads`.
        intermediate_size (`int`, *optional*):
            Width of the SwiGLU feed-forward network. `None` takes 8/3 of `hidden_size`, rounded up to a multiple
            of 256.
        norm_eps (`float`, *optional*, defaults to 1e-6):
            Epsilon of every RMSNorm.
        initializer_range (`float`, *optional*, defaults to 0.02):
            Standard deviation of the initial weights, in (0, 1); the output projections that write into the
            residual stream start `sqrt(2 * num_hidden_layers)` times smaller.
        tie_word_embeddings (`bool`, *optional*, defaults to `False`):
            Whether the LM head shares the embedding's weights.
        use_cache (`bool`, *optional*, defaults to `True`):
            Whether `forward` returns a `RotariumCache` when not told otherwise (never in training or on packed
            inputs).
        pad_token_id (`int`, *optional*):
            Id of the padding token.
        bos_token_id (`int`, *optional*, defaults to 1):
            Id of the beginning-of-sequence token.
        eos_token_id (`int`, *optional*, defaults to 2):
            Id of the end-of-sequence token.
        {positional fields}
        kwargs:
            The family's fields, then transformers' own (`architectures`, `auto_map`, ...).
    """

    family: ClassVar[str]
    description: ClassVar[str]  # the family in words, as a model card names it
    default_num_heads: ClassVar[int]
    mixer_class: ClassVar[type[nn.Module]]  # the family's token mixer (rotarium.layers)
    family_fields: ClassVar[type]
    mixer_fields: ClassVar[tuple[str, ...]]  # derived from family_fields
    presets: ClassVar[dict[str, dict[str, Any]]]
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values", "cache"]
    # transformers' utilities and tests read the head count under its usual name
    attribute_map: ClassVar[dict[str, str]] = {"num_attention_heads": "num_heads"}

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
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        **kwargs,
    ):
        if not hasattr(type(self), "family"):
            raise TypeError("RotariumConfig is the families' common base; build a family's config ("
                            f"{', '.join(config.__name__ for config in CONFIGS.values())}) or "
                            "RotariumConfig.from_preset(name)")
        defaults = {f.name: f.default for f in fields(self.family_fields)}
        for name in self.mixer_fields:
            setattr(self, name, kwargs.pop(name, defaults[name]))
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_heads = self.default_num_heads if num_heads is None else num_heads
        # only None means the default: 0 is refused by validate_fields like any other size that cannot work
        self.intermediate_size = (default_intermediate_size(hidden_size) if intermediate_size is None
                                  else intermediate_size)
        self.norm_eps = norm_eps
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        positional = {f.name: kwargs.pop(f.name, f.default) for f in fields(PositionalSettings)}
        rope_parameters = positional.pop("rope_parameters")
        if isinstance(rope_parameters, Mapping):
            rope_parameters = dict(rope_parameters)
            positional.update(rope_fields_in(rope_parameters))  # the values in use, as in transformers
        for name, value in positional.items():
            setattr(self, name, value)
        # transformers' convention: a config carries `rope_parameters` only where its model has RoPE frequencies
        # (its utilities and tests take any config with the attribute for a RoPE model). A scaling given to another
        # option is kept for the settings to refuse by name. Set before transformers' init, which reads the
        # deprecated `rope_scaling` into it and standardises it in place.
        carries = (self.position_encoding in ROPE_FREQUENCY_ENCODINGS or rope_type_of(rope_parameters) != "default"
                   or (rope_parameters is not None and not isinstance(rope_parameters, dict))
                   or "rope_scaling" in kwargs)
        if carries:
            self.rope_parameters = rope_parameters
        try:
            super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                             tie_word_embeddings=tie_word_embeddings, **kwargs)
        except Exception as error:  # transformers' class validators wrap their ValueError in huggingface_hub's error
            if isinstance(error, ValueError) or not isinstance(error.__cause__, (ValueError, TypeError)):
                raise
            raise ValueError(str(error.__cause__)) from error  # a bad config is a ValueError here, as everywhere
        if (hasattr(self, "rope_parameters") and self.position_encoding not in ROPE_FREQUENCY_ENCODINGS
                and rope_type_of(self.rope_parameters) == "default"):
            del self.rope_parameters  # an unscaled `rope_scaling` read in, or one saved before the option changed
        self.validate_fields()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # before transformers' own hook, which gives a class without an `__init__` of its own a generated one
        declaration = vars(cls).get("family_fields")
        if declaration is not None:
            _declare_family_fields(cls, declaration)
        super().__init_subclass__(**kwargs)

    def __setattr__(self, key: str, value: Any) -> None:
        super().__setattr__(key, value)
        # transformers' models read these inside rope_parameters: setting the field (or from_pretrained(...,
        # rope_theta=...)) sets it there too, so that both say the value in use
        if key in ROPE_PARAMETERS_FIELDS and isinstance(self.__dict__.get("rope_parameters"), dict):
            self.__dict__["rope_parameters"][key] = value

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> RotariumConfig:
        """transformers' ``from_dict``, where a ``rope_parameters`` override (``from_pretrained(path,
        rope_parameters=...)``) goes to ``__init__`` with the saved values: transformers sets an override only on a
        config that has the attribute, and would pass it to the model as an unknown argument otherwise, where it
        is a scaling to refuse by name."""
        if "rope_parameters" in kwargs:
            config_dict = {**config_dict, "rope_parameters": kwargs.pop("rope_parameters")}
        return super().from_dict(config_dict, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        # the fields as used, where rope_parameters was edited in place (transformers' way)
        output.update(rope_fields_in(output.get("rope_parameters")))
        return output

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> RotariumConfig:
        """The config of preset ``name`` (see ``rotarium.PRESETS``) with ``overrides`` (any config field, e.g.
        ``position_encoding``) applied. On a family's class, the preset must be one of that family."""
        owner = next((config for config in CONFIGS.values() if name in config.presets), None)
        if owner is None:
            names = sorted(preset for config in CONFIGS.values() for preset in config.presets)
            raise ValueError(f"unknown preset {name!r}; choose one of {names}")
        if cls is not RotariumConfig and owner is not cls:
            raise ValueError(f"preset {name!r} is a {owner.family} model, not {cls.family}; use {owner.__name__}")
        # a mistyped override would otherwise be kept as an unused attribute and the preset's value used in silence
        owner.validate_field_names(overrides, kind="override", transformers_keywords_too=True)
        return owner(**{**PRESET_BASE, **owner.presets[name], **overrides})

    @classmethod
    def validate_field_names(cls, keys: Iterable[str], *, kind: str = "field", prefix: str = "",
                          transformers_keywords_too: bool = False, unlisted: Collection[str] = ()) -> None:
        """Raises ``ValueError`` for the first of ``keys`` that is not a field of this class (nor, with
        ``transformers_keywords_too``, one of ``PretrainedConfig``'s own keys such as ``dtype``), naming the closest
        fields first and then every other one but ``unlisted``. ``prefix`` is how the caller's user spells the key's
        parent (e.g. ``model.options.``)."""
        names = cls.field_names()
        for key in keys:
            if key in names or (transformers_keywords_too and key in transformers_config_keys()):
                continue
            close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
            ordered = close + sorted(n for n in names if n not in close and n not in unlisted)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise ValueError(f"unknown {kind} `{prefix}{key}` for a {cls.family} model; {hint}"
                             f"the options are {', '.join(ordered)}")

    @classmethod
    def validate_options(cls, options: Iterable[str], *, prefix: str, set_elsewhere: Mapping[str, str]) -> None:
        """The check of a command's model options (``rotarium train``'s ``model.options``, ``rotarium synthetic``'s
        ``--option``): each is a field (:meth:`validate_field_names`) and none is one the command sets itself
        (``set_elsewhere`` maps those fields to the setting that sets them), so that a mistyped option stops the
        command instead of being ignored and recorded as if it had been used."""
        for key in options:
            if key in set_elsewhere:
                raise ValueError(f"`{prefix}{key}` is set by {set_elsewhere[key]}, not as an option")
        cls.validate_field_names(options, kind="model option", prefix=prefix, unlisted=set_elsewhere)

    @classmethod
    def field_names(cls) -> list[str]:
        """The fields of this class: the arguments of its ``__init__`` and of its rotarium bases'. transformers' own
        keyword arguments (``architectures``, ``dtype``, ...) are not fields: ``__init__`` passes them on to
        ``PretrainedConfig``, which keeps any keyword, so that ``from_pretrained`` reads every saved config."""
        names = [name for klass in cls.__mro__[:cls.__mro__.index(RotariumConfig) + 1] if "__init__" in vars(klass)
                 for name, parameter in inspect.signature(klass.__init__).parameters.items()
                 if name != "self" and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)]
        return list(dict.fromkeys(names))

    def positional_values(self) -> dict[str, Any]:
        """The positional fields by name; ``rope_parameters`` is None where the config does not carry it."""
        return {f.name: getattr(self, f.name, f.default) for f in fields(PositionalSettings)}

    @property
    def positional_settings(self) -> PositionalSettings:
        """The positional fields as the layer's settings, which check them when made."""
        return PositionalSettings.from_dict(self.positional_values())

    def mixer_kwargs(self) -> dict[str, Any]:
        return {"hidden_size": self.hidden_size, "num_heads": self.num_heads, "norm_eps": self.norm_eps,
                "positional": self.positional_settings,
                **{name: getattr(self, name) for name in self.mixer_fields}}

    def fla_shared_fields(self) -> dict[str, Any]:
        """The fla config kwargs every fla model type takes; :class:`NoFlaPeer` for a config with a positional layer
        (fla's models have none)."""
        if self.position_encoding != "nope":
            raise NoFlaPeer(f"fla's models have no {self.position_encoding} positional layer")
        shared = {name: getattr(self, name) for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "intermediate_size", "norm_eps",
            "initializer_range", "tie_word_embeddings", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id")}
        return {**shared, "hidden_act": "swish"}

    def _validate_longrope_rope_parameters(self, rope_parameters: dict[str, Any],
                                           ignore_keys: set[str] | None = None) -> None:
        """transformers' LongRoPE check, less its factor-list lengths: it sizes the lists by ``head_dim``, which a
        rotarium config leaves None where the family derives its key head size (GLA's ``expand_k``, say). The RoPE
        layer checks the lengths against the size it rotates, and the values are checked with every scaling's
        (``rotarium.layers.positional``)."""
        self._check_received_keys("longrope", set(rope_parameters),
                                  {"rope_type", "short_factor", "long_factor", "original_max_position_embeddings"},
                                  {"rope_theta", "attention_factor", "factor", "partial_rotary_factor"},
                                  ignore_keys=ignore_keys)

    def validate_fields(self) -> None:
        """Raises ``ValueError`` naming the first field that cannot work."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        if not 0 < self.initializer_range < 1:
            raise ValueError(f"`initializer_range` must be in (0, 1), got {self.initializer_range!r}")
        # Building the mixer on the meta device runs every shape check of the layers (the positional settings' among
        # them) without allocating anything.
        with torch.device("meta"):
            self.mixer_class(**self.mixer_kwargs())


def _declare_fields(config_class: type[RotariumConfig], declaration: type, placeholder: str,
                    kind: inspect._ParameterKind, *, bare_numbers: bool) -> None:
    """Lists the fields of ``declaration`` (a dataclass of :func:`config_field`) in ``config_class``'s ``__init__``
    signature (of ``kind``, with their types and defaults, for ``help()``, ``inspect`` and
    :meth:`RotariumConfig.field_names`, before its ``**kwargs``) and in its docstring's arguments, where
    ``placeholder`` stands, in transformers' format (``bare_numbers``: numbers as transformers' own configs show
    them, without code quotes)."""
    init = config_class.__init__
    signature = inspect.signature(init)
    explicit = [p for p in signature.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    var_keyword = [p for p in signature.parameters.values() if p.kind == p.VAR_KEYWORD]
    declared = [inspect.Parameter(f.name, kind, default=f.default, annotation=f.type) for f in fields(declaration)]
    init.__signature__ = signature.replace(parameters=[*explicit, *declared, *var_keyword])
    entries = []
    for f in fields(declaration):
        shown = json.dumps(f.default) if isinstance(f.default, str) else repr(f.default)
        if not (bare_numbers and isinstance(f.default, (int, float)) and not isinstance(f.default, bool)):
            shown = f"`{shown}`"
        default = "" if f.default is None else f", defaults to {shown}"
        doc = textwrap.fill(f.metadata["doc"], width=116, initial_indent=" " * 12, subsequent_indent=" " * 12,
                            break_on_hyphens=False)
        entries.append(f"        {f.name} (`{f.type.removesuffix(' | None')}`, *optional*{default}):\n{doc}\n")
    config_class.__doc__ = config_class.__doc__.replace(placeholder, "".join(entries))


def _declare_family_fields(config_class: type[RotariumConfig], declaration: type) -> None:
    """Gives a family's class its ``__init__``, which takes the fields of ``declaration`` (positionally too, in
    their order) and passes them to :class:`RotariumConfig`'s, its signature and documented arguments, and its
    ``mixer_fields``: the declared fields that are not shared ones (a shared one declared by a family changes only
    its default)."""
    names = [f.name for f in fields(declaration)]
    shared = inspect.signature(RotariumConfig.__init__).parameters

    def __init__(self: RotariumConfig, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__}() takes at most {len(names)} positional arguments "
                            f"({', '.join(names)}), got {len(args)}")
        for name, value in zip(names, args):
            if name in kwargs:
                raise TypeError(f"{type(self).__name__}() got multiple values for argument {name!r}")
            kwargs[name] = value
        for f in fields(declaration):
            kwargs.setdefault(f.name, f.default)
        RotariumConfig.__init__(self, **kwargs)

    __init__.__qualname__ = f"{config_class.__qualname__}.__init__"
    __init__.__signature__ = inspect.Signature([inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                                                inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
    config_class.__init__ = __init__
    config_class.mixer_fields = tuple(name for name in names if name not in shared)
    _declare_fields(config_class, declaration, FAMILY_DOCS_PLACEHOLDER, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                    bare_numbers=True)


_declare_fields(RotariumConfig, PositionalSettings, POSITIONAL_DOCS_PLACEHOLDER, inspect.Parameter.KEYWORD_ONLY,
                bare_numbers=False)


@dataclass(frozen=True)
class GLAFields:
    """The fields of :class:`GLAConfig`, declared once: its signature, docstring, attributes and mixer
    arguments are read from here. A field that :class:`RotariumConfig` has too changes only its default."""

    expand_k: float = config_field(
        0.5, "Width of the keys (and queries) as a fraction of `hidden_size`, split over the heads.")
    expand_v: float = config_field(1.0, "Width of the values as a fraction of `hidden_size`, split over the heads.")
    use_short_conv: bool = config_field(
        True, "Whether queries, keys and values pass through a causal depthwise convolution.")
    conv_size: int = config_field(4, "Kernel size of those convolutions.")
    gate_low_rank_dim: int = config_field(16, "Rank of the projection that computes the decay gate.")
    gate_logit_normalizer: float = config_field(16.0, "The log decay is `logsigmoid(gate) / gate_logit_normalizer`.")
    head_dim: int | None = config_field(
        None, "Size of each key (and query) head. `None`: the heads split `expand_k * hidden_size`. When given, "
        "`expand_k` is unused, the value heads have `head_dim * expand_v` features and `num_heads` need not "
        "divide `hidden_size`.")
    rotary_gate_per_pair: bool = config_field(
        True, "With a positional option that rotates keys, one decay per rotated pair of key features, so that the "
        "decay commutes with the rotation (docs/design.md §3.4). `False`: one decay per key feature, as fla's GLA"
        " and the Selective RoPE reference's GLA, where the decay and the rotation do not commute. Without "
        "rotated keys both are the same.")


class GLAConfig(RotariumConfig):
    r"""A GLA model (Yang et al., 2024, "Gated Linear Attention Transformers with Hardware-Efficient Training"):
    linear attention with a data-dependent decay per key channel. `num_heads` defaults to 4; the other shared
    fields are those of [`RotariumConfig`].

    Args:
        {family fields}
        kwargs:
            The shared fields of [`RotariumConfig`].
    """

    model_type = "rotarium_gla"
    family = "gla"
    description = "GLA (Gated Linear Attention, Yang et al., 2024)"
    default_num_heads = 4
    mixer_class = GatedLinearAttention
    family_fields = GLAFields
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "gla-370m": {"hidden_size": 1024, "num_heads": 4, "expand_k": 0.5, "expand_v": 1.0, "use_short_conv": True},
        "gla-1.3b": {"hidden_size": 2048, "num_heads": 4, "expand_k": 0.5, "expand_v": 1.0, "use_short_conv": True},
    }

    def fla_peer(self, head_k_dim: int | None, head_v_dim: int | None) -> tuple[str, dict[str, Any]]:
        linear = {**self.fla_shared_fields(), "max_position_embeddings": self.max_position_embeddings}
        if (self.gate_low_rank_dim, self.gate_logit_normalizer, self.head_dim) != (16, 16.0, None):
            raise NoFlaPeer("fla's GLA fixes the gate's rank and normaliser at 16 and splits the width into heads")
        return "gla", {**linear, "expand_k": self.expand_k, "expand_v": self.expand_v,
                       "use_short_conv": self.use_short_conv, "conv_size": self.conv_size, "use_output_gate": True}


@dataclass(frozen=True)
class FoXFields:
    """The fields of :class:`FoXConfig`, declared once: its signature, docstring, attributes and mixer
    arguments are read from here. A field that :class:`RotariumConfig` has too changes only its default."""

    num_kv_heads: int | None = config_field(
        None, "Key and value heads (grouped-query attention); `None`: as many as `num_heads`.")
    head_dim: int | None = config_field(None, "Size of each head; `None`: `hidden_size // num_heads`.")
    qk_norm: bool = config_field(False, "Whether queries and keys pass through an RMSNorm per head.")
    qk_norm_per_head: bool = config_field(
        False, "Whether that QK-norm has a weight of its own per head (as fla's Forgetting Transformer and the FoX "
        "paper's \"Pro\" models) instead of one weight shared by the heads. Requires `qk_norm`.")
    qk_norm_eps: float | None = config_field(None, "Epsilon of the QK-norm; `None`: `norm_eps`. Requires `qk_norm`.")
    output_gate: bool = config_field(False, "Whether each head's output is gated by `sigmoid(W x)`.")
    attention_bias: bool = config_field(False, "Whether the query, key and value projections have a bias.")


class FoXConfig(RotariumConfig):
    r"""A FoX model, the Forgetting Transformer (Lin et al., ICLR 2025, "Forgetting Transformer: Softmax Attention
    with a Forget Gate"): softmax attention whose scores are decayed by a data-dependent forget gate per head.
    `num_heads` defaults to 16; the other shared fields are those of [`RotariumConfig`].

    Args:
        {family fields}
        kwargs:
            The shared fields of [`RotariumConfig`].
    """

    model_type = "rotarium_fox"
    family = "fox"
    description = "FoX (the Forgetting Transformer, Lin et al., ICLR 2025)"
    default_num_heads = 16
    mixer_class = ForgettingAttention
    family_fields = FoXFields
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "fox-370m": {"hidden_size": 1024, "num_heads": 16},
        "fox-1.3b": {"hidden_size": 2048, "num_heads": 32},
    }

    def fla_peer(self, head_k_dim: int | None, head_v_dim: int | None) -> tuple[str, dict[str, Any]]:
        shared = self.fla_shared_fields()
        if self.head_dim not in (None, self.hidden_size // self.num_heads):
            raise NoFlaPeer("fla's Forgetting Transformer splits the width into heads (no head_dim)")
        if self.qk_norm and (not self.qk_norm_per_head or self.qk_norm_eps != FLA_QK_NORM_EPS):
            raise NoFlaPeer(f"fla's Forgetting Transformer's QK-norm has a weight per head and epsilon "
                            f"{FLA_QK_NORM_EPS}")
        return "forgetting_transformer", {**shared, "num_kv_heads": self.num_kv_heads,
                                          "qkv_bias": self.attention_bias, "qk_norm": self.qk_norm,
                                          "use_output_gate": self.output_gate, "window_size": None}


@dataclass(frozen=True)
class DeltaNetFields:
    """The fields of :class:`DeltaNetConfig`, declared once: its signature, docstring, attributes and mixer
    arguments are read from here. A field that :class:`RotariumConfig` has too changes only its default."""

    expand_k: float = config_field(
        1.0, "Width of the keys (and queries) as a fraction of `hidden_size`, split over the heads.")
    expand_v: float = config_field(1.0, "Width of the values as a fraction of `hidden_size`, split over the heads.")
    use_short_conv: bool = config_field(
        True, "Whether queries, keys and values pass through a causal depthwise convolution.")
    conv_size: int = config_field(4, "Kernel size of those convolutions.")
    use_gated_delta: bool = config_field(
        False, "Whether the state decays as in Gated DeltaNet, `log a = -exp(A_log) * softplus(W_a x + dt_bias)`.")
    use_output_gate: bool = config_field(False, "Whether each head's output is gated by `silu(W x)`.")
    head_dim: int | None = config_field(
        None, "Size of each key (and query) head. `None`: the heads split `expand_k * hidden_size`. When given, "
        "`expand_k` is unused, the value heads have `head_dim * expand_v` features and `num_heads` need not "
        "divide `hidden_size` (Gated DeltaNet's published sizes: 6 heads of 256 at width 1024 or 2048).")


class DeltaNetConfig(RotariumConfig):
    r"""A DeltaNet model (Yang et al., 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence
    Length"): linear attention whose state is updated by the delta rule, with L2-normalised queries and keys.
    `num_heads` defaults to 8; the other shared fields are those of [`RotariumConfig`].

    Args:
        {family fields}
        kwargs:
            The shared fields of [`RotariumConfig`].
    """

    model_type = "rotarium_deltanet"
    family = "deltanet"
    description = "DeltaNet (linear attention with the delta rule, Yang et al., 2024)"
    default_num_heads = 8
    mixer_class = DeltaNet
    family_fields = DeltaNetFields
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "deltanet-370m": {"hidden_size": 1024, "num_heads": 8, "expand_k": 1.0, "expand_v": 1.0,
                          "use_short_conv": True},
        "deltanet-1.3b": {"hidden_size": 2048, "num_heads": 16, "expand_k": 1.0, "expand_v": 1.0,
                          "use_short_conv": True},
    }

    def fla_peer(self, head_k_dim: int | None, head_v_dim: int | None) -> tuple[str, dict[str, Any]]:
        linear = {**self.fla_shared_fields(), "max_position_embeddings": self.max_position_embeddings}
        if not self.use_short_conv:
            raise NoFlaPeer("fla's DeltaNet applies SiLU to q, k, v even without its convolutions")
        common = {**linear, "use_short_conv": True, "conv_size": self.conv_size, "use_gate": self.use_output_gate}
        if self.use_gated_delta:
            return "gated_deltanet", {**common, "head_dim": head_k_dim, "expand_v": head_v_dim / head_k_dim}
        if self.head_dim is not None:
            raise NoFlaPeer("fla's DeltaNet splits the width into heads (no head_dim)")
        return "delta_net", {**common, "expand_k": self.expand_k, "expand_v": self.expand_v}


@dataclass(frozen=True)
class TransformerFields:
    """The fields of :class:`TransformerConfig`, declared once: its signature, docstring, attributes and mixer
    arguments are read from here. A field that :class:`RotariumConfig` has too changes only its default."""

    num_kv_heads: int | None = config_field(
        None, "Key and value heads (grouped-query attention); `None`: as many as `num_heads`.")
    head_dim: int | None = config_field(None, "Size of each head; `None`: `hidden_size // num_heads`.")
    attention_bias: bool = config_field(False, "Whether the query, key and value projections have a bias.")
    qk_norm: bool = config_field(
        False, "Whether queries and keys pass through an RMSNorm per head (one weight shared by the heads, as fla's "
        "Transformer).")
    qk_norm_per_head: bool = config_field(
        False, "Whether that QK-norm has a weight of its own per head. Requires `qk_norm`.")
    qk_norm_eps: float | None = config_field(None, "Epsilon of the QK-norm; `None`: `norm_eps`. Requires `qk_norm`.")
    position_encoding: str = config_field("rope", "As in [`RotariumConfig`], with RoPE as the default.")


class TransformerConfig(RotariumConfig):
    r"""A Transformer (Llama's layout): softmax attention. `num_heads` defaults to 16 and `position_encoding` to
    `"rope"`; the other shared fields are those of [`RotariumConfig`].

    Args:
        {family fields}
        kwargs:
            The shared fields of [`RotariumConfig`].
    """

    model_type = "rotarium_transformer"
    family = "transformer"
    description = "Transformer (Llama-style: RMSNorm, SwiGLU, softmax attention)"
    default_num_heads = 16
    mixer_class = TransformerAttention
    family_fields = TransformerFields
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "transformer-370m": {"hidden_size": 1024, "num_heads": 16, "rope_theta": 10000.0},
        "transformer-1.3b": {"hidden_size": 2048, "num_heads": 32, "rope_theta": 10000.0},
        # The RoVE paper's GPT-2-shaped models (GPT-2 small and medium: context 1024, GPT-2's vocabulary, tied
        # embeddings). The SwiGLU width keeps GPT-2's 8 d^2 MLP parameters a layer: 8d/3, rounded up to a
        # multiple of 64 where it is not whole.
        "transformer-124m": {"hidden_size": 768, "num_heads": 12, "num_hidden_layers": 12, "intermediate_size": 2048,
                             **GPT2_SHAPE},
        "transformer-354m": {"hidden_size": 1024, "num_heads": 16, "num_hidden_layers": 24,
                             "intermediate_size": 2752, **GPT2_SHAPE},
    }

    def fla_peer(self, head_k_dim: int | None, head_v_dim: int | None) -> tuple[str, dict[str, Any]]:
        raise NoFlaPeer("fla's Transformer cannot be built without flash-attn (not a dependency of fla)")


# Every family, once, in the order every list of them takes: adding a family is its mixer, its config class above and
# its entry here. rotarium.models.modeling derives each one's model classes and checks its record whole.
FAMILY_CONFIGS: tuple[type[RotariumConfig], ...] = (GLAConfig, FoXConfig, DeltaNetConfig, TransformerConfig)
# The family configs by name, read from the families' registry (`rotarium.models.modeling.FAMILY_MODELS`, which
# fills it on import once it has checked each record, as the models import the configs and not the other way).
# Importing any rotarium.models module imports the package, and with it the registry, first.
CONFIGS: dict[str, type[RotariumConfig]] = {}
