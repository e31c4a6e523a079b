"""``rotarium export``: a checkpoint folder -> a Hub-ready folder that transformers alone can load.

The folder holds ``config.json`` (with an ``auto_map``), the self-contained model code
(:mod:`rotarium.models.remote_code`), the weights in safetensors (sharded above ``max_shard_size``),
``generation_config.json``, the tokenizer files and evaluation plots found with the checkpoint, and a model card.
A checkpoint whose weights do not match its config (a tensor missing, unexpected or of another shape) is refused:
loading it would initialise the missing tensors at random, and the export would publish that model.
It is written into a temporary sibling folder and renamed into place at the end, so a failed export never leaves
a half-written folder, and an existing one is replaced only with ``overwrite=True``. Where it goes is checked before
any work (:func:`rotarium.hub.paths.check_output_folder`): not a file, writable, and apart from the checkpoint.
"""
from __future__ import annotations

import re
from pathlib import Path

from transformers import PreTrainedModel

from rotarium.hub.card import check_card_options, model_card
from rotarium.hub.checkpoint import EVAL_DIR, Checkpoint, read_checkpoint
from rotarium.hub.paths import check_output_folder
from rotarium.models import FAMILY_MODELS, load_pretrained
from rotarium.models.remote_code import bundle
from rotarium.utils.files import check_apart, copy_file, make_folder, write_folder_atomic, write_text_atomic

DEFAULT_SHARD_SIZE = "5GB"  # the Hub's recommendation: shards small enough to download and resume reliably
# A size as save_pretrained reads one (huggingface_hub's parse_size_to_int): a number and a unit, any case.
SHARD_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*[KMGT]B\s*", re.IGNORECASE)


def check_shard_size(max_shard_size: str | int) -> None:
    """``ValueError`` naming ``--max-shard-size`` unless it is a positive number of bytes or a positive size with a
    unit (``"500MB"``, ``"1.5GB"``): save_pretrained would fail on another only after the weights are loaded, without
    naming the flag, and write one file per tensor for a size of 0 or below."""
    if isinstance(max_shard_size, int) and not isinstance(max_shard_size, bool):
        size = float(max_shard_size)
    else:
        match = SHARD_SIZE.fullmatch(max_shard_size) if isinstance(max_shard_size, str) else None
        size = float(match.group(1)) if match else 0.0
    if size <= 0:
        raise ValueError(f"--max-shard-size {max_shard_size!r} is not a size; pass a positive size with its unit "
                         "(KB, MB, GB or TB), such as '500MB' or '5GB'")


def load_weights(checkpoint: Checkpoint) -> PreTrainedModel:
    """The checkpoint's model, in its stored precision, through the one check of weights against their config
    (:func:`rotarium.models.load_pretrained`): an export must not publish tensors random or dropped."""
    return load_pretrained(str(checkpoint.path), flag="checkpoint", model_class=FAMILY_MODELS[checkpoint.family].lm,
                           dtype="auto")


def write_export(checkpoint: Checkpoint, folder: Path, *, repo_id: str | None = None, license: str = "mit",
                 datasets: list[str] | None = None, max_shard_size: str | int = DEFAULT_SHARD_SIZE) -> list[Path]:
    """Writes the export of ``checkpoint`` into the existing empty ``folder``; returns the files, sorted."""
    bundle()  # raises what would stop the model code from being exported, before any work
    model = load_weights(checkpoint)
    model.save_pretrained(folder, max_shard_size=max_shard_size)  # weights, config + auto_map, code, generation
    for source in checkpoint.tokenizer_files:
        copy_file(source, folder / source.name)
    plots = []
    if checkpoint.eval_plots:
        make_folder(folder / EVAL_DIR, inside=folder)
        for plot in checkpoint.eval_plots:
            copy_file(plot, folder / EVAL_DIR / plot.name)
            plots.append(f"{EVAL_DIR}/{plot.name}")
    card = model_card(checkpoint, repo=repo_id or folder.name, num_parameters=model.num_parameters(),
                      license=license, datasets=datasets, plots=plots)
    write_text_atomic(folder / "README.md", card)
    return sorted(p for p in folder.rglob("*") if p.is_file())


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, repo_id: str | None = None,
                      license: str = "mit", datasets: list[str] | None = None,
                      max_shard_size: str | int = DEFAULT_SHARD_SIZE, overwrite: bool = False) -> Path:
    """Exports ``checkpoint`` to ``out_dir`` (see the module docstring); returns ``out_dir``.

    ``repo_id`` is the repository named in the card's usage snippet (default: the name of ``out_dir``, which the
    snippet loads from the folder that holds it; a card holds no local path); ``license`` and ``datasets`` go into
    the card's metadata (``datasets`` defaults to the one named in the training metadata)."""
    check_card_options(license, datasets)
    check_shard_size(max_shard_size)
    info = read_checkpoint(checkpoint)
    check_apart(out_dir, info.path, "OUT_DIR", "checkpoint")
    out = check_output_folder(out_dir, overwrite=overwrite, what="OUT_DIR")
    write_folder_atomic(out, lambda folder: write_export(info, folder, repo_id=repo_id or out.name, license=license,
                                                         datasets=datasets, max_shard_size=max_shard_size))
    return out
