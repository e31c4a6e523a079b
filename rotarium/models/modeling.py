"""The one model and causal-LM head that serve all four families, and the families' registry.

A family differs only in its config (``model_type``, defaults) and the mixer its config names; :func:`bind_family`
derives from each config of ``rotarium.models.configuration.FAMILY_CONFIGS`` the classes that bind it to the shared
implementation (``GLAModel``, ``GLAForCausalLM``, ...), defined in this module under their names so that
``AutoModel``, a checkpoint's ``auto_map`` and the exported remote code find them, and :data:`FAMILY_MODELS` holds
each family's record, from which every list of families is derived.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging

from rotarium.layers import Block, HeadRMSNorm, RMSNorm, SequenceInfo, ShortConvolution
from rotarium.models.cache import RotariumCache, RotariumCacheLayer, rotarium_layers
from rotarium.models.configuration import CONFIGS, FAMILY_CONFIGS, RotariumConfig
from rotarium.ops.linear_cross_entropy import fused_linear_cross_entropy_loss
from rotarium.ops.utils import checks_values, plain_linear

try:  # transformers >= 5: init functions that skip tensors already loaded from a checkpoint
    from transformers import initialization as init
except ImportError:  # pragma: no cover
    from torch.nn import init

if TYPE_CHECKING:
    import os

logger = logging.get_logger(__name__)
# transformers renamed the cache field of model outputs from `past_key_values` to `cache` during v5
CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
# Output projections that write into the residual stream, scaled down with depth (GPT-2, fla's prenorm rescaling).
RESIDUAL_PROJECTIONS = ("o_proj", "down_proj")
IGNORE_INDEX = -100  # transformers' label for tokens that are not scored
# Tokens per chunk of the chunked LM loss: one chunk's [tokens, vocab] logits exist at a time, so the chunk bounds
# the head's memory, and a chunk this long keeps the projection's matmuls large enough to run efficiently
# (benchmarks/lm_head.py weighs the two; docs/benchmarks.md has its results).
LOSS_CHUNK_TOKENS = 1024
ModuleT = TypeVar("ModuleT", bound=nn.Module)


def built_empty(build: Callable[[], ModuleT]) -> ModuleT:
    """``build()`` run on the meta device, then given uninitialised storage where a parameter registered now would
    live (the default device, or the meta device under accelerate's ``init_empty_weights``). Its modules'
    own initialisation, which a module built alone relies on, then draws nothing: the model's ``_init_weights`` sets
    every value, once. Buffers, whose values are computed rather than drawn, get them here (from their module's
    ``initial_buffers()``): transformers expects a model built with its initialisation skipped (``no_init_weights``,
    as when loading a checkpoint) to hold them."""
    probe = nn.Module()
    probe.register_parameter("weight", nn.Parameter(torch.empty(0)))
    with torch.device("meta"):
        module = build()
    module = module.to_empty(device=probe.weight.device)
    with torch.no_grad():
        for owner in module.modules():
            for name, value in getattr(owner, "initial_buffers", dict)().items():
                buffer = owner.get_buffer(name)
                buffer.copy_(value.to(dtype=buffer.dtype, device=buffer.device))
    return module


class RotariumPreTrainedModel(PreTrainedModel):
    config_class = RotariumConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules: ClassVar[list[str]] = ["Block"]
    _supports_cache_class = True
    # Writes the model's own code and the `auto_map` beside the weights before transformers saves them: rotarium.models
    # sets it to the bundler (rotarium.models.remote_code.prepare_save). The model's modules do not import the
    # bundler, so an exported folder does not ship it; there it stays None, as transformers' custom_object_save
    # copies the code of a model loaded from that code.
    code_writer: ClassVar[Callable[..., None] | None] = None

    def _init_weights(self, module: nn.Module) -> None:
        """Every value of the model, set once: the models build their modules without values (:func:`built_empty`),
        and ``from_pretrained`` calls this for the weights a checkpoint lacks."""
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
        if self.code_writer is not None and kwargs.get("is_main_process", True):
            self.code_writer(self.config, FAMILY_MODELS[self.config.family].class_names, save_directory)
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
        self.embed_tokens = built_empty(lambda: nn.Embedding(config.vocab_size, config.hidden_size))
        mixer_kwargs = config.mixer_kwargs()  # one settings object, checked once, for every layer
        self.layers = built_empty(lambda: nn.ModuleList([
            Block(config.hidden_size, config.mixer_class(**mixer_kwargs), config.intermediate_size, config.norm_eps)
            for _ in range(config.num_hidden_layers)
        ]))
        self.norm = built_empty(lambda: RMSNorm(config.hidden_size, eps=config.norm_eps))
        self.state_settings = decoding_state_settings(config)
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
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        cu_seqlens: torch.LongTensor | None = None,
        cache: Cache | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast | tuple:
        """``cu_seqlens`` (int ``[N+1]``): boundaries of documents packed into a batch of size 1; no state or
        attention crosses them. FlashAttention's ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (transformers'
        ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``) say the same, and so do ``position_ids``
        that restart in one unpadded row (the same collator's default); its ``max_length_q`` / ``max_length_k`` are
        not needed. ``cache`` is transformers' newer name for ``past_key_values``: a cache this model returned, or
        one of transformers' empty ``DynamicCache`` (see :func:`rotarium.models.cache.rotarium_layers`).

        ``output_attentions`` returns the attention probabilities of the softmax mixers (FoX, the Transformer),
        ``[B, H, T, past + T]`` per block; the linear families have none and raise ``ValueError``.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of `input_ids` and `inputs_embeds`")
        self._check_tokens(input_ids, inputs_embeds)
        past = past_key_values if past_key_values is not None else cache
        argument = "past_key_values" if past_key_values is not None else "cache"
        output_hidden_states = (output_hidden_states if output_hidden_states is not None
                                else self.config.output_hidden_states)
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = hidden_states.shape[:2]
        seq = SequenceInfo.build(hidden_states, attention_mask, position_ids,
                                 document_boundaries(cu_seqlens, cu_seq_lens_q, cu_seq_lens_k))
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training and seq.cu_seqlens is None
        if seq.cu_seqlens is not None and (use_cache or past is not None):
            raise ValueError("packed documents (`cu_seqlens`, `cu_seq_lens_q` / `cu_seq_lens_k`, or `position_ids` "
                             "restarting in one row) cannot use or fill a cache: pass use_cache=False and no cache")
        if use_cache and self.training and torch.is_grad_enabled() and any(
                block.gradient_checkpointing for block in self.layers):
            logger.warning_once("`use_cache=True` is incompatible with activation checkpointing (a checkpointed "
                                "block runs twice and would write its state twice): no cache is filled")
            use_cache = False
        layers = rotarium_layers(past, len(self.layers), argument) if past is not None else None
        if layers is not None:
            layers[0].check_fits(self.state_settings, B, argument)
        if use_cache and past is None:
            past = RotariumCache(len(self.layers))
            layers = past.layers
        spans = self._pieces(T, layers if use_cache else None)
        # the whole input as it is, not a view of it: a compiled block specialises on whether its input is a view,
        # and the first block would otherwise compile a graph of its own
        pieces = [self._run_blocks(hidden_states if len(spans) == 1 else hidden_states[:, start:end],
                                   seq if len(spans) == 1 else seq.slice(start, end),
                                   layers, use_cache, output_hidden_states, output_attentions)
                  for start, end in spans]
        # one span returns the very tensors of the graph, so that gradients reach them (transformers' retain_grad)
        hidden_states, hidden, attentions = pieces[0] if len(pieces) == 1 else self._joined(pieces)
        hidden = tuple(hidden) if output_hidden_states else None
        attentions = tuple(attentions) if output_attentions else None
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            hidden = (*hidden, hidden_states)
        if not return_dict:
            return tuple(v for v in (hidden_states, past if use_cache else None, hidden, attentions) if v is not None)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, hidden_states=hidden, attentions=attentions,
                                       **{CACHE_FIELD: past if use_cache else None})

    @staticmethod
    def _pieces(T: int, layers: list[RotariumCacheLayer] | None) -> list[tuple[int, int]]:
        """``[start, end)`` spans to feed the blocks: the whole input, but while the cache records its past
        (assisted decoding) the last tokens one at a time, so that each layer keeps the state before each of them
        to roll back to (``RotariumCacheLayer.crop``)."""
        keep = min(T, layers[0].recurrent_states_to_keep) if layers and layers[0].record_past else 0
        if keep == 0:
            return [(0, T)]
        return ([(0, T - keep)] if keep < T else []) + [(t, t + 1) for t in range(T - keep, T)]

    @staticmethod
    def _joined(pieces: list[BlocksOutput]) -> BlocksOutput:
        """The spans' outputs as one: along time, and for the attention weights of the earlier spans, whose queries
        saw fewer keys, with zero weight on the later keys (which causality hides from them anyway)."""
        keys = pieces[-1].attentions[0].shape[-1] if pieces[-1].attentions else 0
        return BlocksOutput(
            torch.cat([piece.hidden_states for piece in pieces], 1),
            [torch.cat(per_block, 1) for per_block in zip(*(piece.hidden for piece in pieces))],
            [torch.cat([F.pad(w, (0, keys - w.shape[-1])) for w in per_block], 2)
             for per_block in zip(*(piece.attentions for piece in pieces))])

    def _run_blocks(self, hidden_states: torch.Tensor, seq: SequenceInfo, layers: list[RotariumCacheLayer] | None,
                    use_cache: bool, output_hidden_states: bool, output_attentions: bool) -> BlocksOutput:
        all_hidden, all_attentions = [], []
        for block, layer in zip(self.layers, layers or [None] * len(self.layers)):
            if output_hidden_states:
                all_hidden.append(hidden_states)
            hidden_states, state, *weights = block(hidden_states, seq, state=None if layer is None else layer.state,
                                                   use_cache=use_cache, output_attentions=output_attentions)
            if use_cache:
                layer.set_state(state, seq.seq_len, self.state_settings, seq.batch_size)
            all_attentions.extend(weights)
        return BlocksOutput(hidden_states, all_hidden, all_attentions)

    def _check_tokens(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> None:
        """Shapes always; the ids' range where reading them costs no synchronisation (see ``checks_values``)."""
        name, x, layout = (("input_ids", input_ids, "[batch, seq_len]") if input_ids is not None
                           else ("inputs_embeds", inputs_embeds, "[batch, seq_len, hidden_size]"))
        if x.ndim != layout.count(",") + 1:
            raise ValueError(f"`{name}` must have shape {layout}, got {tuple(x.shape)}")
        if inputs_embeds is not None and x.shape[-1] != self.config.hidden_size:
            raise ValueError(f"`inputs_embeds` must have shape {layout} with hidden_size {self.config.hidden_size}, "
                             f"got {tuple(x.shape)}")
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise ValueError(f"`{name}` is empty (shape {tuple(x.shape)}): give at least one token per sequence")
        if input_ids is None or not checks_values(input_ids):
            return
        # the config's count, which resize_token_embeddings keeps: the embedding may be wrapped (a PEFT adapter,
        # trainable tokens) in a module that does not show nn.Embedding's attributes
        vocab = self.config.vocab_size
        outside = input_ids[(input_ids < 0) | (input_ids >= vocab)]
        if outside.numel():
            raise ValueError(f"`input_ids` holds the id {int(outside[0])}, outside the vocabulary of {vocab} tokens "
                             f"(ids 0 to {vocab - 1})")


class BlocksOutput(NamedTuple):
    """The blocks' output for one span of the input: the last hidden states, and each block's input and attention
    weights where asked."""

    hidden_states: torch.Tensor
    hidden: list[torch.Tensor]
    attentions: list[torch.Tensor]


def document_boundaries(cu_seqlens: torch.Tensor | None, cu_seq_lens_q: torch.Tensor | None,
                        cu_seq_lens_k: torch.Tensor | None) -> torch.Tensor | None:
    """int64 ``[N+1]`` packed-document boundaries from rotarium's ``cu_seqlens`` or FlashAttention's
    ``cu_seq_lens_q`` / ``cu_seq_lens_k``, which causal self-attention needs equal; None when none is given."""
    given = {name: t for name, t in (("cu_seqlens", cu_seqlens), ("cu_seq_lens_q", cu_seq_lens_q),
                                     ("cu_seq_lens_k", cu_seq_lens_k)) if t is not None}
    if "cu_seqlens" in given and len(given) > 1:
        raise ValueError("pass the packed boundaries once: `cu_seqlens`, or FlashAttention's `cu_seq_lens_q` / "
                         "`cu_seq_lens_k`, not both")
    if cu_seq_lens_q is not None and cu_seq_lens_k is not None and cu_seq_lens_q is not cu_seq_lens_k and (
            checks_values(cu_seq_lens_q) and checks_values(cu_seq_lens_k)) and not torch.equal(
                cu_seq_lens_q.cpu(), cu_seq_lens_k.cpu()):
        raise ValueError("`cu_seq_lens_q` and `cu_seq_lens_k` differ: a causal LM attends within each document, so "
                         "its queries and keys have the same boundaries")
    boundaries = next(iter(given.values()), None)
    return None if boundaries is None else boundaries.long()


def set_activation_checkpointing(model: PreTrainedModel, enabled: bool = True, **options) -> None:
    """Whether blocks are recomputed in the backward instead of keeping their activations: transformers'
    ``activation_checkpointing_enable(**options)`` (``every_n_layers``, ``offload``,
    ``activation_checkpointing_kwargs``) / ``_disable()``, or the older ``gradient_checkpointing_*`` where the
    installed transformers has only those."""
    action = "enable" if enabled else "disable"
    switch = getattr(model, f"activation_checkpointing_{action}", None)
    if switch is None:
        switch = getattr(model, f"gradient_checkpointing_{action}")
        if "activation_checkpointing_kwargs" in options:
            options["gradient_checkpointing_kwargs"] = options.pop("activation_checkpointing_kwargs")
    switch(**options)


def decoding_state_settings(config: RotariumConfig) -> dict:
    """What a model's decoding states depend on: its family, depth and the mixers' options (the positional
    options among them). A :class:`RotariumCache` records them, to be refused by a model with others."""
    names = ("hidden_size", "num_heads", "norm_eps", *config.mixer_fields)
    # copies, so that a config changed in place later cannot change what a cache recorded
    return {"family": config.family, "num_hidden_layers": config.num_hidden_layers,
            **copy.deepcopy({**{name: getattr(config, name) for name in names}, **config.positional_values()})}


class RotariumForCausalLM(RotariumPreTrainedModel, GenerationMixin):
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: RotariumConfig):
        super().__init__(config)
        self.model = RotariumModel(config)
        self.lm_head = built_empty(lambda: nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def _prepare_cache_for_generation(self, generation_config: GenerationConfig, model_kwargs: dict, *args,
                                      **kwargs) -> None:
        """``generate`` builds transformers' ``DynamicCache`` of key/value layers; a rotarium model decodes with a
        :class:`RotariumCache` instead, recording its past for rollbacks where an assistant model drafts with it,
        as transformers does for its own caches."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        built = model_kwargs.get("cache")
        if built is None or getattr(built, "_is_user_defined", False):
            return
        if generation_config.cache_implementation not in (None, "dynamic"):
            logger.warning_once(f"`cache_implementation={generation_config.cache_implementation!r}` is ignored: "
                                "rotarium models decode with their recurrent states in a RotariumCache")
        model_kwargs["cache"] = RotariumCache(self.config.num_hidden_layers)
        if generation_config.is_assistant:
            model_kwargs["cache"].activate_past_recording(
                recurrent_states_to_keep=generation_config.num_assistant_tokens)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cu_seqlens: torch.LongTensor | None = None,
        cache: Cache | None = None,
        return_logits: bool | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """``labels`` are the input ids themselves (shifted inside), or ``shift_labels`` (a keyword argument, as in
        transformers' models) the targets already shifted (``shift_labels[t]`` is what position t predicts; sequence-
        and context-parallel trainers pass them), as in transformers' ``ForCausalLMLoss``. -100 is ignored, and so is
        every prediction across a packed document boundary (``cu_seqlens``, ``cu_seq_lens_q`` / ``cu_seq_lens_k``, or
        restarting ``position_ids``: see :meth:`RotariumModel.forward`).

        With labels in training mode, the loss goes through the output projection a chunk of tokens at a time
        (:func:`rotarium.ops.fused_linear_cross_entropy_loss`), so the ``[tokens, vocab]`` logits and their gradient
        never exist, and ``logits`` is None; a head that is not a plain ``nn.Linear`` (a PEFT adapter, hooks:
        :func:`rotarium.ops.utils.plain_linear`) is called instead, and its whole logits give the loss. In
        evaluation mode (``model.eval()``) the full logits are computed and returned with the loss, as any causal
        LM's are: evaluation loops read them (transformers' ``Trainer`` passes them to ``compute_metrics``).
        ``return_logits`` decides either way instead (``False``: the chunked loss alone, as a validation loss that
        needs no logits takes it). Without labels the logits are returned (the last ``logits_to_keep`` positions, or
        all).
        """
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        boundaries = document_boundaries(cu_seqlens, cu_seq_lens_q, cu_seq_lens_k)
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, cache=cache, inputs_embeds=inputs_embeds,
                             use_cache=use_cache, output_hidden_states=output_hidden_states,
                             output_attentions=output_attentions, return_dict=True, cu_seqlens=boundaries)
        hidden_states = outputs.last_hidden_state
        # shift_labels is read from kwargs, not named in the signature: transformers' Trainer takes every forward
        # parameter whose name holds "label" for a label the batch must carry, and would then compute no loss
        shift_labels = kwargs.get("shift_labels")
        scored = labels is not None or shift_labels is not None
        if return_logits is None:
            return_logits = not self.training
        logits = loss = None
        if not scored or return_logits:
            if isinstance(logits_to_keep, int):
                kept = hidden_states[:, -logits_to_keep:] if logits_to_keep > 0 else hidden_states
            else:
                kept = hidden_states[:, logits_to_keep]
            logits = self.lm_head(kept)
        if scored:
            if not isinstance(logits_to_keep, int) or logits_to_keep > 0:
                raise ValueError("`labels` need the logits of every position: leave `logits_to_keep` at 0")
            targets = causal_targets(labels, shift_labels, hidden_states.shape[:2], boundaries, position_ids)
            num_items = kwargs.get("num_items_in_batch")
            if logits is not None:
                loss = self.loss_function(logits=logits, labels=targets, shift_labels=targets,
                                          vocab_size=self.config.vocab_size, num_items_in_batch=num_items)
            else:
                loss = self.chunked_loss(hidden_states, None, num_items, shift_labels=targets)
        past = getattr(outputs, CACHE_FIELD)
        if not return_dict:
            return tuple(v for v in (loss, logits, past, outputs.hidden_states, outputs.attentions) if v is not None)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                      attentions=outputs.attentions, **{CACHE_FIELD: past})

    def chunked_loss(self, hidden_states: torch.Tensor, labels: torch.Tensor | None,
                     num_items_in_batch: torch.Tensor | int | None = None,
                     shift_labels: torch.Tensor | None = None) -> torch.Tensor:
        """transformers' causal-LM loss (``ForCausalLMLoss``: position t predicts label t + 1, or ``shift_labels[t]``
        when given; the mean over scored tokens, or the sum over ``num_items_in_batch``) from the final hidden
        states ``[B, T, d]``, without the full logits where ``lm_head`` is a plain ``nn.Linear``."""
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX) if shift_labels is None else shift_labels
        if not plain_linear(self.lm_head):
            # a head the loss must call (a PEFT adapter, a quantised layer, hooks): its logits, whole, give the loss
            return self.loss_function(logits=self.lm_head(hidden_states), labels=targets, shift_labels=targets,
                                      vocab_size=self.config.vocab_size, num_items_in_batch=num_items_in_batch)
        loss = fused_linear_cross_entropy_loss(
            hidden_states.reshape(-1, hidden_states.shape[-1]), targets.reshape(-1).to(hidden_states.device),
            self.lm_head.weight, self.lm_head.bias, ignore_index=IGNORE_INDEX,
            num_chunks=-(-targets.numel() // LOSS_CHUNK_TOKENS),
            reduction="mean" if num_items_in_batch is None else "sum")
        if num_items_in_batch is None:
            return loss
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        return loss / num_items_in_batch


def causal_targets(labels: torch.Tensor | None, shift_labels: torch.Tensor | None, shape: torch.Size,
                   boundaries: torch.Tensor | None, position_ids: torch.Tensor | None) -> torch.Tensor:
    """``[B, T]`` int64: what each position predicts, ``labels[t + 1]`` or ``shift_labels[t]`` (given, it wins, as
    in ``ForCausalLMLoss``), with -100 where the next token starts another packed document: at ``boundaries``, or,
    in one row, where ``position_ids`` take their smallest value (the rule :meth:`SequenceInfo.build` packs by)."""
    name, given = ("shift_labels", shift_labels) if shift_labels is not None else ("labels", labels)
    if given.shape != shape:
        raise ValueError(f"`{name}` must have the inputs' shape [batch, seq_len] = {list(shape)}, got "
                         f"{list(given.shape)}")
    # int64 whatever the labels' integer type: the full logits' cross-entropy takes no other
    targets = (F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX) if shift_labels is None else shift_labels).long()
    B, T = shape
    starts = None
    if boundaries is not None:
        starts = torch.zeros(T + 1, dtype=torch.bool, device=boundaries.device).index_fill_(0, boundaries, True)[:T]
    elif position_ids is not None and B == 1 and position_ids.shape == (1, T):
        starts = position_ids[0] == position_ids[0].min()
    if starts is None:
        return targets
    crosses = F.pad(starts[1:], (0, 1), value=False).to(targets.device)
    return targets.masked_fill(crosses[None], IGNORE_INDEX)


class FamilyClasses(NamedTuple):
    """One family's record: its config class, which names it (``family``, ``model_type``), holds its fields and
    presets and names its mixer (``mixer_class``) and fla peer, and the model and causal-LM classes that bind that
    config to the shared implementation (:func:`bind_family`). It unpacks as ``(config, model, lm)``."""

    config: type[RotariumConfig]
    model: type[RotariumModel]
    lm: type[RotariumForCausalLM]

    @property
    def name(self) -> str:
        return self.config.family

    @property
    def model_type(self) -> str:
        return self.config.model_type

    @property
    def description(self) -> str:
        """The family in words (its config's ``description``), as a model card names it."""
        return self.config.description

    @property
    def mixer(self) -> type[nn.Module]:
        return self.config.mixer_class

    @property
    def class_names(self) -> tuple[str, str, str]:
        """The names a checkpoint's ``auto_map`` points transformers' Auto classes at."""
        return self.config.__name__, self.model.__name__, self.lm.__name__


def bind_family(config: type[RotariumConfig]) -> FamilyClasses:
    """The record of the family ``config`` declares: its model and causal-LM classes, named after the config
    (``GLAConfig`` -> ``GLAModel``, ``GLAForCausalLM``) and defined in this module under those names, as if written
    here, so that transformers' Auto classes, ``auto_map`` and the remote code find them by name. The causal-LM class
    names ``GenerationMixin`` among its own bases, transformers' convention, which its generation tests check
    (``GLAForCausalLM.__bases__``), although the shared head already brings it."""
    prefix = config.__name__.removesuffix("Config")
    bound = []
    for name, bases, what in ((f"{prefix}Model", (RotariumModel,), "model"),
                              (f"{prefix}ForCausalLM", (RotariumForCausalLM, GenerationMixin), "causal LM")):
        cls = type(name, bases, {"config_class": config, "__module__": __name__, "__qualname__": name,
                                 "__doc__": f"The {what} of {config.description}: the shared {bases[0].__name__}, "
                                            f"built from a :class:`{config.__name__}`."})
        globals()[name] = cls
        bound.append(cls)
    return FamilyClasses(config, *bound)


def _declared_by_its_family(config: type[RotariumConfig], attribute: str) -> bool:
    """Whether ``config``'s ``attribute`` is declared by a config of its own family: a family whose config derives
    from another's must declare its own, rather than get the other family's in silence."""
    owner = next((klass for klass in config.__mro__ if attribute in vars(klass)), None)
    return owner is not None and vars(owner).get("family", config.family) == config.family


def family_registry(*records: FamilyClasses) -> dict[str, FamilyClasses]:
    """The records by family name, in the order given, each checked to be whole: a mixer class named by a config of
    its family that counts its own FLOPs (``unweighted_flops_per_token``), a ``description`` of its own on its config,
    an fla peer (``fla_peer``) declared by a config of its family, and model classes bound to its config."""
    registry: dict[str, FamilyClasses] = {}
    for record in records:
        config = record.config
        if record.name in registry:
            raise ValueError(f"family {record.name!r} is declared twice")
        if not _declared_by_its_family(config, "mixer_class"):
            raise ValueError(f"family {record.name!r} has no mixer: name its token mixer class in "
                             f"{config.__name__}.mixer_class")
        if getattr(record.mixer, "unweighted_flops_per_token", None) is None:
            raise ValueError(f"family {record.name!r}: its mixer {record.mixer.__name__} does not count its FLOPs; "
                             "define its `unweighted_flops_per_token(seq_len)` (rotarium.training.flops)")
        if not vars(config).get("description"):
            raise ValueError(f"family {record.name!r}: {config.__name__} has no `description` of its own (the "
                             "family in words, as a model card names it)")
        if not _declared_by_its_family(config, "fla_peer"):
            raise ValueError(f"family {record.name!r}: {config.__name__} declares no fla peer; define its "
                             "`fla_peer(head_k_dim, head_v_dim)`: fla's model computing the same, or NoFlaPeer "
                             "saying why fla has none (benchmarks/gpu_check.py compares with it)")
        for bound in (record.model, record.lm):
            if bound.config_class is not config:
                raise ValueError(f"{bound.__name__}.config_class is {bound.config_class.__name__}, not "
                                 f"{config.__name__}")
        registry[record.name] = record
    return registry


# Every family's record, derived from its config (rotarium.models.configuration.FAMILY_CONFIGS). The lists of
# families elsewhere (configs, mixers, Auto classes, presets, the synthetic runs, the tests) are read from this one.
FAMILY_MODELS: dict[str, FamilyClasses] = family_registry(*map(bind_family, FAMILY_CONFIGS))
CONFIGS.update({name: record.config for name, record in FAMILY_MODELS.items()})
# Each family's token mixer by its name.
MIXERS: dict[str, type[nn.Module]] = {name: record.mixer for name, record in FAMILY_MODELS.items()}


def build_mixer(family: str, **kwargs) -> nn.Module:
    """The token mixer of ``family`` (one of :data:`MIXERS`) built from its keyword arguments."""
    if family not in MIXERS:
        raise ValueError(f"unknown mixer family {family!r}; choose one of {tuple(MIXERS)}")
    return MIXERS[family](**kwargs)
