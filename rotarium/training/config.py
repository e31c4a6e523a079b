"""The training config: nested dataclasses with defaults, read from a recipe name or a YAML file, then overridden
by ``--section.key value`` pairs from the command line. Unknown keys and values of the wrong type raise a
``ValueError`` naming the key, before anything is built."""
from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from rotarium.data.config import DEFAULT_SEED, DataSection
from rotarium.evaluation.perplexity import DEFAULT_LENGTHS as PERPLEXITY_LENGTHS
from rotarium.layers.positional import POSITION_ENCODINGS
from rotarium.models.modeling import FAMILY_MODELS


@dataclass
class ModelSection:
    """``family`` + ``preset`` (a name of ``rotarium.PRESETS``) or explicit sizes; ``options`` are any further
    model-config fields (positional settings, family fields)."""
    family: str = field(default="gla", metadata={"help": " | ".join(FAMILY_MODELS)})
    preset: str | None = field(default=None, metadata={
        "help": "a preset such as gla-370m: its family and sizes replace family, hidden_size, num_hidden_layers, "
                "num_heads and intermediate_size"})
    position_encoding: str = field(default="selective_rope", metadata={"help": " | ".join(POSITION_ENCODINGS)})
    hidden_size: int = field(default=256, metadata={"help": "model width"})
    num_hidden_layers: int = field(default=4, metadata={"help": "number of blocks"})
    num_heads: int = field(default=4, metadata={"help": "heads of each token mixer"})
    intermediate_size: int | None = field(
        default=None, metadata={"help": "MLP width (default: derived from hidden_size)"})
    options: dict = field(default_factory=dict, metadata={
        "help": "further model-config fields, each set as --model.options.<field> VALUE"})
    init_from: str | None = field(
        default=None, metadata={"help": "fine-tune this checkpoint folder or Hub id (its tokenizer is used)"})
    gradient_checkpointing: bool = field(
        default=False, metadata={"help": "recompute activations in the backward pass to save memory"})


@dataclass
class TokenizerSection:
    """``name``: a Hub tokenizer or local folder; ``None`` trains a byte-level BPE of ``vocab_size`` on the data."""
    name: str | None = field(default=None, metadata={
        "help": "a Hub tokenizer or local folder (default: train a byte-level BPE on the data)"})
    vocab_size: int = field(default=4096, metadata={"help": "size of the trained BPE"})
    train_documents: int = field(default=100000, metadata={"help": "documents the BPE is trained on"})


@dataclass
class OptimSection:
    """AdamW and its learning-rate schedule (see :mod:`rotarium.training.optim`)."""
    lr: float = field(default=3e-3, metadata={"help": "peak learning rate"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "the learning rate decays to lr * min_lr_ratio"})
    weight_decay: float = field(
        default=0.1, metadata={"help": "AdamW weight decay of the matrices (not of norms, biases, embeddings)"})
    betas: list = field(default_factory=lambda: [0.9, 0.95], metadata={"help": "AdamW betas"})
    eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon"})
    schedule: str = field(
        default="cosine", metadata={"help": "cosine | wsd (warmup-stable-decay) | constant, after the warmup"})
    warmup_steps: int = field(default=30, metadata={"help": "steps of linear warmup from 0"})
    decay_fraction: float = field(
        default=0.2, metadata={"help": "wsd only: the last fraction of the steps decays linearly"})
    grad_clip: float = field(default=1.0, metadata={"help": "gradient norm clipping (0: off)"})


@dataclass
class TrainSection:
    """The loop: batch sizes, length, evaluation and checkpoint intervals, precision, logging."""
    batch_size: int = field(default=16, metadata={"help": "sequences per process per micro-step"})
    gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "micro-steps per optimizer step (without global_batch_size)"})
    global_batch_size: int | None = field(default=None, metadata={
        "help": "sequences per optimizer step; sets the accumulation from the number of processes"})
    max_steps: int = field(default=300, metadata={"help": "optimizer steps"})
    eval_every: int = field(default=50, metadata={"help": "steps between validation losses"})
    eval_batches: int = field(default=8, metadata={
        "help": "validation batches of the global batch's size, shared by the processes"})
    save_every: int = field(default=100, metadata={"help": "steps between checkpoints"})
    keep_checkpoints: int = field(
        default=2, metadata={"help": "the newest complete checkpoints kept; older ones are deleted"})
    log_every: int = field(default=10, metadata={"help": "steps between logged training losses"})
    seed: int = field(default=DEFAULT_SEED, metadata={
        "help": "seed of the weights, the validation split, the data order and the sample"})
    mixed_precision: str = field(default="auto", metadata={"help": "auto (bf16 on GPUs) | no | bf16 | fp16"})
    max_bad_steps: int = field(default=10, metadata={"help": "non-finite steps in a row that stop the run"})
    spike_factor: float = field(default=3.0, metadata={
        "help": "a loss above spike_factor x the lowest running median of spike_window losses (at most ln(vocab)) "
                "is a spike: checkpoints after it are not marked good (0: only non-finite losses count)"})
    spike_window: int = field(default=50, metadata={"help": "losses in the running median of the spike check"})
    report_to: list = field(
        default_factory=list, metadata={"help": "accelerate trackers, e.g. [tensorboard] or [wandb]"})
    num_threads: int | None = field(default=None, metadata={"help": "torch CPU threads (default: torch's choice)"})
    compile: bool = field(default=False, metadata={
        "help": "torch.compile each block (fuses the ops around the token mixers' kernels; the first steps are slow "
                "while it compiles)"})


@dataclass
class EvalSection:
    """What ``rotarium train`` evaluates with the final weights."""
    run_after: bool = field(default=True, metadata={"help": "evaluate and sample once training ends"})
    context_lengths: list = field(
        default_factory=lambda: list(PERPLEXITY_LENGTHS), metadata={"help": "context lengths of the perplexity table"})
    sample_prompt: str = field(default="The for statement", metadata={"help": "prompt of the sample"})
    sample_tokens: int = field(default=48, metadata={"help": "tokens sampled"})


@dataclass
class Config:
    """The whole training config, one section per concern; every key is ``section.field``."""
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def recipe_names() -> list[str]:
    folder = resources.files("rotarium.configs") / "recipes"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def _allowed(tp: Any) -> tuple[type, ...]:
    args = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else (tp,)
    return tuple(typing.get_origin(a) or a for a in args)


@functools.cache
def field_types(section: type) -> dict[str, tuple[type, ...]]:
    """The types each field of the config section ``section`` accepts: ``int | None`` -> ``(int, NoneType)``."""
    hints = typing.get_type_hints(section)
    return {f.name: _allowed(hints[f.name]) for f in dataclasses.fields(section)}


def _yaml(text: str, where: str) -> Any:
    """``text`` read as YAML; a syntax error becomes a ``ValueError`` naming ``where`` and the line."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"{where} is not valid YAML{at}: {problem}") from None


def _coerce(key: str, value: Any, allowed: tuple[type, ...]) -> Any:
    if value is None and type(None) in allowed:
        return None
    if isinstance(value, str) and str not in allowed:
        parsed = _yaml(value, f"config key `{key}`: {value!r}")  # a command-line string: "true", "[64, 128]"
        if isinstance(parsed, str) and float in allowed:
            try:
                parsed = float(parsed)  # YAML 1.1 reads "1e-3" (no dot) as a string
            except ValueError:
                pass
        value = parsed if parsed is not None or type(None) in allowed else value
        if value is None:
            return None
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if bool in allowed and not isinstance(value, bool):
        raise ValueError(f"config key `{key}` must be true or false, got {value!r}")
    if not isinstance(value, tuple(a for a in allowed if a is not type(None))) or (
            isinstance(value, bool) and bool not in allowed):
        names = " or ".join(a.__name__ for a in allowed)
        raise ValueError(f"config key `{key}` must be {names}, got {value!r} ({type(value).__name__})")
    return value


def _apply(config: Config, key: str, value: Any) -> None:
    parts = key.split(".")
    if len(parts) < 2 or parts[0] not in {f.name for f in dataclasses.fields(Config)}:
        sections = ", ".join(f.name for f in dataclasses.fields(Config))
        raise ValueError(f"unknown config key `{key}`: keys are `section.name` with a section among {sections}")
    section = getattr(config, parts[0])
    fields = {f.name: f for f in dataclasses.fields(section)}
    if parts[1] not in fields:
        raise ValueError(f"unknown config key `{key}`; `{parts[0]}` has {', '.join(fields)}")
    if parts[1] == "options" and len(parts) > 2:  # model.options.rope_theta: a free-form model-config field
        section.options[".".join(parts[2:])] = _yaml(value, f"`{key}`: {value!r}") if isinstance(value, str) else value
        return
    if len(parts) > 2:
        raise ValueError(f"unknown config key `{key}`: `{parts[0]}.{parts[1]}` takes one value; only "
                         "`model.options.NAME` has a third part")
    setattr(section, parts[1], _coerce(key, value, field_types(type(section))[parts[1]]))


def flatten(sections: dict[str, Any]) -> dict[str, Any]:
    """``{"optim": {"lr": 1e-3}}`` -> ``{"optim.lr": 1e-3}``, one level deep (so ``model.options`` stays a
    mapping); a value that is not a section keeps its key, which :func:`load_config` then reports."""
    out: dict[str, Any] = {}
    for key, value in sections.items():
        if isinstance(value, dict):
            out.update({f"{key}.{name}": item for name, item in value.items()})
        else:
            out[key] = value
    return out


def load_config(source: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """``source``: a recipe name (see :func:`recipe_names`), a YAML path, or ``None`` for the embedded default;
    ``overrides``: dotted keys (``optim.lr``) to values (strings are parsed as YAML scalars)."""
    config = Config()
    data: dict = {}
    if source is not None:
        path = Path(source)
        if path.suffix in (".yaml", ".yml") or path.exists():
            if not path.is_file():
                raise ValueError(f"--config {source!r}: no such file")
            text = path.read_text()
        elif source in recipe_names():
            text = (resources.files("rotarium.configs") / "recipes" / f"{source}.yaml").read_text()
        else:
            raise ValueError(f"--config {source!r} is neither a YAML file nor a recipe; recipes: "
                             f"{', '.join(recipe_names())}")
        data = _yaml(text, f"--config {source}") or {}
        if not isinstance(data, dict):
            raise ValueError(f"--config {source!r} must hold a mapping of sections")
    for key, value in {**flatten(data), **(overrides or {})}.items():
        _apply(config, key, value)
    validate(config)
    return config


# A byte-level BPE holds every byte and the special tokens (``rotarium.data.tokenizer``) whatever size it is asked for.
BPE_BASE_TOKENS = 256 + 3
SEED_LIMIT = 2 ** 32  # numpy's seeds, which accelerate's set_seed sets too, are below it


def _at_least(key: str, value: float, smallest: float, why: str = "") -> None:
    if not value >= smallest:  # a NaN too
        raise ValueError(f"`{key}` must be at least {smallest}{why}, got {value}")


def _in_range(key: str, value: float, low: float, high: float, *, low_open: bool = False, why: str = "") -> None:
    if not (low < value <= high if low_open else low <= value <= high):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ValueError(f"`{key}` must be in {bound}{why}, got {value}")


def validate(config: Config) -> None:
    """Every value is one a run can train with; the first that is not raises a ``ValueError`` naming its key and
    the smallest (or the range of) values that work."""
    from rotarium.configs.presets import PRESETS
    from rotarium.models.configuration import CONFIGS

    m, d, o, t, e = config.model, config.data, config.optim, config.train, config.eval
    if m.preset is not None and m.preset not in PRESETS:
        raise ValueError(f"unknown preset `model.preset={m.preset}`; choose one of {', '.join(sorted(PRESETS))}")
    if m.family not in CONFIGS:
        raise ValueError(f"unknown `model.family={m.family}`; choose one of {', '.join(CONFIGS)}")
    validate_model_options(m)
    positive = {"train.batch_size": t.batch_size, "train.max_steps": t.max_steps,
                "train.gradient_accumulation_steps": t.gradient_accumulation_steps,
                "train.eval_every": t.eval_every, "train.eval_batches": t.eval_batches,
                "train.save_every": t.save_every, "train.log_every": t.log_every,
                "train.keep_checkpoints": t.keep_checkpoints, "train.max_bad_steps": t.max_bad_steps,
                "train.spike_window": t.spike_window, "tokenizer.vocab_size": config.tokenizer.vocab_size,
                "tokenizer.train_documents": config.tokenizer.train_documents,
                "data.max_validation_tokens": d.max_validation_tokens,
                "data.validation_documents": d.validation_documents, "data.shuffle_buffer": d.shuffle_buffer,
                "eval.sample_tokens": e.sample_tokens}
    if m.intermediate_size is not None:  # None derives it from hidden_size; the model config would read 0 so too
        positive["model.intermediate_size"] = m.intermediate_size
    for key, value in positive.items():
        if value < 1:
            raise ValueError(f"`{key}` must be a positive integer (at least 1), got {value}")
    _at_least("data.seq_len", d.seq_len, 2, " (a sequence of one token has nothing to predict)")
    _at_least("data.num_workers", d.num_workers, 0, " (0 reads on the training thread)")
    if t.global_batch_size is not None:
        _at_least("train.global_batch_size", t.global_batch_size, t.batch_size,
                  f" (a multiple of train.batch_size={t.batch_size} x the number of processes)")
    if t.num_threads is not None:
        _at_least("train.num_threads", t.num_threads, 1, " (or null for torch's choice)")
    if not 0 <= t.seed < SEED_LIMIT:
        raise ValueError(f"`train.seed` must be in [0, {SEED_LIMIT - 1}], got {t.seed}")
    if config.tokenizer.name is None and m.init_from is None:
        _at_least("tokenizer.vocab_size", config.tokenizer.vocab_size, BPE_BASE_TOKENS,
                  f" for the trained byte-level BPE ({BPE_BASE_TOKENS - 3} bytes and 3 special tokens)")
    if not 0 < d.validation_fraction < 1:
        raise ValueError(f"`data.validation_fraction` must be in (0, 1), got {d.validation_fraction}")
    if o.schedule not in ("cosine", "wsd", "constant"):
        raise ValueError(f"`optim.schedule` must be cosine, wsd or constant, got {o.schedule!r}")
    if not (o.lr > 0 and math.isfinite(o.lr)):
        raise ValueError(f"`optim.lr` must be a positive number (a learning rate of 0 does not train), got {o.lr}")
    _in_range("optim.min_lr_ratio", o.min_lr_ratio, 0, 1, why=" (a share of optim.lr)")
    _in_range("optim.decay_fraction", o.decay_fraction, 0, 1, why=" (a share of the steps)")
    _at_least("optim.warmup_steps", o.warmup_steps, 0)
    for key, value in (("optim.weight_decay", o.weight_decay), ("optim.grad_clip", o.grad_clip)):
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"`{key}` must be a number >= 0 (0: off), got {value}")
    if not (o.eps > 0 and math.isfinite(o.eps)):
        raise ValueError(f"`optim.eps` must be a positive number, got {o.eps}")
    if len(o.betas) != 2 or not all(_is_number(b) and 0 <= b < 1 for b in o.betas):
        raise ValueError(f"`optim.betas` must be two numbers in [0, 1), got {o.betas}")
    if t.spike_factor != 0 and not t.spike_factor > 1:
        raise ValueError(f"`train.spike_factor` must be above 1 (or 0 to turn the spike check off), got "
                         f"{t.spike_factor}")
    if t.mixed_precision not in ("auto", "no", "bf16", "fp16"):
        raise ValueError(f"`train.mixed_precision` must be auto, no, bf16 or fp16, got {t.mixed_precision!r}")
    if not e.context_lengths or not all(isinstance(L, int) and not isinstance(L, bool) and L >= 2
                                        for L in e.context_lengths):
        raise ValueError(f"`eval.context_lengths` must be a list of integers of at least 2 (a context of one token "
                         f"predicts nothing), got {e.context_lengths}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# Model-config fields that other settings of a run set: an option naming one would conflict with them.
SET_BY_RUN = {"vocab_size": "the tokenizer", "pad_token_id": "the tokenizer", "bos_token_id": "the tokenizer",
              "eos_token_id": "the tokenizer", "max_position_embeddings": "data.seq_len",
              "position_encoding": "model.position_encoding"}


def validate_model_options(m: ModelSection) -> None:
    """Every key of ``model.options`` is a field of the family's config class (``RotariumConfig.field_names``), so
    a mistyped one stops the run instead of being saved into config.json and ignored. The config classes
    themselves keep accepting any keyword, as transformers' do (``from_pretrained`` passes transformers' own)."""
    from rotarium.configs.presets import PRESETS
    from rotarium.models.configuration import CONFIGS

    if m.options and m.init_from is not None:
        raise ValueError(f"`model.options` ({', '.join(m.options)}) cannot be combined with `--init-from "
                         f"{m.init_from}`: the checkpoint's own config is used")
    family = PRESETS[m.preset][0] if m.preset is not None else m.family
    CONFIGS[family].validate_options(m.options, prefix="model.options.", set_elsewhere=SET_BY_RUN)


def parse_overrides(tokens: list[str]) -> dict[str, str]:
    """``["--optim.lr", "1e-3", "--train.seed=3"]`` -> ``{"optim.lr": "1e-3", "train.seed": "3"}``."""
    out: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            raise ValueError(f"unexpected argument {token!r}; overrides look like `--optim.lr 1e-3`")
        key = token[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(tokens):
                raise ValueError(f"override `{token}` needs a value")
            value = tokens[i + 1]
            i += 2
        out[key.replace("-", "_")] = value
    return out

