"""``rotarium export`` and ``rotarium push``."""
from __future__ import annotations

import argparse

from rotarium.hub.export import DEFAULT_SHARD_SIZE


def _card_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--license", default="mit", help="license in the model card's metadata (default: mit)")
    parser.add_argument("--dataset", action="append", dest="datasets", metavar="DATASET_ID",
                        help="Hub dataset id the model was trained on (repeatable; default: the one named in "
                             "training_args.json)")
    parser.add_argument("--max-shard-size", default=DEFAULT_SHARD_SIZE,
                        help=f"largest safetensors shard, e.g. 500MB (default: {DEFAULT_SHARD_SIZE})")


def run_export(args: argparse.Namespace) -> int:
    from rotarium.hub.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out_dir, repo_id=args.repo_id, license=args.license,
                            datasets=args.datasets, max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    print(f"exported {args.checkpoint} -> {out}")
    return 0


def run_push(args: argparse.Namespace) -> int:
    from rotarium.hub.push import push_checkpoint

    push_checkpoint(args.checkpoint, args.repo_id, private=args.private, revision=args.revision,
                    dry_run=args.dry_run, commit_message=args.commit_message, license=args.license,
                    datasets=args.datasets, max_shard_size=args.max_shard_size)
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser(
        "export", help="write a Hub-ready folder (code, safetensors, model card) from a checkpoint",
        description="Write a folder that loads with transformers alone (trust_remote_code=True): config.json with "
                    "auto_map, the model code, safetensors weights, tokenizer, generation config, model card.")
    export.add_argument("checkpoint", help="folder written by save_pretrained (config.json + weights)")
    export.add_argument("out_dir", help="folder to write (must not exist or be empty, unless --overwrite)")
    export.add_argument("--repo-id", help="repository named in the card's usage snippet (default: OUT_DIR's name)")
    export.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    _card_options(export)
    export.set_defaults(func=run_export)

    push = subparsers.add_parser(
        "push", help="export a checkpoint and upload it to the Hugging Face Hub",
        description="Export CHECKPOINT and upload it to the model repository REPO_ID (created if missing). The "
                    "token comes from HF_TOKEN or `hf auth login`.")
    push.add_argument("checkpoint", help="folder written by save_pretrained (config.json + weights)")
    push.add_argument("repo_id", help="Hub repository, 'namespace/name'")
    push.add_argument("--private", action="store_true", help="create the repository as private")
    push.add_argument("--revision", help="branch to push to (created if missing; default: main)")
    push.add_argument("--commit-message", help="commit message (default: 'Upload <family> model with rotarium')")
    push.add_argument("--dry-run", action="store_true",
                      help="print the repository settings and the files, without any network call")
    _card_options(push)
    push.set_defaults(func=run_push)
