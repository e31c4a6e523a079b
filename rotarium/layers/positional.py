"""The positional layer: NoPE, RoPE, RoVE and Selective RoPE behind one interface.

Every mixer calls it the same way, after its q/k/v projections (and short convolutions and q/k normalisation) and
before its kernel::

    enc = self.positional(q, k, v, x, seq, state)
    o = kernel(enc.q, enc.k, enc.v, decay ...)  # enc.log_decay: a per-head decay, Selective RoPE on decay-less mixers
    o = enc.restore(o)                           # RoVE rotates outputs back; identity otherwise

Every option is a rotation applied outside the kernel, so the same kernels serve all of them. The rotations
themselves (q and k on pairs ``(i, i + R/2)``, RoVE's values on adjacent pairs) are kernels of
:mod:`rotarium.ops.rotary`; this module holds the options and the math that turns positions or inputs into angles
(docs/design.md §3).
"""
from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RotaryEmbeddingConfigMixin

from rotarium.layers.conv import ShortConvolution
from rotarium.layers.sequence import SequenceInfo
from rotarium.layers.state import DecodingState, RotaryState, SelectiveRoPEState
from rotarium.ops.convolution import ACTIVATIONS
from rotarium.ops.cumsum import segment_cumsum
from rotarium.ops.l2norm import head_l2norm_and_linear
from rotarium.ops.rotary import rotate_adjacent_pairs, rotate_half_pairs
from rotarium.ops.utils import plain_linear

SPECTRA = ("rope", "rfa")
# transformers' RoPE scalings; "default" (or no `rope_parameters`) is unscaled RoPE
ROPE_SCALINGS = ("linear", "dynamic", "yarn", "llama3", "longrope")
# the scalings whose frequencies depend on the length of the sequence at hand (transformers' `dynamic_rope_update`)
LENGTH_DEPENDENT_SCALINGS = ("dynamic", "longrope")
# Fields that transformers (>= 5) keeps inside `rope_parameters` as well, where its models read them
ROPE_PARAMETERS_FIELDS = ("rope_theta", "partial_rotary_factor")


def rope_type_of(parameters: Any) -> str:
    """The ``rope_type`` of transformers' ``rope_parameters`` (the legacy key ``type`` of the deprecated
    ``rope_scaling`` reads as it): ``"default"``, unscaled RoPE, where it names none or is not a dict."""
    if not isinstance(parameters, Mapping):
        return "default"
    return parameters.get("rope_type") or parameters.get("type") or "default"


def rope_fields_in(parameters: Any) -> dict[str, Any]:
    """The fields of :data:`ROPE_PARAMETERS_FIELDS` that ``rope_parameters`` holds. As in transformers, whose models
    read them there, those are the values in use; the fields of the same names set the others."""
    if not isinstance(parameters, Mapping):
        return {}
    return {name: parameters[name] for name in ROPE_PARAMETERS_FIELDS if parameters.get(name) is not None}


def _is_real(value: Any) -> bool:
    """Whether ``value`` is a finite real number (not a bool, a string or NaN)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# The numbers of the scalings' keys: the bound each must pass (None: any finite number) and what would work.
# transformers' validation asks factor >= 1 of every scaling here (it stretches the training length); the others
# enter its functions as divisors or under logarithms.
_SCALING_NUMBERS: dict[str, tuple[str | None, str]] = {
    "factor": (">= 1", " (how many times the training length the scaling reaches, e.g. 4.0)"),
    "attention_factor": ("> 0", " (the softmax temperature's factor; leave it out for the scaling's own)"),
    "beta_fast": ("> 0", " (YaRN's rotation counts, 32 and 1 by default)"),
    "beta_slow": ("> 0", " (YaRN's rotation counts, 32 and 1 by default)"),
    "low_freq_factor": ("> 0", " (Llama 3 uses 1.0 and 4.0)"),
    "high_freq_factor": ("> 0", " (Llama 3 uses 1.0 and 4.0)"),
    "mscale": (None, ""),
    "mscale_all_dim": (None, ""),
}
_BOUNDS = {">= 1": lambda value: value >= 1, "> 0": lambda value: value > 0, None: lambda value: True}


def check_rope_parameters(parameters: Any) -> None:
    """Raises ``ValueError`` naming the key of transformers' ``rope_parameters`` (None or a dict) that cannot work,
    and what would: a ``rope_type`` of ``"default"`` or :data:`ROPE_SCALINGS`; the factors finite numbers, ``factor``
    >= 1 and the others > 0 (``high_freq_factor`` above ``low_freq_factor``); LongRoPE's per-pair factors lists of
    numbers > 0; ``original_max_position_embeddings`` a positive integer. transformers' own functions would give a
    math domain error, a TypeError or NaN frequencies instead. What depends on the model (the option, the number of
    rotated pairs) is checked where the model is built."""
    if parameters is None:
        return
    if not isinstance(parameters, Mapping):
        raise ValueError(  # noqa: TRY004  (a bad config value: configs raise ValueError, as transformers')
            f"`rope_parameters` must be a dict such as {{\"rope_type\": \"yarn\", \"factor\": 4.0}} or None, got "
            f"{parameters!r}")
    rope_type = rope_type_of(parameters)
    if rope_type != "default" and rope_type not in ROPE_SCALINGS:
        raise ValueError(f"`rope_parameters.rope_type` must be \"default\" or one of {ROPE_SCALINGS}, got "
                         f"{rope_type!r}")
    for key, (bound, hint) in _SCALING_NUMBERS.items():
        value = parameters.get(key)
        if value is not None and not (_is_real(value) and _BOUNDS[bound](value)):
            rule = "a finite number" + (f" {bound}" if bound else "")
            raise ValueError(f"`rope_parameters.{key}` must be {rule}{hint}, got {value!r}")
    low, high = parameters.get("low_freq_factor"), parameters.get("high_freq_factor")
    if low is not None and high is not None and not high > low:
        raise ValueError("`rope_parameters.high_freq_factor` must be greater than `rope_parameters.low_freq_factor` "
                         f"(the wavelengths between them are interpolated; Llama 3 uses 4.0 and 1.0), got {high!r} "
                         f"and {low!r}")
    for key in ("short_factor", "long_factor"):
        value = parameters.get(key)
        if value is not None and not (isinstance(value, (list, tuple)) and value and all(
                _is_real(item) and item > 0 for item in value)):
            raise ValueError(f"`rope_parameters.{key}` must be a list of finite numbers > 0, one per rotated key "
                             f"pair, got {value!r}")
    length = parameters.get("original_max_position_embeddings")
    if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < 1):
        raise ValueError("`rope_parameters.original_max_position_embeddings` must be a positive integer (the training "
                         f"length the scaling extends; leave it out for `max_position_embeddings`), got {length!r}")


def config_field(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class PositionalSettings:
    """The options of every positional encoding, under the names of the model configs' fields.

    This is the one declaration of those fields: the configs take each as a keyword argument with this default, and
    their signatures and documentation are derived from here (``doc`` of each field). A settings object is checked
    when it is made, so a layer never receives one that cannot work.
    """

    position_encoding: str = config_field(
        "nope", 'The positional layer: `"nope"`, `"rope"`, `"rove"` (RoPE on queries and keys, and Rotary Value '
        'Embeddings on the values) or `"selective_rope"` (input-dependent rotations).')
    rope_theta: float = config_field(10000.0, "Base of the RoPE and RoVE frequencies `base^(-2i/D)`.")
    partial_rotary_factor: float = config_field(
        1.0, "Fraction of each query and key head's features that RoPE and RoVE rotate, in (0, 1].")
    # transformers' RoPE scaling (`rope_type` and its keys); its original length defaults to max_position_embeddings
    rope_parameters: dict | None = config_field(  # noqa: RUF009 (the default is None; the call attaches the doc)
        None, 'transformers\' RoPE scaling of RoPE and RoVE: `rope_type` (`"default"`, `"linear"`, `"dynamic"`, '
        '`"yarn"`, `"llama3"` or `"longrope"`) and that type\'s keys (`factor`, ...), e.g. `{"rope_type": "yarn", '
        '"factor": 4.0}`, computed by transformers\' own functions; the deprecated `rope_scaling` reads into it. '
        "Settable at load time without retraining (`from_pretrained(path, rope_parameters=...)`). YaRN's attention "
        "factor applies to softmax mixers' logits only. Not for Selective RoPE (docs/design.md §3.5).")
    max_position_embeddings: int = config_field(
        2048, "The context length the model is trained at. No positional option limits the length; the evaluation "
        "of length extrapolation reads it as the training length, and a RoPE scaling as its original length unless "
        "`rope_parameters` names `original_max_position_embeddings`.")
    # Selective RoPE (Movahedi et al., "Selective Rotary Position Embedding", ICLR 2026; docs/design.md §3.4)
    selective_rope_rank: int | None = config_field(
        32, "Rank of Selective RoPE's angle projection `W_2 W_1`. `None`: a full-rank projection per head, with "
        "weight normalisation.")
    selective_rope_gain_per_head: bool = config_field(
        False, "With `selective_rope_rank=None`: one gain per head for the weight-normalised map (the reference "
        "code's full-rank parametrisation) instead of one per head and output pair.")
    selective_rope_conv_size: int = config_field(
        4, "Kernel size of the causal depthwise convolution over the projected angles.")
    selective_rope_activation: str | None = config_field(
        "silu", 'Activation after that convolution: `"silu"` or `None`.')
    selective_rope_bias: bool = config_field(
        False, "Whether the angular velocities get a learned offset, `omega + exp(b)`.")
    selective_rope_phase_gate: bool = config_field(
        False, "Whether the angular velocities are gated per head, `omega * sigmoid(W_p xh + c)`, where `xh` is the "
        "input split into one chunk per head, each L2-normalised.")
    selective_rope_temperature_base: float = config_field(
        500000.0, 'Base of the `"rope"` temperature spectrum `tau_i = tau_max * base^(-2i/K)`.')
    selective_rope_tau_max: float = config_field(1.0, "The largest temperature, `tau_max`.")
    selective_rope_spectrum: str = config_field(
        "rope", 'The temperatures: `"rope"` (geometric, as RoPE\'s frequencies) or `"rfa"` (the reference code\'s '
        "random-feature profile `tau_max * tan(a_i / 2) / max_i tan(a_i / 2)`, `a_i` evenly spaced from 0 to "
        "`selective_rope_rfa_theta * pi` over the key pairs).")
    selective_rope_rfa_theta: float = config_field(
        0.9999, 'Where the `"rfa"` profile ends, as a fraction of pi, in (0, 1).')
    selective_rope_learn_temperature: bool = config_field(
        False, "Whether the temperatures are trained rather than frozen.")
    selective_rope_skip_conv: bool = config_field(
        False, "Whether a fixed first difference replaces the learned convolution (the reference code's "
        "`skip_conv`): the angle is then the projection `phi_t` itself instead of a running sum of learned "
        "velocities.")
    selective_rope_decay: bool | None = config_field(
        None, "Whether Selective RoPE adds a per-head decay `logsigmoid(w^T x + b)`. `None`: exactly for the mixers "
        "without a decay of their own (Transformer, plain DeltaNet); `True` is refused for the others.")

    def __post_init__(self) -> None:
        # rope_theta and partial_rotary_factor inside rope_parameters are the ones used (see rope_fields_in)
        for name, value in rope_fields_in(self.rope_parameters).items():
            object.__setattr__(self, name, value)
        self.validate()

    @classmethod
    def from_dict(cls, values: dict) -> PositionalSettings:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    def to_dict(self) -> dict:
        return asdict(self)

    def rope_scaling(self) -> dict | None:
        """``rope_parameters`` as transformers' functions read them (``rope_type``, its keys, ``rope_theta``), or None
        where RoPE is unscaled. The legacy key ``type`` (of the deprecated ``rope_scaling``) reads as ``rope_type``."""
        rope_type = rope_type_of(self.rope_parameters)
        if rope_type == "default":
            return None
        parameters = dict(self.rope_parameters)
        for key in ("rope_type", "type"):
            parameters.pop(key, None)
        parameters.pop("partial_rotary_factor", None)  # the view's head size is the rotated size itself
        return {**parameters, "rope_type": rope_type, "rope_theta": float(self.rope_theta)}

    def validate(self) -> None:
        options = tuple(PositionalEncoding.registry)
        if self.position_encoding not in options:
            raise ValueError(f"`position_encoding` must be one of {options}, got {self.position_encoding!r}")
        inside = rope_fields_in(self.rope_parameters)  # a message names where its value came from
        theta, partial = (f"rope_parameters.{name}" if name in inside else name for name in ROPE_PARAMETERS_FIELDS)
        if not _is_real(self.partial_rotary_factor) or not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"`{partial}` must be in (0, 1], got {self.partial_rotary_factor!r}")
        if not _is_real(self.rope_theta) or self.rope_theta <= 1:
            raise ValueError(f"`{theta}` must be > 1, got {self.rope_theta!r}")
        self._validate_rope_parameters()
        if self.selective_rope_rank is not None and (
                not isinstance(self.selective_rope_rank, int) or self.selective_rope_rank < 1):
            raise ValueError(
                f"`selective_rope_rank` must be a positive int or None (full rank), got {self.selective_rope_rank!r}")
        if self.selective_rope_gain_per_head and self.selective_rope_rank is not None:
            raise ValueError("`selective_rope_gain_per_head` applies to the full-rank map: set `selective_rope_rank` "
                             f"to None, or leave the gain per pair (got rank {self.selective_rope_rank})")
        if self.selective_rope_activation not in ACTIVATIONS:
            raise ValueError(
                f"`selective_rope_activation` must be one of {ACTIVATIONS}, got {self.selective_rope_activation!r}")
        if self.selective_rope_spectrum not in SPECTRA:
            raise ValueError(
                f"`selective_rope_spectrum` must be one of {SPECTRA}, got {self.selective_rope_spectrum!r}")
        conv_size = self.selective_rope_conv_size
        if not isinstance(conv_size, int) or isinstance(conv_size, bool) or conv_size < 1:
            raise ValueError(f"`selective_rope_conv_size` must be an integer >= 1, got {conv_size!r}")
        # Finite numbers: a NaN passes every comparison unrefused and an infinity makes the temperatures NaN or 0, and
        # either reaches the outputs silently. Base 1 is the uniform spectrum (every pair turns at tau_max), which the
        # paper's state-tracking runs use.
        base = self.selective_rope_temperature_base
        if not (_is_real(base) and base > 0):
            raise ValueError(f"`selective_rope_temperature_base` must be a finite number > 0 (1.0: every pair at "
                             f"frequency tau_max), got {base!r}")
        if not (_is_real(self.selective_rope_rfa_theta) and 0 < self.selective_rope_rfa_theta < 1):
            raise ValueError(f"`selective_rope_rfa_theta` must be in (0, 1) (the \"rfa\" spectrum spans angles up to "
                             f"rfa_theta * pi), got {self.selective_rope_rfa_theta!r}")
        if not (_is_real(self.selective_rope_tau_max) and self.selective_rope_tau_max > 0):
            raise ValueError(f"`selective_rope_tau_max` must be a finite number > 0, got "
                             f"{self.selective_rope_tau_max!r}")

    def _validate_rope_parameters(self) -> None:
        check_rope_parameters(self.rope_parameters)
        if not isinstance(self.max_position_embeddings, int) or self.max_position_embeddings < 1:
            raise ValueError(f"`max_position_embeddings` must be a positive integer, got "
                             f"{self.max_position_embeddings!r}")
        if self.rope_scaling() is None:
            return
        refusal = PositionalEncoding.registry[self.position_encoding].rope_scaling_refusal
        if refusal is not None:
            raise ValueError(refusal)


@dataclass
class MixerSpec:
    """What the positional layer needs to know of the mixer it serves: its sizes, whether it decays its state or
    scores on its own (Selective RoPE adds a decay only where it does not), and how its kernel reads q and k."""

    hidden_size: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_k_dim: int
    head_v_dim: int
    has_decay: bool
    # The mixer's kernel reads each head's tokens as one [T, D] matrix (blockwise attention, SDPA): rotated q and k
    # are then written head-major ([B, H, T, D] in memory, handed over as [B, T, H, D] views), which spares the
    # kernel a copy of each. The chunked linear kernels relayout into chunks anyway and gain nothing from it.
    heads_major: bool = False
    # A RoPE scaling's attention factor (YaRN's mscale) tempers a softmax; the linear mixers have none (§3.5)
    softmax: bool = False


@dataclass
class PositionalOutput:
    """What the positional layer hands back to the mixer: the rotated q, k, v, the decay it adds, its new state."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    log_decay: torch.Tensor | None  # [B, T, H] float32, only where the layer adds a decay
    state: DecodingState | None  # to continue from; None for NoPE
    value_rotation: torch.Tensor | None = None  # RoVE: exp(i * angle) of each token's value pairs, complex64

    def restore(self, o: torch.Tensor) -> torch.Tensor:
        """Rotates each output back by its query's angle (RoVE); identity for the other options."""
        if self.value_rotation is None:
            return o
        return rotate_adjacent_pairs(o, self.value_rotation.conj())


def rope_frequencies(dim: int, base: float) -> torch.Tensor:
    """``base^(-2i/dim)`` for i in [0, dim/2), float64 on the CPU."""
    return base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)


@functools.lru_cache(maxsize=64)
def _frequencies_on(dim: int, base: float, device: torch.device) -> torch.Tensor:
    return rope_frequencies(dim, base).float().to(device)


class RopeConfigView(RotaryEmbeddingConfigMixin):
    """What transformers' RoPE functions read of a model config, for one rotation of ``dim`` features: its head size
    is ``dim`` with ``partial_rotary_factor`` 1 (transformers rotates ``int(head_dim * partial_rotary_factor)``
    features, which is ``dim``), so the same view serves RoPE's keys and RoVE's values. transformers' own
    standardisation fills ``original_max_position_embeddings`` from ``max_position_embeddings``."""

    def __init__(self, scaling: dict, dim: int, max_position_embeddings: int):
        self.rope_parameters = {**scaling, "partial_rotary_factor": 1.0}
        self.head_dim, self.hidden_size, self.num_attention_heads = dim, dim, 1
        self.max_position_embeddings = max_position_embeddings
        self.standardize_rope_params()


@functools.lru_cache(maxsize=64)
def _scaled_rope(scaling_json: str, dim: int, max_position_embeddings: int, seq_len: int | None
                 ) -> tuple[torch.Tensor, float]:
    scaling = json.loads(scaling_json)
    view = RopeConfigView(scaling, dim, max_position_embeddings)
    with torch.device("cpu"):  # also under the meta device the configs build their layers on
        kwargs = {} if seq_len is None else {"seq_len": seq_len}
        frequencies, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](view, torch.device("cpu"), **kwargs)
    return frequencies.float(), float(attention_factor)


@functools.lru_cache(maxsize=64)
def _scaled_frequencies_on(scaling_json: str, dim: int, max_position_embeddings: int, seq_len: int | None,
                           device: torch.device) -> torch.Tensor:
    return _scaled_rope(scaling_json, dim, max_position_embeddings, seq_len)[0].to(device)


def _frequencies(scaling_json: str | None, base: float, max_position_embeddings: int, dim: int, seq_len: int | None,
                 device: torch.device) -> torch.Tensor:
    """:meth:`RoPE.frequencies`, from the caches."""
    if scaling_json is None:
        return _frequencies_on(dim, base, device)
    return _scaled_frequencies_on(scaling_json, dim, max_position_embeddings, seq_len, device)


# named after this module, as rotarium.ops.opaque's operators are
@torch.library.custom_op(f"{__name__.replace('.', '_')}::rope_frequencies", mutates_args=())
def _compiled_frequencies(scaling_json: str | None, base: float, max_position_embeddings: int, dim: int,
                          seq_len: int | None, device: torch.device) -> torch.Tensor:
    """:func:`_frequencies` as one operator of a compiled graph, rather than the caches (and transformers' RoPE
    functions) traced into it; a copy, as an operator's output is its own."""
    return _frequencies(scaling_json, base, max_position_embeddings, dim, seq_len, device).clone()


@_compiled_frequencies.register_fake
def _(scaling_json: str | None, base: float, max_position_embeddings: int, dim: int, seq_len: int | None,
      device: torch.device) -> torch.Tensor:
    return torch.empty(dim // 2, dtype=torch.float32, device=device)


def scaled_rope(scaling: dict, dim: int, max_position_embeddings: int, seq_len: int | None = None
                ) -> tuple[torch.Tensor, float]:
    """transformers' frequencies ``[dim/2]`` (float32, CPU) and attention factor of the scaling ``scaling`` (a
    :meth:`PositionalSettings.rope_scaling`) over ``dim`` rotated features; ``seq_len`` is the length at hand for the
    length-dependent scalings (``dynamic``, ``longrope``)."""
    try:
        return _scaled_rope(json.dumps(scaling, sort_keys=True), dim, max_position_embeddings, seq_len)
    except KeyError as missing:
        raise ValueError(f"`rope_parameters` of rope_type {scaling['rope_type']!r} needs the key {missing}; see "
                         "transformers' `RopeParameters` for each type's keys") from None


class PositionalEncoding(nn.Module):
    """Base of the family. Subclasses set ``kind`` (the name ``position_encoding`` takes) and ``description`` and
    implement ``forward``; defining one registers it, and every list of the options is read from
    :attr:`registry` (:data:`POSITION_ENCODINGS`, :data:`ROPE_FREQUENCY_ENCODINGS`)."""

    kind: ClassVar[str]
    description: ClassVar[str]  # its name in words, as a model card gives it
    # Why transformers' RoPE scalings (`rope_parameters`) cannot apply to the option, the whole error message; None
    # for the options with RoPE frequencies, which a scaling rescales
    rope_scaling_refusal: ClassVar[str | None]
    registry: ClassVar[dict[str, type[PositionalEncoding]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        missing = [name for name in ("kind", "description", "rope_scaling_refusal") if not hasattr(cls, name)]
        if missing:
            raise TypeError(f"positional option {cls.__name__} does not declare {', '.join(missing)}")
        PositionalEncoding.registry[cls.kind] = cls

    def __init__(self, settings: PositionalSettings, mixer_spec: MixerSpec):
        super().__init__()
        self.settings, self.mixer_spec = settings, mixer_spec
        if mixer_spec.num_heads % mixer_spec.num_kv_heads:
            raise ValueError(f"`num_heads` ({mixer_spec.num_heads}) must be a multiple of `num_kv_heads` "
                             f"({mixer_spec.num_kv_heads})")

    @property
    def adds_decay(self) -> bool:
        return False

    @property
    def rotary_dim(self) -> int:
        """How many leading key features the layer rotates, in pairs ``(i, i + rotary_dim / 2)``."""
        return 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor, seq: SequenceInfo,
                state: DecodingState | None) -> PositionalOutput:
        """q ``[B, T, H, K]``, k ``[B, T, H_kv, K]``, v ``[B, T, H_kv, V]``, x the layer input ``[B, T, d]``."""
        raise NotImplementedError


def build_positional(settings: PositionalSettings, mixer_spec: MixerSpec) -> PositionalEncoding:
    return PositionalEncoding.registry[settings.position_encoding](settings, mixer_spec)


class NoPE(PositionalEncoding):
    kind = "nope"
    description = "NoPE (no positional encoding)"
    rope_scaling_refusal = ("`rope_parameters` scales RoPE's frequencies: `position_encoding=\"nope\"` has none; use "
                            "\"rope\" or \"rove\", or leave `rope_parameters` unset")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor, seq: SequenceInfo,
                state: DecodingState | None) -> PositionalOutput:
        return PositionalOutput(q, k, v, None, None)


class RoPE(PositionalEncoding):
    """Rotary embeddings on q and k from each token's true position."""

    kind = "rope"
    description = "RoPE (rotary position embeddings)"
    rope_scaling_refusal = None

    def __init__(self, settings: PositionalSettings, mixer_spec: MixerSpec):
        super().__init__(settings, mixer_spec)
        rotary_dim = int(mixer_spec.head_k_dim * settings.partial_rotary_factor)
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(
                f"the rotary dimension int(head_k_dim * partial_rotary_factor) = int({mixer_spec.head_k_dim} * "
                f"{settings.partial_rotary_factor}) = {rotary_dim} must be even and >= 2; choose a head size or "
                "`partial_rotary_factor` that makes it even"
            )
        self._rotary_dim = rotary_dim
        self._scaling = settings.rope_scaling()
        for key in ("short_factor", "long_factor"):
            factors = (self._scaling or {}).get(key)
            if factors is not None and len(factors) != rotary_dim // 2:
                raise ValueError(f"`rope_parameters.{key}` lists one factor per rotated key pair: {rotary_dim // 2} "
                                 f"for the rotary size {rotary_dim}, got {len(factors)}")
        self._scaling_json = None if self._scaling is None else json.dumps(self._scaling, sort_keys=True)
        # what the frequencies depend on besides their size, as an attribute of the module: torch.compile (with
        # dynamic shapes) takes it for a constant, where it would make the numbers of a settings object symbolic
        self._frequency_settings = (self._scaling_json, float(settings.rope_theta), settings.max_position_embeddings)
        self._attention_factor = 1.0
        if self._scaling is not None:
            # computed once here, so that a missing key fails at construction; no factor depends on the length
            _, factor = scaled_rope(self._scaling, rotary_dim, settings.max_position_embeddings)
            self._attention_factor = factor if mixer_spec.softmax else 1.0

    @property
    def rotary_dim(self) -> int:
        return self._rotary_dim

    @property
    def attention_factor(self) -> float:
        """The scaling's factor on each of q and k (their logits take its square, as in transformers); 1 unscaled
        and on mixers without a softmax."""
        return self._attention_factor

    def scaling_length(self, positions: torch.Tensor) -> int | None:
        """The length the length-dependent scalings see: the last position plus one (transformers'
        ``dynamic_rope_update``, computed per call rather than kept from the longest call so far)."""
        if self._scaling is None or self._scaling["rope_type"] not in LENGTH_DEPENDENT_SCALINGS:
            return None
        return int(positions.max().item()) + 1

    def positions(self, seq: SequenceInfo, state: RotaryState | None) -> tuple[torch.Tensor, RotaryState]:
        """Each token's position ``[B or 1, T, 1, 1]`` float32, and the state holding the next position of each row.

        One row when every row has the same positions (no padding or offsets: training), so that the angles and
        their cosines are computed once and broadcast over the batch.
        """
        offset = state.offset if state is not None else None
        positions = seq.token_positions(offset)
        new_state = RotaryState(seq.next_offset(offset, positions))
        if positions.stride(0) == 0:  # an expanded row
            positions = positions[:1]
        return positions.float()[:, :, None, None], new_state

    def frequencies(self, dim: int, device: torch.device, seq_len: int | None = None) -> torch.Tensor:
        """``[dim/2]`` float32 on ``device``, scaled by ``rope_parameters`` where set (transformers' functions;
        ``seq_len`` from :meth:`scaling_length`). Kept once per (size, base, scaling, device) for the whole process
        rather than in a buffer: a buffer would need re-initialising whenever transformers materialises the model
        from the meta device, and a fresh copy per layer and step would be a host-to-device transfer each time."""
        frequencies = _compiled_frequencies if torch.compiler.is_compiling() else _frequencies
        return frequencies(*self._frequency_settings, dim, seq_len, torch.device(device))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor, seq: SequenceInfo,
                state: RotaryState | None) -> PositionalOutput:
        positions, new_state = self.positions(seq, state)
        angles = positions * self.frequencies(self._rotary_dim, q.device, self.scaling_length(positions))
        q, k = rotate_half_pairs(angles, q, k, heads_major=self.mixer_spec.heads_major, scale=self._attention_factor)
        return PositionalOutput(q, k, v, None, new_state)


class RoVE(RoPE):
    """RoPE on q and k, plus Rotary Value Embeddings: ``y_i = R_i^-1 sum_j A_ij R_j v_j = sum_j A_ij R_{j-i} v_j``.

    Value pair ``(2i, 2i + 1)`` turns at ``base^(-2i/V)`` per position.
    """

    kind = "rove"
    description = "RoVE (rotary value embeddings: RoPE on queries, keys and values)"

    def __init__(self, settings: PositionalSettings, mixer_spec: MixerSpec):
        super().__init__(settings, mixer_spec)
        if mixer_spec.head_v_dim % 2:
            raise ValueError(f"RoVE rotates value pairs: the value head size must be even, got {mixer_spec.head_v_dim}")
        scaling = self._scaling
        if scaling is not None and scaling["rope_type"] == "longrope" and mixer_spec.head_v_dim != self._rotary_dim:
            raise ValueError(
                "`rope_parameters` of rope_type \"longrope\" lists one factor per rotated key pair "
                f"({self._rotary_dim // 2}); RoVE would need as many for its {mixer_spec.head_v_dim // 2} value "
                "pairs: use a value head size equal to the rotary size, or another rope_type (\"yarn\", \"linear\", "
                "...)")
        if scaling is not None:
            scaled_rope(scaling, mixer_spec.head_v_dim, settings.max_position_embeddings)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor, seq: SequenceInfo,
                state: RotaryState | None) -> PositionalOutput:
        positions, new_state = self.positions(seq, state)
        seq_len = self.scaling_length(positions)
        qk_angles = positions * self.frequencies(self._rotary_dim, q.device, seq_len)
        # unit rotations with the scaled frequencies: the attention factor belongs to the logits alone (§3.5)
        v_angles = positions * self.frequencies(self.mixer_spec.head_v_dim, q.device, seq_len)
        v_rotation = torch.complex(v_angles.cos(), v_angles.sin())  # torch.polar's CPU kernel is slower
        q, k = rotate_half_pairs(qk_angles, q, k, heads_major=self.mixer_spec.heads_major, scale=self._attention_factor)
        return PositionalOutput(q, k, rotate_adjacent_pairs(v, v_rotation), None, new_state, value_rotation=v_rotation)


class SelectiveRoPE(PositionalEncoding):
    """Input-dependent rotation angles accumulated over time: Movahedi et al., "Selective Rotary Position Embedding"
    (ICLR 2026); docs/design.md §3.4.

    The transition of the recurrence becomes ``lambda_t exp(i omega_t)``: rotating q and k by the cumulative angle
    reproduces it in the real domain, since ``R(theta_t)^T R(theta_s) = R(theta_s - theta_t)``. Angles are computed
    per key/value head (query heads of a group share their key's angle, as they must for the identity to hold).
    """

    kind = "selective_rope"
    description = "Selective RoPE (input-dependent rotations with exponential decay)"
    # docs/design.md §3.5: a scaling maps the training length to a number of turns per frequency; Selective RoPE's
    # angle is a learned running sum, whose turns over a context depend on the text, not its length
    rope_scaling_refusal = (
        "`rope_parameters` (RoPE scaling: linear, NTK, YaRN, ...) does not apply to "
        "`position_encoding=\"selective_rope\"`: its angle tau_i * theta_t is a learned running sum of "
        "per-token rates, not position * frequency, so no frequency has a fixed number of turns over the "
        "training length to interpolate; its decay, not its spectrum, sets its range. Leave "
        "`rope_parameters` unset")

    def __init__(self, settings: PositionalSettings, mixer_spec: MixerSpec):
        super().__init__(settings, mixer_spec)
        if mixer_spec.head_k_dim % 2:
            raise ValueError("Selective RoPE rotates key pairs: the key head size must be even, got "
                             f"{mixer_spec.head_k_dim}")
        if mixer_spec.hidden_size % mixer_spec.num_kv_heads:
            raise ValueError(
                "Selective RoPE splits the input into one chunk per key head: `hidden_size` "
                f"({mixer_spec.hidden_size}) must be divisible by the number of key heads ({mixer_spec.num_kv_heads})")
        if settings.selective_rope_decay and mixer_spec.has_decay:
            raise ValueError(
                "`selective_rope_decay=True` adds a decay to mixers that have none (Transformer, plain DeltaNet); "
                "this mixer brings its own decay: leave it None or False")
        self.heads, self.pairs = mixer_spec.num_kv_heads, mixer_spec.head_k_dim // 2
        if settings.selective_rope_spectrum == "rfa" and self.pairs < 2:
            raise ValueError("`selective_rope_spectrum=\"rfa\"` spreads the temperatures over the key pairs from 0 up: "
                             f"it needs a key head size of at least 4, got {mixer_spec.head_k_dim}")
        self.group = mixer_spec.num_heads // mixer_spec.num_kv_heads
        self.chunk = mixer_spec.hidden_size // self.heads
        rank, channels = settings.selective_rope_rank, self.heads * self.pairs
        if rank is not None:
            self.phi_down = nn.Linear(mixer_spec.hidden_size, rank, bias=False)
            self.phi_up = nn.Linear(rank, channels, bias=False)
        else:
            # weight normalisation by hand: a direction per output row and its gain
            self.phi_direction = nn.Parameter(torch.empty(self.heads, self.pairs, self.chunk))
            self.phi_gain = nn.Parameter(torch.ones(self._gain_shape()))
            nn.init.normal_(self.phi_direction)
        if settings.selective_rope_skip_conv:
            # a frozen kernel (-1, 1): the convolution's state and document boundaries serve the difference as well
            self.conv = ShortConvolution(channels, 2, None)
            self.conv.weight.requires_grad_(False)
            with torch.no_grad():
                self.conv.weight.copy_(self._first_difference(channels))
        else:
            self.conv = ShortConvolution(channels, settings.selective_rope_conv_size,
                                         settings.selective_rope_activation)
        if settings.selective_rope_bias:
            self.omega_bias = nn.Parameter(torch.zeros(channels))
        if settings.selective_rope_phase_gate:
            self.phase_proj = nn.Linear(mixer_spec.hidden_size, self.heads, bias=True)
        tau = self._temperature(settings, mixer_spec.head_k_dim)
        if settings.selective_rope_learn_temperature:
            # a weight: in the dtype the model is built in, as every other (from_pretrained(dtype=...))
            self.tau = nn.Parameter(tau.to(torch.get_default_dtype()))
        else:
            self.register_buffer("tau", tau)  # persistent: a checkpoint keeps the temperatures it was trained with
        self._adds_decay = (settings.selective_rope_decay if settings.selective_rope_decay is not None
                            else not mixer_spec.has_decay)
        if self._adds_decay:
            self.decay_proj = nn.Linear(mixer_spec.hidden_size, mixer_spec.num_heads, bias=True)
            self.reset_decay()

    def _apply(self, fn: Callable, recurse: bool = True) -> SelectiveRoPE:
        """``nn.Module``'s, except that the frozen temperatures stay float32 through a dtype cast (``model.to(
        torch.bfloat16)``, ``.half()``): they are computed constants, as RoPE's frequencies, and every angle
        ``tau_i * theta_t`` would carry their rounding, growing with theta. ``from_pretrained(dtype=...)`` keeps them
        float32 too, so both ways give the same model, and a cast model saves the temperatures it was trained with."""
        frozen = self._buffers.get("tau")
        super()._apply(fn, recurse)
        moved = self._buffers.get("tau")
        if frozen is not None and moved is not None and moved.dtype != torch.float32:
            self._buffers["tau"] = frozen.to(device=moved.device, dtype=torch.float32)
        return self

    def _gain_shape(self) -> tuple[int, int]:
        return (self.heads, 1) if self.settings.selective_rope_gain_per_head else (self.heads, self.pairs)

    @staticmethod
    def _first_difference(channels: int) -> torch.Tensor:
        """The ``[C, 1, 2]`` kernel of ``y_t = x_t - x_{t-1}`` (the newest tap is the last)."""
        return torch.tensor([-1.0, 1.0]).expand(channels, 1, 2).clone()

    @staticmethod
    def _temperature(settings: PositionalSettings, head_k_dim: int) -> torch.Tensor:
        if settings.selective_rope_spectrum == "rope":
            spectrum = rope_frequencies(head_k_dim, settings.selective_rope_temperature_base)
        else:
            # tan(a/2) rises from 0 and, with rfa_theta < 1, stays finite at the last angle
            angles = torch.linspace(0.0, settings.selective_rope_rfa_theta * math.pi, head_k_dim // 2,
                                    dtype=torch.float64)
            spectrum = torch.tan(angles / 2)
            spectrum = spectrum / spectrum.max()
        return (settings.selective_rope_tau_max * spectrum).float()

    def initial_buffers(self) -> dict[str, torch.Tensor]:
        """The values of the layer's buffers (the frozen temperatures). They are computed, not drawn, so a model
        gives them to the layer as soon as it builds it without values (``rotarium.models.modeling.built_empty``),
        as transformers expects of a model whose initialisation is skipped, and again in its initialisation
        (:meth:`special_init`)."""
        if self.settings.selective_rope_learn_temperature:
            return {}
        return {"tau": self._temperature(self.settings, self.mixer_spec.head_k_dim)}

    def special_init(self) -> dict[str, torch.Tensor]:
        """Initial values that differ from the generic initialisation of their module type (see the models)."""
        values = {"tau": self._temperature(self.settings, self.mixer_spec.head_k_dim)}  # a buffer, or learned
        if self._adds_decay:
            # per-head half-lives spread geometrically over 8..4096 tokens
            half_lives = torch.logspace(math.log10(8), math.log10(4096), self.mixer_spec.num_heads, dtype=torch.float64)
            keep = torch.exp(-math.log(2) / half_lives)
            values["decay_proj.bias"] = torch.log(keep / (1 - keep)).float()
        if self.settings.selective_rope_rank is None:
            values["phi_direction"] = torch.empty(self.heads, self.pairs, self.chunk).normal_()
            values["phi_gain"] = torch.ones(self._gain_shape())
        if self.settings.selective_rope_bias:
            values["omega_bias"] = torch.zeros(self.heads * self.pairs)
        if self.settings.selective_rope_skip_conv:
            values["conv.weight"] = self._first_difference(self.heads * self.pairs)
        return values

    def reset_decay(self) -> None:
        nn.init.normal_(self.decay_proj.weight, std=0.02)
        with torch.no_grad():
            self.decay_proj.bias.copy_(self.special_init()["decay_proj.bias"])

    @property
    def adds_decay(self) -> bool:
        return self._adds_decay

    @property
    def rotary_dim(self) -> int:
        return 2 * self.pairs

    def angle_rates(self, x: torch.Tensor, seq: SequenceInfo, conv_state: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """From the layer input x ``[B, T, d]``: ``omega`` ``[B, T, H_kv, K/2]`` float32, the log decay the layer adds
        ``[B, T, H]`` float32 (None where it adds none), both zero on padding, and the new convolution window."""
        B, T, _ = x.shape
        if self._adds_decay and plain_linear(self.decay_proj):
            # one read of x for the angles' input and the decay's logits, with one backward
            xh, decay_logits = head_l2norm_and_linear(x, self.heads, self.decay_proj.weight, self.decay_proj.bias)
        else:  # no decay, or a projection that must be called (an adapter, hooks: see plain_linear)
            xh, _ = head_l2norm_and_linear(x, self.heads)
            decay_logits = self.decay_proj(x) if self._adds_decay else None
        log_decay = None if decay_logits is None else seq.zero_padding(F.logsigmoid(decay_logits.float()))
        if self.settings.selective_rope_rank is not None:
            phi = self.phi_up(self.phi_down(xh.reshape(B, T, -1)))
        else:
            weight = self.phi_gain[..., None] * F.normalize(self.phi_direction, dim=-1)
            phi = torch.einsum("bthc,hpc->bthp", xh, weight.to(xh.dtype)).reshape(B, T, -1)
        omega, conv_state = self.conv(phi, seq, conv_state)
        omega = omega.float()
        if self.settings.selective_rope_bias:
            omega = omega + self.omega_bias.float().exp()
        omega = omega.view(B, T, self.heads, self.pairs)
        if self.settings.selective_rope_phase_gate:
            omega = omega * torch.sigmoid(self.phase_proj(xh.reshape(B, T, -1)).float())[..., None]
        return seq.zero_padding(omega), log_decay, conv_state

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor, seq: SequenceInfo,
                state: SelectiveRoPEState | None) -> PositionalOutput:
        omega, log_decay, conv_state = self.angle_rates(x, seq, None if state is None else state.conv)
        theta = segment_cumsum(omega, seq.cu_seqlens)
        if state is not None:
            theta = theta + state.theta[:, None]
        angles = theta * self.tau.float()
        new_state = SelectiveRoPEState(theta[:, -1], conv_state)
        heads_major = self.mixer_spec.heads_major
        if self.group == 1:
            q, k = rotate_half_pairs(angles, q, k, heads_major=heads_major)
        else:  # query heads of a group share their key head's angles
            (q,) = rotate_half_pairs(angles.repeat_interleave(self.group, 2), q, heads_major=heads_major)
            (k,) = rotate_half_pairs(angles, k, heads_major=heads_major)
        return PositionalOutput(q, k, v, log_decay, new_state)


# The options' names in the order they are defined, and those a RoPE scaling rescales: read from the registry, the
# one list of the options
POSITION_ENCODINGS = tuple(PositionalEncoding.registry)
ROPE_FREQUENCY_ENCODINGS = tuple(name for name, option in PositionalEncoding.registry.items()
                                 if option.rope_scaling_refusal is None)
