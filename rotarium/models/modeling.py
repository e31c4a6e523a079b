"""The one model and causal-LM head that serve all four families.

A family differs only in its config (``model_type``, defaults) and the mixer its config builds; the classes at
the bottom of this file bind each family's config to the shared implementation, so ``AutoModel`` can find them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from rotarium.layers import Block, HeadRMSNorm, RMSNorm, SequenceInfo, ShortConvolution, build_mixer
from rotarium.models.cache import RotariumCache
from rotarium.models.configuration import (
    DeltaNetConfig,
    FoXConfig,
    GLAConfig,
    RotariumConfig,
    TransformerConfig,
)
from rotarium.ops.linear_cross_entropy import fused_linear_cross_entropy_loss
from rotarium.ops.utils import checks_values

try:  # transformers >= 5: init functions that skip tensors already loaded from a checkpoint
    from transformers import initialization as init
except ImportError:  # pragma: no cover
    from torch.nn import init

if TYPE_CHECKING:
    import os

# transformers renamed the cache field of model outputs from `past_key_values` to `cache` during v5
CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
# Output projections that write into the residual stream, scaled down with depth (GPT-2, fla's prenorm rescaling).
RESIDUAL_PROJECTIONS = ("o_proj", "down_proj")
IGNORE_INDEX = -100  # transformers' label for tokens that are not scored
# Tokens per chunk of the chunked LM loss: one chunk's [tokens, vocab] logits exist at a time, and chunks much
# smaller than this make the projection's matmuls measurably less efficient (docs/benchmarks.md, lm_head.py).
LOSS_CHUNK_TOKENS = 1024


class RotariumPreTrainedModel(PreTrainedModel):
    config_class = RotariumConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules: ClassVar[list[str]] = ["Block"]
    _supports_cache_class = True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model builds its own RotariumCache

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            if getattr(module, "is_residual_projection", False):
                std = std / math.sqrt(2 * self.config.num_hidden_layers)
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (RMSNorm, HeadRMSNorm)):
            init.ones_(module.weight)
        elif isinstance(module, ShortConvolution):
            bound = 1 / math.sqrt(module.kernel_size)
            init.uniform_(module.weight, -bound, bound)
        # Modules with parameters of their own meaning (decay rates, temperatures) say what they start at;
        # modules are visited children first, so these values land after the generic ones above.
        if hasattr(module, "special_init"):
            for name, value in module.special_init().items():
                target = module.get_parameter(name) if name in dict(module.named_parameters()) else \
                    module.get_buffer(name)
                init.copy_(target, value.to(dtype=target.dtype, device=target.device))

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs) -> None:
        """transformers' ``save_pretrained`` (``push_to_hub`` goes through it), plus a self-contained copy of the
        model code and an ``auto_map`` in ``config.json``: the folder also loads with
        ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` where rotarium is not installed."""
        from rotarium.models.remote_code import prepare_save  # the bundler reads source files: only saving needs it

        if kwargs.get("is_main_process", True):
            prepare_save(self.config, tuple(c.__name__ for c in FAMILY_MODELS[self.config.family]), save_directory)
        return super().save_pretrained(save_directory, *args, **kwargs)

    def post_init(self) -> None:
        for name, module in self.named_modules():
            if name.rsplit(".", 1)[-1] in RESIDUAL_PROJECTIONS:
                module.is_residual_projection = True
        super().post_init()


class RotariumModel(RotariumPreTrainedModel):
    """Embedding, a stack of the shared pre-norm blocks, final norm."""

    def __init__(self, config: RotariumConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([
            Block(config.hidden_size, build_mixer(config.family, **config.mixer_kwargs()), config.intermediate_size,
                  config.norm_eps)
            for _ in range(config.num_hidden_layers)
        ])
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.gradient_checkpointing = False
        self.cache_settings = cache_settings(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: RotariumCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cu_seqlens: torch.LongTensor | None = None,
        cache: RotariumCache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast | tuple:
        """``cu_seqlens`` (int64 ``[N+1]``): boundaries of documents packed into a batch of size 1; no state or
        attention crosses them. ``cache`` is transformers' newer name for ``past_key_values``."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of `input_ids` and `inputs_embeds`")
        self._check_tokens(input_ids, inputs_embeds)
        past = past_key_values if past_key_values is not None else cache
        output_hidden_states = (output_hidden_states if output_hidden_states is not None
                                else self.config.output_hidden_states)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training and cu_seqlens is None
        if past is not None and not isinstance(past, RotariumCache):
            raise ValueError(
                f"`past_key_values` must be a RotariumCache (or None), got {type(past).__name__}; rotarium's mixers "
                "keep recurrent states that transformers' key/value caches cannot hold")
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if past is not None:
            past.check_fits(self.cache_settings, hidden_states.shape[0],
                            "past_key_values" if past_key_values is not None else "cache")
        if use_cache:
            if past is None:
                past = RotariumCache(len(self.layers))
            past.record(self.cache_settings, hidden_states.shape[0])
        seq = SequenceInfo.build(hidden_states, attention_mask, position_ids, cu_seqlens)
        all_hidden = []
        for idx, layer in enumerate(self.layers):
            if output_hidden_states:
                all_hidden.append(hidden_states)
            state = past.layer_state(idx) if past is not None else None
            if self.gradient_checkpointing and self.training:
                hidden_states, new_state = self._gradient_checkpointing_func(
                    layer.__call__, hidden_states, seq, state, use_cache)
            else:
                hidden_states, new_state = layer(hidden_states, seq, state, use_cache)
            if use_cache:
                past.set_layer_state(idx, new_state)
        if use_cache:
            past.seen_tokens += hidden_states.shape[1]
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden.append(hidden_states)
        hidden = tuple(all_hidden) if output_hidden_states else None
        if not return_dict:
            return tuple(v for v in (hidden_states, past if use_cache else None, hidden) if v is not None)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, hidden_states=hidden,
                                       **{CACHE_FIELD: past if use_cache else None})

    def _check_tokens(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> None:
        """Shapes always; the ids' range where reading them costs no synchronisation (see ``checks_values``)."""
        name, x, layout = (("input_ids", input_ids, "[batch, seq_len]") if input_ids is not None
                           else ("inputs_embeds", inputs_embeds, "[batch, seq_len, hidden_size]"))
        if x.ndim != layout.count(",") + 1:
            raise ValueError(f"`{name}` must have shape {layout}, got {tuple(x.shape)}")
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise ValueError(f"`{name}` is empty (shape {tuple(x.shape)}): give at least one token per sequence")
        if input_ids is None or not checks_values(input_ids):
            return
        vocab = self.embed_tokens.num_embeddings
        outside = input_ids[(input_ids < 0) | (input_ids >= vocab)]
        if outside.numel():
            raise ValueError(f"`input_ids` holds the id {int(outside[0])}, outside the vocabulary of {vocab} tokens "
                             f"(ids 0 to {vocab - 1})")


def set_activation_checkpointing(model: PreTrainedModel, enabled: bool = True) -> None:
    """Whether every block is recomputed in the backward instead of keeping its activations, through whichever of
    transformers' two names the installed version has (``gradient_checkpointing_*`` is deprecated where
    ``activation_checkpointing_*`` exists)."""
    action = "enable" if enabled else "disable"
    switch = getattr(model, f"activation_checkpointing_{action}", None)
    (switch or getattr(model, f"gradient_checkpointing_{action}"))()


def cache_settings(config: RotariumConfig) -> dict:
    """What a model's decoding states depend on: its family, depth and the mixers' options (the positional
    options among them). A :class:`RotariumCache` records them, to be refused by a model with others."""
    kwargs = config.mixer_kwargs()
    positional = dataclasses.asdict(kwargs.pop("positional"))
    return {"family": config.family, "num_hidden_layers": config.num_hidden_layers, **kwargs, **positional}


class RotariumForCausalLM(RotariumPreTrainedModel, GenerationMixin):
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: RotariumConfig):
        super().__init__(config)
        self.model = RotariumModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: RotariumCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cu_seqlens: torch.LongTensor | None = None,
        cache: RotariumCache | None = None,
        return_logits: bool = False,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """``labels`` are the input ids themselves (shifted inside); -100 is ignored, and so is every prediction
        across a packed document boundary.

        With ``labels``, the loss goes through the output projection a chunk of tokens at a time
        (:func:`rotarium.ops.fused_linear_cross_entropy_loss`), so the ``[tokens, vocab]`` logits and their gradient
        never exist, and ``logits`` is None; ``return_logits=True`` computes the full logits as well, and the loss
        from them. Without ``labels`` the logits are returned (the last ``logits_to_keep`` positions, or all).
        """
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, cache=cache, inputs_embeds=inputs_embeds,
                             use_cache=use_cache, output_hidden_states=output_hidden_states, return_dict=True,
                             cu_seqlens=cu_seqlens)
        hidden_states = outputs.last_hidden_state
        logits = loss = None
        if labels is None or return_logits:
            if isinstance(logits_to_keep, int):
                kept = hidden_states[:, -logits_to_keep:] if logits_to_keep > 0 else hidden_states
            else:
                kept = hidden_states[:, logits_to_keep]
            logits = self.lm_head(kept)
        if labels is not None:
            if labels.shape != hidden_states.shape[:2]:
                raise ValueError(f"`labels` must have the inputs' shape [batch, seq_len] = "
                                 f"{list(hidden_states.shape[:2])}, got {list(labels.shape)}")
            if not isinstance(logits_to_keep, int) or logits_to_keep > 0:
                raise ValueError("`labels` need the logits of every position: leave `logits_to_keep` at 0")
            if cu_seqlens is not None:
                labels = labels.clone()
                labels[:, cu_seqlens[1:-1]] = -100  # a document's first token is not predicted from the last one
            num_items = kwargs.get("num_items_in_batch")
            if logits is not None:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                          num_items_in_batch=num_items)
            else:
                loss = self.chunked_loss(hidden_states, labels, num_items)
        past = getattr(outputs, CACHE_FIELD)
        if not return_dict:
            return tuple(v for v in (loss, logits, past, outputs.hidden_states) if v is not None)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                      **{CACHE_FIELD: past})

    def chunked_loss(self, hidden_states: torch.Tensor, labels: torch.Tensor,
                     num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """transformers' causal-LM loss (position t predicts label t + 1; the mean over scored tokens, or the sum
        over ``num_items_in_batch``) from the final hidden states ``[B, T, d]``, without the full logits."""
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        loss = fused_linear_cross_entropy_loss(
            hidden_states.reshape(-1, hidden_states.shape[-1]), targets.reshape(-1), self.lm_head.weight,
            self.lm_head.bias, ignore_index=IGNORE_INDEX, num_chunks=-(-targets.numel() // LOSS_CHUNK_TOKENS),
            reduction="mean" if num_items_in_batch is None else "sum")
        if num_items_in_batch is None:
            return loss
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        return loss / num_items_in_batch


class GLAModel(RotariumModel):
    config_class = GLAConfig


class GLAForCausalLM(RotariumForCausalLM):
    config_class = GLAConfig


class FoXModel(RotariumModel):
    config_class = FoXConfig


class FoXForCausalLM(RotariumForCausalLM):
    config_class = FoXConfig


class DeltaNetModel(RotariumModel):
    config_class = DeltaNetConfig


class DeltaNetForCausalLM(RotariumForCausalLM):
    config_class = DeltaNetConfig


class TransformerModel(RotariumModel):
    config_class = TransformerConfig


class TransformerForCausalLM(RotariumForCausalLM):
    config_class = TransformerConfig


class FamilyClasses(NamedTuple):
    """The three classes that bind one family's config to the shared model and causal-LM head."""

    config: type[RotariumConfig]
    model: type[RotariumModel]
    lm: type[RotariumForCausalLM]


FAMILY_MODELS: dict[str, FamilyClasses] = {
    "gla": FamilyClasses(GLAConfig, GLAModel, GLAForCausalLM),
    "fox": FamilyClasses(FoXConfig, FoXModel, FoXForCausalLM),
    "deltanet": FamilyClasses(DeltaNetConfig, DeltaNetModel, DeltaNetForCausalLM),
    "transformer": FamilyClasses(TransformerConfig, TransformerModel, TransformerForCausalLM),
}
