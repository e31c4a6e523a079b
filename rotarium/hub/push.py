"""``rotarium push``: export a checkpoint and upload it to a Hugging Face Hub model repository.

Everything that can be checked locally is checked before any network call: the repository id, the checkpoint,
the token (``HF_TOKEN`` or the cache written by ``hf auth login``), the export itself. ``dry_run`` stops there
and prints what would be created and uploaded.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import huggingface_hub
from huggingface_hub import HfApi
from huggingface_hub.utils import HFValidationError, validate_repo_id

from rotarium.hub.card import check_card_options
from rotarium.hub.checkpoint import EVAL_DIR, TOKENIZER_FILES, read_checkpoint
from rotarium.hub.export import DEFAULT_SHARD_SIZE, check_shard_size, write_export

# The files of an earlier export that the new one may lack, deleted from the repository in the upload's commit (the
# new export's own files are uploaded, not deleted): a previous model.safetensors beside a sharded export's index is
# what transformers loads (it reads model.safetensors first), and a previous tokenizer or plot would describe another
# model. Each pattern starts with a top-level name, so the owner's other files, in subfolders too, are kept.
REPLACED_FILES = ["model.safetensors", "model.safetensors.index.json", "model-*-of-*.safetensors", "rotarium_*.py",
                  f"{EVAL_DIR}/*", *TOKENIZER_FILES]


@dataclass
class PushPlan:
    """What a push creates and uploads."""

    repo_id: str
    private: bool
    revision: str | None
    files: list[tuple[str, int]] = field(default_factory=list)  # path in the repository, size in bytes
    has_token: bool = False
    url: str | None = None  # the commit's URL once pushed

    def describe(self) -> str:
        total = sum(size for _, size in self.files)
        lines = [f"repository: {self.repo_id} (model, {'private' if self.private else 'public'})",
                 f"revision:   {self.revision or 'main'}",
                 f"token:      {'found' if self.has_token else 'not found (set HF_TOKEN or run `hf auth login`)'}",
                 f"files ({len(self.files)}, {total / 1e6:.1f} MB):"]
        lines += [f"  {name}  ({size:,} bytes)" for name, size in self.files]
        return "\n".join(lines)


def check_repo_id(repo_id: str) -> str:
    """``repo_id`` if it is a valid Hub model repository id, else ``ValueError`` saying what is accepted."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"invalid repository id {repo_id!r}: {error} Use 'namespace/name' "
                         "(for example 'your-name/gla-370m-selective-rope')") from None
    return repo_id


def push_checkpoint(checkpoint: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None,
                    dry_run: bool = False, token: str | None = None, commit_message: str | None = None,
                    license: str = "mit", datasets: list[str] | None = None,
                    max_shard_size: str | int = DEFAULT_SHARD_SIZE, log: Any = print) -> PushPlan:
    """Exports ``checkpoint`` (see :func:`rotarium.hub.export.export_checkpoint`) into a temporary folder and
    uploads it to ``repo_id`` (created if missing; ``revision`` is a branch, created from main if missing).
    ``token`` defaults to ``HF_TOKEN`` or the login cache. Returns the plan (with ``url`` set once pushed)."""
    check_repo_id(repo_id)
    if revision is not None and not revision.strip():
        raise ValueError("`revision` must be a branch name, or None for main")
    check_card_options(license, datasets)
    check_shard_size(max_shard_size)
    info = read_checkpoint(checkpoint)
    token = token or huggingface_hub.get_token()
    if token is None and not dry_run:
        raise ValueError("no Hugging Face token found: set the HF_TOKEN environment variable or run "
                         "`hf auth login` (or use --dry-run to see what would be uploaded)")
    plan = PushPlan(repo_id=repo_id, private=private, revision=revision, has_token=token is not None)
    try:
        workspace = tempfile.TemporaryDirectory(prefix="rotarium-push-")
    except OSError as error:  # no writable temporary folder: known before the export, not after it
        raise ValueError(f"push exports into a temporary folder first, and none could be created ({error}); set "
                         "TMPDIR to a writable folder") from None
    with workspace as tmp:
        folder = Path(tmp)
        files = write_export(info, folder, repo_id=repo_id, license=license, datasets=datasets,
                             max_shard_size=max_shard_size)
        plan.files = [(p.relative_to(folder).as_posix(), p.stat().st_size) for p in files]
        if dry_run:
            log("dry run: nothing is created or uploaded\n" + plan.describe())
            return plan
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
        if revision is not None:
            api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
        commit = api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model", revision=revision,
                                   commit_message=commit_message or f"Upload {info.family} model with rotarium",
                                   delete_patterns=REPLACED_FILES)
        plan.url = getattr(commit, "commit_url", None) or str(commit)
    log(plan.describe() + f"\npushed: {plan.url}")
    return plan
