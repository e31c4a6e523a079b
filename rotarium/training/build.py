"""What a run is made of, built from its config: the tokenizer, the data (training batches and validation), and
the model."""
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rotarium.data.batches import BatchSchedule, PackedSequences, pack_all, validation_batches
from rotarium.data.config import DataSection, LoaderSettings
from rotarium.data.documents import StreamShards, iter_documents, split_documents
from rotarium.data.loader import MemoryLoader, PreparedLoader, PreparedSequences, TrainLoader
from rotarium.data.prepared_reader import PreparedCorpus, is_prepared, tokenizer_fingerprint
from rotarium.data.stream import StreamLoader, plan_stream, stream_layout
from rotarium.data.tokenizer import load_tokenizer, train_bpe
from rotarium.training.config import Config
from rotarium.training.run_folder import TOKENIZER
from rotarium.utils.files import write_folder_atomic

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedTokenizerBase


def build_model(config: Config, tokenizer: PreTrainedTokenizerBase) -> torch.nn.Module:
    """A fresh model from ``config.model`` (preset or explicit sizes), or the ``init_from`` checkpoint; its blocks
    compiled with ``train.compile`` (:func:`compile_blocks`)."""
    if not config.train.compile:
        return _model(config, tokenizer)
    check_compile_supported()
    model = _model(config, tokenizer)
    count = compile_blocks(model)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"train.compile: each of the {count} blocks is compiled (torch.compile, dynamic shapes); the first "
              "steps, and the first validation, are slow while they compile")
    return model


def check_compile_supported() -> None:
    """Raises ``ValueError`` naming ``train.compile`` where ``torch.compile`` cannot run: a Python that dynamo does not
    support, or a CPU run without the C++ compiler that the inductor backend builds its code with."""
    import sys

    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise ValueError(f"`train.compile` needs torch.compile, which PyTorch {torch.__version__} does not support on "
                         f"Python {sys.version.split()[0]}; leave train.compile off")
    from rotarium.training.accelerator import has_accelerator

    if has_accelerator():
        return
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as error:  # inductor's own error type has moved between releases
        raise ValueError("`train.compile` on CPU needs a C++ compiler (torch.compile's inductor backend builds C++): "
                         f"{error}; install g++ or clang++ (or point $CXX at one), or leave train.compile off"
                         ) from error


def compile_blocks(model: torch.nn.Module, backend: str | Callable = "inductor") -> int:
    """Compiles each block of ``model`` in place, as torchtitan compiles each transformer block, and returns how many.

    The blocks share one compiled graph (it takes each block's weights as inputs), with dynamic shapes: batches of
    another length or another number of packed documents run the same compiled code. The compiler fuses the norms,
    projections' epilogues, gates, rotations and convolutions around the token mixers' kernels, which enter the graph
    as single operators (:mod:`rotarium.ops.opaque`). The weights' names do not change (``Module.compile`` compiles
    in place), so checkpoints load into compiled and plain models alike. ``backend``: torch.compile's (the tests
    trace with lighter ones). Raises ``ValueError`` for a RoPE scaling whose frequencies follow the length."""
    from rotarium.layers import Block
    from rotarium.layers.positional import LENGTH_DEPENDENT_SCALINGS, rope_type_of

    rope_type = rope_type_of(getattr(model.config, "rope_parameters", None))
    if rope_type in LENGTH_DEPENDENT_SCALINGS:
        raise ValueError(f"`train.compile` cannot compile the RoPE scaling {rope_type!r} (rope_parameters.rope_type): "
                         "its frequencies follow each batch's last position, read from the tensor, which would split "
                         "every block's graph and compile it again for each new length; train without "
                         "train.compile, or with a scaling of fixed frequencies (linear, yarn, llama3)")
    blocks = [module for module in model.modules() if isinstance(module, Block)]
    for block in blocks:
        block.compile(backend=backend, dynamic=True)
    return len(blocks)


def compile_failures() -> str:
    """What dynamo could not trace since its counters were last cleared, or "": graph breaks, and frames it gave up
    on (a block that then runs eagerly with its pieces compiled one by one, which its graph-break count does not
    show)."""
    counters = torch._dynamo.utils.counters
    breaks, given_up = sum(counters["graph_break"].values()), counters["frames"]["total"] - counters["frames"]["ok"]
    if not breaks and not given_up:
        return ""
    reasons = [reason.splitlines()[0] for reason in (*counters["graph_break"], *counters["unimplemented"])]
    return f"{breaks} graph break(s), {given_up} frame(s) given up: {'; '.join(reasons)[:300]}"


def _model(config: Config, tokenizer: PreTrainedTokenizerBase) -> torch.nn.Module:
    import rotarium  # noqa: F401  (registers the Auto classes)
    from rotarium.configs.presets import preset_config
    from rotarium.models.configuration import CONFIGS
    from rotarium.models.loading import load_pretrained
    from rotarium.models.modeling import FAMILY_MODELS

    m = config.model
    if m.init_from is not None:
        model = load_pretrained(m.init_from, flag="--init-from")
        if len(tokenizer) > model.config.vocab_size:
            raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but `--init-from {m.init_from}` has a "
                             f"vocabulary of {model.config.vocab_size}; use the checkpoint's own tokenizer")
        return model
    special = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
               "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "max_position_embeddings": config.data.seq_len, "position_encoding": m.position_encoding}
    if m.preset is not None:
        model_config = preset_config(m.preset, **special, **m.options)
    else:
        sizes = {"hidden_size": m.hidden_size, "num_hidden_layers": m.num_hidden_layers, "num_heads": m.num_heads}
        if m.intermediate_size is not None:
            sizes["intermediate_size"] = m.intermediate_size
        try:
            model_config = CONFIGS[m.family](**sizes, **special, **m.options)
        except TypeError as error:
            raise ValueError(f"`model.options`: {error}") from error
    return FAMILY_MODELS[model_config.family].lm(model_config)


def _prepares(arguments: str, source: str) -> bool:
    """Whether ``rotarium prepare ARGUMENTS`` (SOURCE OUT [options]) writes the folder ``source``: a config whose
    ``data.source`` was changed keeps a ``data.prepare`` that describes another folder."""
    import shlex

    parts = shlex.split(arguments)
    return len(parts) >= 2 and Path(parts[1]) == Path(source)


def check_prepared_source_exists(config: Config) -> None:
    """Raises ``ValueError`` naming the command when ``data.source`` is missing and is the folder ``data.prepare``
    writes: the first thing a recipe needs, so checked before anything else a run needs."""
    d = config.data
    if d.prepare is not None and not Path(d.source).exists() and _prepares(d.prepare, d.source):
        raise ValueError(f"`data.source={d.source}` is not there: it is the folder `rotarium prepare {d.prepare}` "
                         "writes (`data.prepare`); run that once (README, docs/data.md), or point data.source at the "
                         "folder it wrote")


def open_prepared(config: Config) -> PreparedCorpus | None:
    """The prepared folder ``data.source`` names (recognised by its ``metadata.json``), checked on opening, or None
    for another source. Raises ``ValueError`` for a missing folder that ``data.prepare`` writes (naming the
    command), an unfinished or damaged folder, ``data.streaming`` with one, and
    a ``tokenizer.name`` or ``--init-from`` whose tokenizer is not the folder's: the ids in the folder are that
    tokenizer's, so a run from it takes the folder's tokenizer (the BPE settings are then unused)."""
    d = config.data
    check_prepared_source_exists(config)
    if not is_prepared(d.source):
        return None
    if d.streaming:
        raise ValueError(f"`data.source={d.source}` is a prepared folder, which is read through memory maps, not "
                         "streamed; drop `data.streaming`")
    corpus = PreparedCorpus(d.source)
    check_split_settings(d, corpus)
    recorded = corpus.metadata["settings"].get("tokenizer")
    for key, name in (("tokenizer.name", config.tokenizer.name), ("--init-from", config.model.init_from)):
        if name is None or name == recorded or (Path(name).exists() and str(Path(name).absolute()) == recorded):
            continue
        if tokenizer_fingerprint(load_tokenizer(name)) != corpus.tokenizer_sha256:
            made_with = f"--tokenizer {recorded}" if recorded else "a BPE trained by `rotarium prepare`"
            fix = ("leave tokenizer.name unset (the run takes the folder's tokenizer)" if key == "tokenizer.name" else
                   f"prepare the corpus again with --tokenizer {name}")
            raise ValueError(f"`{key} {name}` is not the tokenizer the prepared folder {d.source} was made with "
                             f"({made_with}); {fix}")
    return corpus


def check_split_settings(d: DataSection, corpus: PreparedCorpus) -> None:
    """A prepared folder holds its own validation split, decided when it was prepared: a ``data.validation_fraction``
    other than the default and the folder's own would be ignored, so it is refused, naming the field."""
    settings = corpus.metadata["settings"]
    if d.validation_fraction in (DataSection.validation_fraction, settings.get("validation_fraction")):
        return
    made = (f"--validation-fraction {settings['validation_fraction']}" if settings.get("validation_fraction")
            is not None else f"--validation-documents {settings.get('validation_documents')}")
    raise ValueError(f"`data.validation_fraction={d.validation_fraction}` does not apply to the prepared folder "
                     f"{d.source}: its validation split was set when it was prepared ({made}); drop "
                     f"data.validation_fraction, or prepare the source again with --validation-fraction "
                     f"{d.validation_fraction}")


def prepare_tokenizer(config: Config, run_dir: Path, documents: list[str] | None, accelerator: Accelerator, *,
                      reuse: bool = False, prepared: PreparedCorpus | None = None) -> PreTrainedTokenizerBase:
    """The run's tokenizer: with ``reuse`` (a run continuing a checkpoint) the one saved in the run folder, else a
    ``prepared`` folder's (:func:`open_prepared`), else ``tokenizer.name``, else the ``init_from`` checkpoint's,
    else a BPE trained on the training documents by the main process. Without ``reuse`` a tokenizer in the folder
    is replaced: it may stem from another vocabulary size or other data."""
    saved = run_dir / TOKENIZER
    found = (saved / "tokenizer_config.json").is_file()
    # Only the main process looks and writes; the others wait at the barrier whatever it finds.
    if accelerator.is_main_process and not (reuse and found):
        name, flag = config.tokenizer.name, "tokenizer.name"
        if name is None and config.model.init_from is not None:
            name, flag = config.model.init_from, "--init-from"
        if prepared is not None:
            tokenizer = prepared.load_tokenizer()
        elif name is not None:
            tokenizer = load_tokenizer(name, flag)
            check_init_from_tokenizer(config, tokenizer)
        else:
            if documents is None:
                documents = list(itertools.islice(iter_documents(config.data, skip=config.data.validation_documents),
                                                  config.tokenizer.train_documents))
            tokenizer = train_bpe(documents[:config.tokenizer.train_documents], config.tokenizer.vocab_size)
        write_folder_atomic(saved, tokenizer.save_pretrained)
    accelerator.wait_for_everyone()
    return load_tokenizer(str(saved))


def check_init_from_tokenizer(config: Config, tokenizer: PreTrainedTokenizerBase) -> None:
    """Raises ``ValueError`` when ``tokenizer`` (``tokenizer.name``'s) is not the tokenizer of the ``model.init_from``
    checkpoint (by :func:`tokenizer_fingerprint`): the checkpoint's embeddings are rows of its own tokenizer's ids,
    which another tokenizer gives to other text, so training on them would fine-tune every row on the wrong token.
    A checkpoint without a tokenizer that loads takes ``tokenizer.name``'s."""
    init_from, name = config.model.init_from, config.tokenizer.name
    if init_from is None or name is None or name == init_from:
        return
    try:
        own = load_tokenizer(init_from, "--init-from")
    except ValueError:
        return
    if tokenizer_fingerprint(own) != tokenizer_fingerprint(tokenizer):
        raise ValueError(f"`tokenizer.name={name}` is not the tokenizer of `--init-from {init_from}`: the "
                         "checkpoint's embeddings belong to its own tokenizer's ids, which this one gives to other "
                         "text; leave tokenizer.name unset (the run takes the checkpoint's tokenizer)")


# The model section's settings that a fresh model is built from, and that an ``init_from`` checkpoint's config holds.
ARCHITECTURE_KEYS = ("family", "position_encoding", "hidden_size", "num_hidden_layers", "num_heads",
                     "intermediate_size")


def check_init_from_model(config: Config, model: torch.nn.Module) -> None:
    """Raises ``ValueError`` when ``model.init_from`` is combined with a model setting of another value than the
    checkpoint's (``model.preset``, or a key of :data:`ARCHITECTURE_KEYS` given other than its default): the
    checkpoint's config is the model, so the setting would be ignored while ``training_args.json`` records it as
    what was trained. Every differing key is named with both values."""
    from rotarium.configs.presets import PRESETS
    from rotarium.training.config import ModelSection

    m, defaults, loaded = config.model, ModelSection(), model.config
    if m.init_from is None:
        return
    differing = []
    if m.preset is not None:
        family, values = PRESETS[m.preset]
        shape = {"family": family, **{key: values[key] for key in ARCHITECTURE_KEYS if key in values}}
        if any(getattr(loaded, key, None) != value for key, value in shape.items()):
            ours = ", ".join(f"{key} {getattr(loaded, key, None)!r}" for key in shape)
            differing.append(f"model.preset {m.preset!r} (the checkpoint's: {ours})")
    for key in ARCHITECTURE_KEYS:
        value = getattr(m, key)
        if value not in (None, getattr(defaults, key)) and getattr(loaded, key, None) != value:
            differing.append(f"model.{key} {value!r} (the checkpoint's: {getattr(loaded, key, None)!r})")
    if differing:
        raise ValueError(f"--init-from {m.init_from}: its config is the model, so {'; '.join(differing)} would be "
                         "ignored; drop these settings to fine-tune it as it is, or train a new model of that shape "
                         "without --init-from")


@dataclass
class DataSource:
    """The training data's source, opened once: the ``prepared`` folder ``data.source`` names
    (:func:`open_prepared`), or its ``stream`` with ``data.streaming`` (read by shards, :class:`StreamShards`,
    resharded for the run's processes where that helps) and the stream's ``layout``
    (:func:`~rotarium.data.stream.stream_layout`), or neither for a source read whole."""
    prepared: PreparedCorpus | None = None
    stream: StreamShards | None = None
    layout: dict[str, Any] | None = None


def open_data_source(config: Config, world: int) -> DataSource:
    """The :class:`DataSource` of ``config`` for a run of ``world`` processes."""
    prepared = open_prepared(config)
    if prepared is not None or not config.data.streaming:
        return DataSource(prepared)
    stream = StreamShards(config.data, reshard_for=world)
    return DataSource(stream=stream, layout=stream_layout(len(stream), world))


@dataclass
class RunData:
    """This process's data: its training batches (a :class:`~rotarium.data.loader.TrainLoader`), its validation
    batches, and what the run holds out (the documents, or the ``prepared`` folder whose validation split it is)."""
    train: TrainLoader
    validation: list[dict[str, torch.Tensor]]
    validation_documents: list[str] | None
    prepared: PreparedCorpus | None = None

    @property
    def schedule(self) -> BatchSchedule | None:
        """The schedule the batches come from; None for a stream."""
        return self.train.schedule

    @property
    def held_out(self) -> list[str] | PreparedCorpus:
        """What evaluation scores: the held-out documents, or the prepared folder (its validation split)."""
        return self.prepared if self.prepared is not None else self.validation_documents

    def close(self) -> None:
        """Stops the loader's worker processes."""
        self.train.close()


def accumulation_steps(config: Config, world: int) -> int:
    """Micro-steps per optimizer step: ``train.global_batch_size / (batch_size * processes)`` when the global batch
    is given (recipes, so one file serves any number of GPUs), else ``train.gradient_accumulation_steps``."""
    t = config.train
    if t.global_batch_size is None:
        return t.gradient_accumulation_steps
    per_step = t.batch_size * world
    if t.global_batch_size % per_step:
        raise ValueError(f"`train.global_batch_size={t.global_batch_size}` is not a multiple of train.batch_size x "
                         f"processes = {t.batch_size} x {world}; change one of them")
    return t.global_batch_size // per_step


def loader_settings(config: Config, world: int, rank: int = 0, *, pin_memory: bool = False,
                    order_cache: Path | None = None) -> LoaderSettings:
    """The settings every training loader is built from (:class:`~rotarium.data.config.LoaderSettings`), for
    process ``rank`` of ``world``."""
    t = config.train
    return LoaderSettings(config.data, t.batch_size, accumulation_steps(config, world), t.seed, world, rank,
                          pin_memory, order_cache)


def prepare_data(config: Config, tokenizer: PreTrainedTokenizerBase, source: DataSource, settings: LoaderSettings,
                 documents: list[str] | None = None) -> RunData:
    """This process's training loader, built from ``settings`` and at step 0 (a resume restores it,
    :meth:`~rotarium.data.loader.TrainLoader.restore`), and its share of the validation batches, from ``source``
    (:func:`open_data_source`): a prepared folder's :class:`~rotarium.data.loader.PreparedLoader`, a stream's
    :class:`~rotarium.data.stream.StreamLoader`, or a :class:`~rotarium.data.loader.MemoryLoader` of the corpus
    (``documents``: the whole corpus when it is already read)."""
    d, t, world, rank = config.data, config.train, settings.world, settings.rank
    max_val_rows = max(1, d.max_validation_tokens // d.seq_len)
    held_out: list[str] | None = None
    train: TrainLoader
    if source.prepared is not None:
        prepared = source.prepared
        train = PreparedLoader(prepared, settings)
        val = PreparedSequences(prepared.validation, d.seq_len).packed(max_val_rows)
        for name, part, split in (("training", train.schedule.data, prepared.train),
                                  ("validation", val, prepared.validation)):
            if not len(part):
                raise ValueError(f"the {name} split of the prepared folder {d.source} holds {split.num_tokens} "
                                 f"tokens, too few for one sequence of `data.seq_len={d.seq_len}`; use a smaller "
                                 "seq_len or prepare more text")
    elif source.stream is not None:
        stream = source.stream
        held_out, held = stream.held_out(d.validation_documents)
        val = pack_all(tokenizer, held_out, d.seq_len, "validation")
        plan = plan_stream(len(stream), world, rank, held)
        if rank == 0 and not plan.own_shards:
            logger.warning("`data.source=%s` has %d shard(s), not a multiple of the %d processes: every process reads "
                           "the whole stream and keeps one row in %d (tokenising only those); a stream of a multiple "
                           "of %d files lets each process read only its own shards", d.source, len(stream), world,
                           world, world)
        train = StreamLoader(stream, plan, tokenizer, settings, layout=source.layout, held_out=held_out)
    else:
        documents = documents if documents is not None else list(iter_documents(d))
        train_docs, held_out = split_documents(documents, d.validation_fraction, t.seed)
        val = pack_all(tokenizer, held_out, d.seq_len, "validation")
        train = MemoryLoader(pack_all(tokenizer, train_docs, d.seq_len, "training"), settings, held_out)
    val = PackedSequences(val.tokens[:max_val_rows], val.starts[:max_val_rows])
    # `train.eval_batches` batches of the global batch's size in all, dealt out among the processes: the rows scored
    # depend on the global batch only, so a run resumed with another number of processes keeps its validation loss
    per_process = t.eval_batches * settings.accum
    return RunData(train, validation_batches(val, t.batch_size, per_process, world, rank), held_out, source.prepared)
