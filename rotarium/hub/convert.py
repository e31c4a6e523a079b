"""``rotarium convert``: flash-linear-attention (fla) and Llama checkpoints as rotarium folders.

:func:`convert_checkpoint` reads a folder (or a Hub id) holding one of

- an fla model: ``gla`` (GLA), ``delta_net`` (DeltaNet), ``gated_deltanet`` (Gated DeltaNet),
  ``forgetting_transformer`` (FoX) or fla's ``transformer``, told apart from every other ``transformer`` by its
  parameter names (``model.embeddings``, ``layers.i.attn.q_proj``);
- a transformers ``llama`` model,

maps every field of its config to a rotarium config (the fla types with NoPE, as fla computes them; the
Transformer and Llama with RoPE), renames its parameters to rotarium's and writes a rotarium folder through the
model's own ``save_pretrained`` (safetensors, ``config.json``, the bundled remote code), with the tokenizer files
copied. The mapping is exact: an option rotarium cannot express raises a ``ValueError`` naming the field and its
value instead of converting approximately (docs/design.md §5 describes the mapping).

fla's config is read through fla's own config class where fla is importable, so that its defaults and its ignored
legacy keys apply exactly as fla reads them; without fla, the defaults of fla 0.6 for the fields read here
(:data:`FLA_DEFAULTS`) stand in.

A source is someone else's folder, so it is read as untrusted input. Every file read (config, index, weights,
tokenizer) must resolve inside the source folder, or, for a Hub download, into its cache repository's ``blobs/``
(:mod:`rotarium.hub.paths`), whatever an index entry or a link says; a ``.bin`` is unpickled with
``weights_only=True`` only; safetensors headers are checked against the file's size; and the config is compared
with the weights' tensor names and shapes (read from the headers) on a model built on the meta device, so a config
that asks for more than its weights hold is refused before anything of its size is allocated. ``OUT`` may not be,
contain or lie inside the source. Each refusal is a one-line ``ValueError`` naming the file or the field.

Fields ignored on purpose, because they do not change the function the weights compute:

- fla: ``attn_mode`` (the kernel), ``fuse_norm``, ``fuse_swiglu``, ``fuse_cross_entropy``,
  ``fuse_linear_cross_entropy`` (fused or unfused, the same formulas), ``use_l2warp`` (a training-loss
  regulariser), ``use_gk`` / ``use_gv`` (read by no fla 0.6 layer; a leftover ``gv`` parameter still raises as an
  unknown key), DeltaNet's ``use_output_norm`` (fla 0.6 always normalises), FoX's ``elementwise_affine`` (unread by
  its layer), ``norm_first``, ``share_conv_kernel``, ``rms_norm_eps`` (legacy keys fla 0.6 does not read),
  ``max_position_embeddings`` of the linear types (copied as metadata);
- Llama: ``pretraining_tp`` (a sharding of the same matmuls), ``attention_dropout`` (training only);
- both: ``use_cache`` and the special token ids are copied; ``torch_dtype`` follows the weights.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import pickle
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rotarium.hub.checkpoint import TOKENIZER_FILES
from rotarium.hub.paths import check_output_folder, confined
from rotarium.layers.positional import check_rope_parameters
from rotarium.models import CONFIGS, FAMILY_MODELS
from rotarium.models.configuration import FLA_QK_NORM_EPS
from rotarium.models.loading import check_one_weights_layout
from rotarium.utils.files import check_apart, copy_file, write_folder_atomic

FLA_TYPES = ("gla", "delta_net", "gated_deltanet", "forgetting_transformer", "transformer")
MODEL_TYPES = (*FLA_TYPES, "llama")
# The tokenizer files (those export copies: a chat template is one too) and the generation settings, copied as they
# are.
COPIED_FILES = (*TOKENIZER_FILES, "generation_config.json")
# What a Hub source's first download fetches: the config, the weights' indexes and every file of COPIED_FILES. The
# weights follow in the one layout weight_files reads (_download_weights).
SOURCE_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja"]
# safetensors' own limit on a header's size: a larger one is a corrupt or hostile file, not a checkpoint.
MAX_SAFETENSORS_HEADER = 100_000_000
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32",
                      "U64": "uint64", "C64": "complex64"}
# fla 0.6's defaults of the config fields read below, for reading a config where fla is not installed.
_FLA_SHARED = {"hidden_size": 2048, "num_hidden_layers": 24, "hidden_ratio": 4, "intermediate_size": None,
               "hidden_act": "swish", "norm_eps": 1e-6, "initializer_range": 0.02, "tie_word_embeddings": False,
               "use_cache": True, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2, "vocab_size": 32000,
               "attnres_block_size": None}
_FLA_LINEAR = {**_FLA_SHARED, "max_position_embeddings": 2048, "attn": None}
_FLA_ATTENTION = {"num_heads": 32, "num_kv_heads": None, "qkv_bias": False, "qk_norm": False, "window_size": None}
FLA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gla": {**_FLA_LINEAR, "num_heads": 4, "expand_k": 0.5, "expand_v": 1.0, "num_kv_heads": None,
            "feature_map": None, "use_short_conv": False, "conv_size": 4, "use_output_gate": True, "clamp_min": None,
            "elementwise_affine": True},
    "delta_net": {**_FLA_LINEAR, "num_heads": 16, "expand_k": 1.0, "expand_v": 1.0, "use_gate": False,
                  "use_short_conv": True, "allow_neg_eigval": False, "conv_size": 4, "use_beta": True,
                  "qk_norm": "l2", "qk_activation": "silu"},
    "gated_deltanet": {**_FLA_LINEAR, "num_hidden_layers": 21, "num_heads": 6, "head_dim": 256, "expand_v": 2.0,
                       "num_v_heads": None, "use_gate": True, "use_short_conv": True, "allow_neg_eigval": False,
                       "conv_size": 4, "output_gate_activation": "swish"},
    "forgetting_transformer": {**_FLA_SHARED, **_FLA_ATTENTION, "use_output_gate": False},
    "transformer": {**_FLA_SHARED, **_FLA_ATTENTION, "max_position_embeddings": 2048, "rope_theta": 10000.0},
}


# --------------------------------------------------------------------------------------------- reading a source

def resolve_source(src: str | os.PathLike) -> Path:
    """A local folder as it is; anything else is a Hub model id, downloaded (config, tokenizer, and
    the weights in the one layout :func:`weight_files` reads).
    ``ValueError`` for what is neither, or for an id that cannot be downloaded (unknown, or the Hub offline)."""
    path = Path(src)
    if path.is_dir():
        return path
    if path.exists() or str(src).startswith((".", "/", "~")) or str(src).count("/") != 1:
        raise ValueError(f"{src!r} is neither a folder nor a Hub model id ('namespace/name')")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(str(src), allow_patterns=SOURCE_PATTERNS))
        _download_weights(folder, partial(snapshot_download, str(src), revision=folder.name))
        return folder
    except (HFValidationError, HfHubHTTPError, LocalEntryNotFoundError, OSError) as error:
        message = " ".join(str(error).split()) or type(error).__name__
        raise ValueError(f"{src!r} is not a local folder, and as a Hub model id it could not be downloaded "
                         f"({type(error).__name__}: {message}); pass a folder, or an existing id with the Hub "
                         "reachable (HF_HUB_OFFLINE unset)") from None


def _download_weights(folder: Path, download: Callable[..., str]) -> None:
    """Fetches into the Hub snapshot ``folder`` the weight files :func:`weight_files` reads, and no other layout's:
    a repository often holds the same weights twice (safetensors and ``pytorch_model*.bin``, or a
    ``consolidated.safetensors`` beside the shards). As transformers does, ``model.safetensors`` first, else the
    shards of ``model.safetensors.index.json``, else the pickles. ``download`` is ``snapshot_download`` bound to the
    repository at the commit of ``folder`` (its name), so that every file comes from that commit."""
    download(allow_patterns=["model.safetensors"])
    if (folder / "model.safetensors").exists():
        return
    index = folder / "model.safetensors.index.json"
    if index.exists():
        download(allow_patterns=[glob.escape(name) for name in _index_files(index, folder)])
    else:
        download(allow_patterns=["pytorch_model*.bin"])


def _confined_source(path: Path, folder: Path) -> Path:
    return confined(path, folder, reader="convert", why="a link or an index entry could bring in any file")


def read_source_config(folder: Path) -> dict[str, Any]:
    """The JSON object of ``folder/config.json``; ``ValueError`` naming the file when it is missing, not UTF-8, not
    JSON or not an object."""
    path = folder / "config.json"
    if not path.is_file():
        contents = "is empty" if not any(folder.iterdir()) else "has no config.json"
        raise ValueError(f"source {folder} {contents}: convert reads a checkpoint folder holding config.json and its "
                         "weights (model.safetensors, its index, or pytorch_model*.bin)")
    _confined_source(path, folder)
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text ({error}); a config.json is UTF-8 JSON") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None
    if isinstance(raw, dict):
        return raw
    raise ValueError(f"{path} holds a JSON {type(raw).__name__}, not an object of config fields")


def _index_files(index: Path, folder: Path) -> list[str]:
    """The file names the weight map of the sharded checkpoint's ``index`` (in ``folder``) gives, sorted, once each."""
    _confined_source(index, folder)
    try:
        data = json.loads(index.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{index} is not UTF-8 JSON ({error})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(name, str) and isinstance(file, str) and file for name, file in weight_map.items()):
        found = repr(weight_map)[:80] if isinstance(data, dict) else f"a JSON {type(data).__name__}"
        raise ValueError(f"{index}: `weight_map` must be an object mapping each tensor name to a .safetensors file "
                         f"of the folder, found {found}")
    return sorted(set(weight_map.values()))


def _read_index(index: Path, folder: Path) -> list[Path]:
    """The weight files named by the sharded checkpoint's ``index``, each of them inside ``folder``."""
    files = []
    for name in _index_files(index, folder):
        file = folder / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"{index} names the weight file {name!r}, a path out of {folder}; convert reads weights "
                             "only from inside the source folder (an index entry could bring in any file): name the "
                             "shards by their file names in the folder")
        if not (file.is_file() or file.is_symlink()):
            raise ValueError(f"{index} names the weight file {name!r}, which is not in {folder}")
        try:
            files.append(_confined_source(file, folder))
        except ValueError as error:
            raise ValueError(f"{index} names the weight file {name!r}: {error}") from None
    return files


def weight_files(folder: Path) -> list[Path]:
    """The checkpoint's weight files in ``folder``: the shards of ``model.safetensors.index.json``, else
    ``model.safetensors``, else ``pytorch_model*.bin``; each must resolve inside ``folder`` (or, for a Hub download,
    into its cache repository's blobs), whatever an index or a link says. ``ValueError`` when there are none.

    Only transformers' own file names are read: some repositories also hold the same weights in another layout
    (e.g. ``consolidated.safetensors``)."""
    check_one_weights_layout(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file() or index.is_symlink():
        return _read_index(index, folder)
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors").is_symlink():
        return [_confined_source(folder / "model.safetensors", folder)]
    files = sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise ValueError(f"no weights in {folder}: expected model.safetensors, model.safetensors.index.json or "
                         "pytorch_model*.bin beside config.json")
    return [_confined_source(file, folder) for file in files]


def safetensors_shapes(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path`` as meta tensors (names, shapes, dtypes), read from its header
    alone; ``ValueError`` naming the file when the header is too large, not JSON, or describes data the file does
    not hold (a truncated or corrupt file)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is not a safetensors file: {size} bytes, fewer than its 8-byte header length "
                             "(truncated or empty)")
        header_size = int.from_bytes(prefix, "little")
        if header_size > MAX_SAFETENSORS_HEADER:
            raise ValueError(f"{path}: its header says {header_size:,} bytes, more than safetensors allows "
                             f"({MAX_SAFETENSORS_HEADER:,}); the file is corrupt or not a safetensors file")
        if 8 + header_size > size:
            raise ValueError(f"{path} is truncated: its header says {header_size:,} bytes, the file holds {size:,}")
        raw = f.read(header_size)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if isinstance(header, dict):
        data_size = size - 8 - header_size
        return {name: _meta_tensor(path, name, entry, data_size) for name, entry in header.items()
                if name != "__metadata__"}
    raise ValueError(f"{path} is not a safetensors file: its header is not a JSON object (corrupt)")


def _meta_tensor(path: Path, name: str, entry: Any, data_size: int) -> torch.Tensor:
    """One header entry of a safetensors file as a meta tensor, after checking that the file holds its data."""
    entry_of = entry if isinstance(entry, dict) else {}
    dtype_name = entry_of.get("dtype")
    dtype = getattr(torch, SAFETENSORS_DTYPES.get(dtype_name, ""), None) if isinstance(dtype_name, str) else None
    shape, offsets = entry_of.get("shape"), entry_of.get("data_offsets")
    if (not isinstance(dtype, torch.dtype) or not isinstance(shape, list) or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in [*shape, *offsets])):
        raise ValueError(f"{path}: the header entry of tensor {name!r} is not a safetensors tensor (dtype, shape, "
                         f"data_offsets): {json.dumps(entry)[:120]}; the file is corrupt")
    begin, end = offsets
    if end > data_size:
        raise ValueError(f"{path} is truncated: tensor {name!r} ends at byte {end:,} of the data, the file holds "
                         f"{data_size:,}")
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"{path}: tensor {name!r} of shape {shape} takes {end - begin:,} bytes instead of "
                         f"{math.prod(shape) * dtype.itemsize:,}; the file is corrupt")
    try:
        return torch.empty(shape, dtype=dtype, device="meta")
    except (RuntimeError, OverflowError):  # an empty tensor with a dimension past int64
        raise ValueError(f"{path}: tensor {name!r} has shape {shape}, not a tensor shape; the file is corrupt") \
            from None


def load_pickled_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``pytorch_model*.bin``, unpickled with ``weights_only=True``: a file that holds anything
    but tensors is refused unread, since unpickling it could run its code."""
    try:
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "weights only" not in str(error).lower():
            raise ValueError(f"{path} is not a readable PyTorch weights file (truncated or corrupt)") from None
        raise ValueError(f"{path} holds code or Python objects besides tensors, and is not loaded: unpickling it "
                         "could run that code. Convert a checkpoint whose weights are safetensors "
                         "(model.safetensors)") from None
    except (RuntimeError, EOFError, OSError, KeyError, ValueError) as error:
        raise ValueError(f"{path} is not a readable PyTorch weights file (truncated or corrupt: "
                         f"{type(error).__name__})") from None
    if not isinstance(state_dict, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state_dict.items()):
        raise ValueError(f"{path} holds a {type(state_dict).__name__}, not a state dict of named tensors")
    return state_dict


def load_state_dict(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of the weight ``files`` (from :func:`weight_files`), loaded."""
    if files[0].suffix == ".bin":
        return {name: tensor for file in files for name, tensor in load_pickled_weights(file).items()}
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state_dict = {}
    for file in files:
        try:
            state_dict.update(load_file(file))
        except SafetensorError as error:
            raise ValueError(f"{file} could not be read as safetensors ({' '.join(str(error).split())})") from None
    return state_dict


def is_fla_transformer(state_dict: dict[str, torch.Tensor]) -> bool:
    """fla's Transformer by its parameter names: fla's embedding and attention names, none of another fla mixer."""
    names = set(state_dict)
    others = (".attn.f_proj.", ".attn.gk_proj.", ".attn.b_proj.")
    return ("model.embeddings.weight" in names and any(".attn.q_proj." in n for n in names)
            and not any(o in n for n in names for o in others))


def fla_config_classes() -> dict[str, type]:
    """fla's config class of each of :data:`FLA_TYPES`; ``ImportError`` where fla is not installed."""
    from fla import models as fla_models

    return {"gla": fla_models.GLAConfig, "delta_net": fla_models.DeltaNetConfig,
            "gated_deltanet": fla_models.GatedDeltaNetConfig,
            "forgetting_transformer": fla_models.ForgettingTransformerConfig,
            "transformer": fla_models.TransformerConfig}


def read_fla_config(model_type: str, raw: dict[str, Any]) -> Any:
    """The config as fla reads it: fla's config class where fla is importable, else fla's defaults under ``raw``."""
    try:
        classes = fla_config_classes()
    except ImportError:
        return argparse.Namespace(**{**FLA_DEFAULTS[model_type], **raw})
    return classes[model_type].from_dict(raw)


# ------------------------------------------------------------------------------------------------- the mapping

def _require(model_type: str, field: str, value: Any, allowed: tuple, why: str) -> None:
    """Raises unless ``value`` (of source field ``field``) is one of ``allowed``; ``why`` says what would work."""
    if value not in allowed:
        raise ValueError(f"cannot convert {model_type} exactly: `{field}` = {value!r} is not expressible in rotarium "
                         f"({why}); convertible: {' or '.join(repr(a) for a in allowed)}")


def fla_intermediate_size(config: Any) -> int:
    """fla's ``GatedMLP`` width: ``intermediate_size``, else 2/3 of ``hidden_ratio`` (default 4) times the width,
    rounded up to a multiple of 256."""
    if config.intermediate_size is not None:
        return config.intermediate_size
    width = int(config.hidden_size * (config.hidden_ratio or 4) * 2 / 3)
    return 256 * ((width + 255) // 256)


def _fla_shared(model_type: str, config: Any) -> dict[str, Any]:
    _require(model_type, "hidden_act", config.hidden_act, ("swish", "silu"), "the feed-forward network is SwiGLU")
    _require(model_type, "attn", getattr(config, "attn", None), (None,),
             "no hybrid models with softmax-attention layers")
    _require(model_type, "attnres_block_size", getattr(config, "attnres_block_size", None), (None,),
             "no attention residuals")
    return {"vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_hidden_layers, "num_heads": config.num_heads,
            "intermediate_size": fla_intermediate_size(config), "norm_eps": config.norm_eps,
            "initializer_range": config.initializer_range, "tie_word_embeddings": config.tie_word_embeddings,
            # FoX's config has no context length: rotarium's default stands
            "max_position_embeddings": getattr(config, "max_position_embeddings", 2048), "use_cache": config.use_cache,
            "pad_token_id": config.pad_token_id, "bos_token_id": config.bos_token_id,
            "eos_token_id": config.eos_token_id}


def map_fla_config(model_type: str, config: Any) -> tuple[str, dict[str, Any]]:
    """``(rotarium family, rotarium config kwargs)`` of an fla config; ``ValueError`` for what cannot map."""
    kwargs = _fla_shared(model_type, config)
    if model_type == "gla":
        _require(model_type, "num_kv_heads", config.num_kv_heads, (None, config.num_heads),
                 "GLA shares no key, value or gate heads")
        _require(model_type, "feature_map", config.feature_map, (None,), "GLA applies no feature map to q, k")
        _require(model_type, "use_output_gate", config.use_output_gate, (True,), "GLA's output is always gated")
        _require(model_type, "clamp_min", config.clamp_min, (None,), "the decay gate has no floor")
        return "gla", {**kwargs, "position_encoding": "nope", "expand_k": config.expand_k,
                       "expand_v": config.expand_v, "use_short_conv": config.use_short_conv,
                       "conv_size": config.conv_size, "gate_low_rank_dim": 16, "gate_logit_normalizer": 16.0,
                       "rotary_gate_per_pair": False}
    if model_type in ("delta_net", "gated_deltanet"):
        _require(model_type, "use_short_conv", config.use_short_conv, (True,),
                 "without convolutions fla still applies SiLU to q, k, v, rotarium does not")
        _require(model_type, "allow_neg_eigval", config.allow_neg_eigval, (False,), "beta stays in (0, 1)")
        common = {**kwargs, "position_encoding": "nope", "use_short_conv": True, "conv_size": config.conv_size,
                  "use_output_gate": config.use_gate}
        if model_type == "delta_net":
            _require(model_type, "use_beta", config.use_beta, (True,), "beta is always sigmoid(W_b x)")
            _require(model_type, "qk_norm", config.qk_norm, ("l2",), "q and k are L2-normalised")
            _require(model_type, "qk_activation", config.qk_activation, ("silu",),
                     "q and k pass through SiLU convolutions")
            return "deltanet", {**common, "expand_k": config.expand_k, "expand_v": config.expand_v}
        _require(model_type, "num_v_heads", config.num_v_heads, (None, config.num_heads),
                 "value heads equal query and key heads")
        _require(model_type, "output_gate_activation", config.output_gate_activation, ("swish", "silu"),
                 "the output gate is SiLU")
        return "deltanet", {**common, "use_gated_delta": True, "head_dim": config.head_dim,
                            "expand_v": config.expand_v}
    # the softmax types: no head_dim option in fla, whose heads split the width
    _require(model_type, "window_size", config.window_size, (None,), "attention is never windowed")
    attention = {**kwargs, "num_kv_heads": config.num_kv_heads, "attention_bias": config.qkv_bias,
                 "qk_norm": config.qk_norm}
    if config.qk_norm:
        attention["qk_norm_eps"] = FLA_QK_NORM_EPS
    if model_type == "forgetting_transformer":
        if config.qk_norm:
            attention["qk_norm_per_head"] = True
        return "fox", {**attention, "position_encoding": "nope", "output_gate": config.use_output_gate}
    if config.rope_theta is None:
        raise ValueError("cannot convert transformer exactly: `rope_theta` = None is not expressible in rotarium "
                         "(RoPE needs a base); convertible: a positive number")
    return "transformer", {**attention, "position_encoding": "rope", "rope_theta": config.rope_theta}


# longrope's per-pair factors come with Phi-3's other differences, which this conversion does not cover
LLAMA_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def map_llama_config(config: Any) -> tuple[str, dict[str, Any]]:
    """``("transformer", rotarium config kwargs)`` of a transformers ``LlamaConfig``."""
    _require("llama", "hidden_act", config.hidden_act, ("silu",), "the feed-forward network is SwiGLU")
    _require("llama", "attention_bias", config.attention_bias, (False,),
             "Llama's attention bias includes o_proj, which has none in rotarium")
    _require("llama", "mlp_bias", config.mlp_bias, (False,), "the feed-forward network has no biases")
    rope = dict(config.rope_parameters or {})
    rope_type = rope.get("rope_type", "default")
    _require("llama", "rope_parameters.rope_type", rope_type, LLAMA_ROPE_TYPES,
             "rotarium computes these scalings with transformers' own functions")
    _require("llama", "rope_parameters.partial_rotary_factor", rope.get("partial_rotary_factor", 1.0), (1.0,),
             "Llama's rotary dims are the whole head")
    try:  # transformers only warns of some values rotarium's configs refuse (a factor below 1)
        check_rope_parameters(rope)
    except ValueError as error:
        raise ValueError(f"cannot convert llama: {error}") from None
    return "transformer", {
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers, "num_heads": config.num_attention_heads,
        "num_kv_heads": config.num_key_value_heads, "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size, "norm_eps": config.rms_norm_eps,
        "initializer_range": config.initializer_range, "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings, "use_cache": config.use_cache,
        "pad_token_id": config.pad_token_id, "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id, "position_encoding": "rope", "rope_theta": rope["rope_theta"],
        # the scaling's own keys; rope_theta and partial_rotary_factor are fields of their own
        "rope_parameters": {key: value for key, value in rope.items()
                            if key not in ("rope_theta", "partial_rotary_factor", "type")} or None}


# fla / Llama parameter names -> rotarium's, applied in order to every key
FLA_RENAMES = (("model.embeddings.", "model.embed_tokens."), (".attn_norm.", ".mixer_norm."), (".attn.", ".mixer."),
               ("_conv1d.", "_conv."), (".g_norm_swish_gate.", ".o_norm."), (".g_norm.", ".o_norm."))
FOX_RENAMES = ((".mixer.f_proj.", ".mixer.fgate_proj."), (".mixer.g_proj.", ".mixer.ogate_proj."))
LLAMA_RENAMES = ((".self_attn.", ".mixer."), (".input_layernorm.", ".mixer_norm."),
                 (".post_attention_layernorm.", ".mlp_norm."))


def rename_state_dict(model_type: str, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The source's tensors under rotarium's names (Llama's rotary ``inv_freq`` buffers dropped: RoPE recomputes
    them)."""
    if model_type == "llama":
        renames = LLAMA_RENAMES
    else:
        renames = (*FLA_RENAMES, *(FOX_RENAMES if model_type == "forgetting_transformer" else ()))
    renamed = {}
    for name, tensor in state_dict.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        for old, new in renames:
            name = name.replace(old, new)
        renamed[name] = tensor
    return renamed


def fit_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], model_type: str,
                   config: Any) -> dict[str, torch.Tensor]:
    """``state_dict`` completed and shaped for ``model``: a tied head and GLA's weightless output norm
    (``elementwise_affine=False``: a weight of ones) are filled in, per-head QK-norm weights ``[H*D]`` become
    ``[H, D]``. Any name left over on either side, or a shape that differs, raises ``ValueError``."""
    expected = model.state_dict()
    fitted = dict(state_dict)
    if model.config.tie_word_embeddings:
        fitted.pop("lm_head.weight", None)
    for name, target in expected.items():
        if name in fitted:
            if fitted[name].shape != target.shape and fitted[name].numel() == target.numel() \
                    and name.endswith(("q_norm.weight", "k_norm.weight")):
                fitted[name] = fitted[name].reshape(target.shape)
        elif name.endswith(".o_norm.weight") and model_type == "gla" and not config.elementwise_affine:
            fitted[name] = torch.ones_like(target)
        elif name == "lm_head.weight" and model.config.tie_word_embeddings and "model.embed_tokens.weight" in fitted:
            fitted[name] = fitted["model.embed_tokens.weight"]
    unknown = sorted(set(fitted) - set(expected))
    missing = sorted(set(expected) - set(fitted))
    if unknown or missing:
        raise ValueError(f"cannot convert {model_type} exactly: parameters without a rotarium counterpart "
                         f"{unknown[:8]}, rotarium parameters without a source {missing[:8]}")
    for name, target in expected.items():
        if fitted[name].shape != target.shape:
            raise ValueError(f"cannot convert {model_type}: `{name}` has shape {tuple(fitted[name].shape)}, the "
                             f"converted config gives {tuple(target.shape)}")
    return fitted


# ------------------------------------------------------------------------------------------------- converting

def source_model_type(folder: Path, raw: dict[str, Any], state_dict: dict[str, torch.Tensor]) -> str:
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"cannot convert model_type {model_type!r}: rotarium converts fla's {FLA_TYPES} and "
                         "transformers' 'llama'")
    if model_type == "transformer" and not is_fla_transformer(state_dict):
        raise ValueError(f"{folder} says model_type 'transformer' but its parameters are not fla's Transformer's "
                         "(model.embeddings, layers.i.attn.q_proj)")
    return model_type


def check_layer_count(folder: Path, kwargs: dict[str, Any], names: list[str]) -> None:
    """``ValueError`` unless the weights hold exactly the ``num_hidden_layers`` layers the config asks for: checked
    on the names alone, before a model of that depth is built, even on the meta device."""
    layers = {int(m.group(1)) for name in names if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    expected = kwargs["num_hidden_layers"]
    held = f"{len(layers)} layers (model.layers.0 to model.layers.{max(layers)})" if layers else "no layers"
    if not isinstance(expected, int) or isinstance(expected, bool) or expected != len(layers) \
            or (layers and max(layers) != len(layers) - 1):
        raise ValueError(f"{folder / 'config.json'} says num_hidden_layers = {expected!r}, but the weights hold "
                         f"{held}; convert a config.json that matches its weights")


def map_config(folder: Path, raw: dict[str, Any], model_type: str) -> tuple[Any, str, dict[str, Any]]:
    """``(the source's config as its library reads it, rotarium family, rotarium config kwargs)``; ``ValueError``
    naming ``config.json`` when its values are of the wrong kind."""
    from huggingface_hub.errors import StrictDataclassError  # transformers' configs check their fields' types

    try:
        if model_type == "llama":
            from transformers import LlamaConfig

            config = LlamaConfig.from_dict(raw)
            return (config, *map_llama_config(config))
        config = read_fla_config(model_type, raw)
        return (config, *map_fla_config(model_type, config))
    except (TypeError, AttributeError, KeyError, OverflowError, StrictDataclassError) as error:
        raise ValueError(f"{folder / 'config.json'} cannot be read as a {model_type} config "
                         f"({type(error).__name__}: {' '.join(str(error).split())})") from None


def build_model(family: str, config: Any, folder: Path) -> torch.nn.Module:
    """The rotarium model of ``config``, on the current default device; ``ValueError`` naming ``config.json`` when a
    value cannot build a layer (a float where a size goes)."""
    try:
        return FAMILY_MODELS[family].lm(config)
    except (TypeError, RuntimeError, OverflowError) as error:
        raise ValueError(f"{folder / 'config.json'}: its values cannot build a {family} model "
                         f"({type(error).__name__}: {' '.join(str(error).split())[:200]})") from None


def convert_checkpoint(src: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Converts the fla or Llama checkpoint ``src`` (a folder or a Hub model id) into the rotarium folder ``out``,
    written atomically; returns ``out``. Raises ``ValueError`` naming the field for an option rotarium cannot
    express, naming the file for a source it cannot read, and :class:`rotarium.hub.paths.OutputExistsError` (a
    ``FileExistsError`` too) when ``out`` is a non-empty folder and ``overwrite`` is off.

    Nothing large is allocated before the weights are known to fit the config: the source's tensor names and shapes
    (safetensors headers) are compared with a model built on the meta device, so a config that asks for more than
    its weights hold is refused at once."""
    if Path(src).is_dir():  # a Hub source lies in the cache, checked once downloaded
        check_apart(out, src, "OUT", "source")
    out = check_output_folder(out, overwrite=overwrite, what="OUT")
    folder = resolve_source(src)
    check_apart(out, folder, "OUT", "source")
    raw = read_source_config(folder)
    files = weight_files(folder)
    loaded = load_state_dict(files) if files[0].suffix == ".bin" else None
    if loaded is not None:
        shapes = {name: tensor.to("meta") for name, tensor in loaded.items()}
    else:
        shapes = {name: tensor for file in files for name, tensor in safetensors_shapes(file).items()}
    model_type = source_model_type(folder, raw, shapes)
    config_of_source, family, kwargs = map_config(folder, raw, model_type)
    check_layer_count(folder, kwargs, list(shapes))
    try:
        config = CONFIGS[family](**kwargs)
    except (ValueError, TypeError, OverflowError) as error:
        raise ValueError(f"{folder / 'config.json'} converts to an invalid rotarium {family} config: "
                         f"{' '.join(str(error).split())}") from None
    with torch.device("meta"):
        meta_model = build_model(family, config, folder)
    try:
        fit_state_dict(meta_model, rename_state_dict(model_type, shapes), model_type, config_of_source)
    except ValueError as error:
        raise ValueError(f"{folder / 'config.json'} does not match the weights beside it: {error}") from None

    state_dict = loaded if loaded is not None else load_state_dict(files)
    model = build_model(family, config, folder)
    fitted = fit_state_dict(model, rename_state_dict(model_type, state_dict), model_type, config_of_source)
    model.load_state_dict(fitted, strict=True)
    # The checkpoint keeps the precision its weights were published in.
    model.to(fitted["model.embed_tokens.weight"].dtype).eval()
    tokenizer_files = [_confined_source(folder / name, folder) for name in COPIED_FILES
                       if (folder / name).is_file() or (folder / name).is_symlink()]

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        for file in tokenizer_files:
            copy_file(file, tmp / file.name)

    write_folder_atomic(out, write)
    return out


# ------------------------------------------------------------------------------------------------------- CLI

def run_convert(args: argparse.Namespace) -> int:
    out = convert_checkpoint(args.src, args.out, overwrite=args.overwrite)
    print(f"converted {args.src} -> {out}")
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Registers ``rotarium convert SRC OUT``."""
    convert = subparsers.add_parser(
        "convert", help="convert an fla or Llama checkpoint into a rotarium folder",
        description="Convert a flash-linear-attention checkpoint (gla, delta_net, gated_deltanet, "
                    "forgetting_transformer, transformer) or a transformers llama checkpoint into a rotarium folder "
                    "(safetensors, config, tokenizer, remote code) that computes the same logits. Options rotarium "
                    "cannot express are refused with the field named.")
    convert.add_argument("src", help="local folder or Hugging Face Hub model id of the source checkpoint")
    convert.add_argument("out", help="rotarium folder to write (must not exist or be empty, unless --overwrite)")
    convert.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    convert.set_defaults(func=run_convert)
