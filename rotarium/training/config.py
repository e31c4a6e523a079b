"""The training config: nested dataclasses with defaults, read from a recipe name or a YAML file, then overridden
by ``--section.key value`` pairs from the command line. Unknown keys and values of the wrong type raise a
``ValueError`` naming the key, before anything is built."""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml


@dataclass
class ModelSection:
    """``family`` + ``preset`` (a name of ``rotarium.PRESETS``) or explicit sizes; ``options`` are any further
    model-config fields (positional settings, family fields)."""
    family: str = "gla"
    preset: str | None = None
    position_encoding: str = "selective_rope"
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_heads: int = 4
    intermediate_size: int | None = None
    options: dict = field(default_factory=dict)
    init_from: str | None = None
    gradient_checkpointing: bool = False


@dataclass
class DataSection:
    """``source``: ``embedded`` (the standard library's documentation topics), a local .txt/.jsonl/.json/.parquet
    file or folder, or a Hub dataset name (read with streaming when ``streaming``)."""
    source: str = "embedded"
    hub_config: str | None = None
    split: str = "train"
    text_field: str = "text"
    streaming: bool = False
    seq_len: int = 128
    validation_fraction: float = 0.05
    validation_documents: int = 500  # a streaming source holds out its first documents instead
    max_validation_tokens: int = 65536
    shuffle_buffer: int = 10000


@dataclass
class TokenizerSection:
    """``name``: a Hub tokenizer or local folder; ``None`` trains a byte-level BPE of ``vocab_size`` on the data."""
    name: str | None = None
    vocab_size: int = 4096
    train_documents: int = 100000


@dataclass
class OptimSection:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    schedule: str = "cosine"  # cosine | wsd (warmup-stable-decay) | constant
    warmup_steps: int = 30
    decay_fraction: float = 0.2  # wsd only: the last fraction of steps decays linearly
    grad_clip: float = 1.0


@dataclass
class TrainSection:
    batch_size: int = 16  # sequences per process per micro-step
    gradient_accumulation_steps: int = 1
    global_batch_size: int | None = None  # sequences per optimizer step; sets the accumulation from the processes
    max_steps: int = 300
    eval_every: int = 50
    eval_batches: int = 8
    save_every: int = 100
    keep_checkpoints: int = 2  # the newest complete checkpoints kept; older ones are deleted
    log_every: int = 10
    seed: int = 0
    mixed_precision: str = "auto"  # auto (bf16 on GPUs) | no | bf16 | fp16
    max_bad_steps: int = 10
    report_to: list = field(default_factory=list)  # accelerate trackers: tensorboard, wandb
    num_threads: int | None = None


@dataclass
class EvalSection:
    run_after: bool = True
    context_lengths: list = field(default_factory=lambda: [64, 128, 256, 512])
    sample_prompt: str = "The for statement"
    sample_tokens: int = 48


@dataclass
class Config:
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
    if isinstance(tp, str):
        tp = eval(tp, vars(typing) | {"dict": dict, "list": list})  # annotations are strings (PEP 563)
    args = typing.get_args(tp) if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union else (tp,)
    return tuple(typing.get_origin(a) or a for a in args)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    allowed = _allowed(tp)
    if value is None and type(None) in allowed:
        return None
    if isinstance(value, str) and str not in allowed:
        parsed = yaml.safe_load(value)  # a command-line string: "true", "[64, 128]", "0.1"
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
        section.options[".".join(parts[2:])] = yaml.safe_load(value) if isinstance(value, str) else value
        return
    if len(parts) > 2:
        raise ValueError(f"unknown config key `{key}`")
    setattr(section, parts[1], _coerce(key, value, fields[parts[1]].type))


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and prefix == "":
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
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
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError(f"--config {source!r} must hold a mapping of sections")
    for key, value in {**_flatten(data), **(overrides or {})}.items():
        _apply(config, key, value)
    validate(config)
    return config


def validate(config: Config) -> None:
    from rotarium.configs.presets import PRESETS
    from rotarium.models.configuration import CONFIGS

    m, d, o, t = config.model, config.data, config.optim, config.train
    if m.preset is not None and m.preset not in PRESETS:
        raise ValueError(f"unknown preset `model.preset={m.preset}`; choose one of {', '.join(sorted(PRESETS))}")
    if m.family not in CONFIGS:
        raise ValueError(f"unknown `model.family={m.family}`; choose one of {', '.join(CONFIGS)}")
    for key, value in (("data.seq_len", d.seq_len), ("train.batch_size", t.batch_size),
                       ("train.max_steps", t.max_steps), ("train.gradient_accumulation_steps",
                                                          t.gradient_accumulation_steps),
                       ("train.eval_every", t.eval_every), ("train.save_every", t.save_every),
                       ("train.log_every", t.log_every),
                       ("train.keep_checkpoints", t.keep_checkpoints), ("train.max_bad_steps", t.max_bad_steps), ("tokenizer.vocab_size", config.tokenizer.vocab_size)):
        if value < 1:
            raise ValueError(f"`{key}` must be a positive integer, got {value}")
    if not 0 < d.validation_fraction < 1:
        raise ValueError(f"`data.validation_fraction` must be in (0, 1), got {d.validation_fraction}")
    if o.schedule not in ("cosine", "wsd", "constant"):
        raise ValueError(f"`optim.schedule` must be cosine, wsd or constant, got {o.schedule!r}")
    if len(o.betas) != 2:
        raise ValueError(f"`optim.betas` must be two numbers, got {o.betas}")
    if t.mixed_precision not in ("auto", "no", "bf16", "fp16"):
        raise ValueError(f"`train.mixed_precision` must be auto, no, bf16 or fp16, got {t.mixed_precision!r}")


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
