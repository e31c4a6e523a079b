"""``rotarium train``: pretraining or fine-tuning from a recipe / YAML file plus ``--section.key value`` overrides."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rotarium.training.trainer import Trainer

USAGE_NOTES = """\
With no arguments: the embedded default, a small Selective RoPE GLA trained on the standard library's
documentation topics (no download), a few minutes on a CPU. Several processes: accelerate launch
--num_processes N -m rotarium train ...; FSDP: --config_file from rotarium/configs/accelerate/.
"""
WIDTH = 118


def _show(value: Any) -> str:
    """A default as it is typed on the command line (values are read as YAML)."""
    if isinstance(value, str):
        return json.dumps(value) if " " in value else value
    return json.dumps(value)


def config_help() -> str:
    """Every config key with its type, default and description, read from the config dataclasses."""
    from rotarium.training.config import Config, field_types

    sections = []
    for section in dataclasses.fields(Config):
        cls = section.default_factory
        entries = []
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            kind = " | ".join("None" if t is type(None) else t.__name__ for t in field_types(cls)[f.name])
            entries.append((f"{f.name} = {_show(default)} ({kind})", f.metadata.get("help", "")))
        sections.append((section.name, entries))
    column = min(42, max(len(name) for _, entries in sections for name, _ in entries))
    indent = " " * (4 + column + 2)
    lines = ["config keys (override any with --section.key VALUE, read as YAML: 1e-3, true, [64, 128], null;",
             "e.g. --optim.lr 1e-3 --model.position_encoding rope):"]
    for section, entries in sections:
        lines.append(f"  {section}:")
        for name, text in entries:
            wrapped = textwrap.wrap(text, WIDTH - len(indent)) or [""]
            if len(name) > column:
                lines.append(f"    {name}")
            else:
                lines.append(f"    {name.ljust(column)}  {wrapped.pop(0)}")
            lines += [indent + part for part in wrapped]
    return "\n".join(lines) + "\n\n" + USAGE_NOTES


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    from rotarium.training.config import recipe_names

    train = subparsers.add_parser(
        "train", help="pretrain or fine-tune a model (the embedded default with no arguments)",
        description="Train a model with accelerate from a recipe or YAML config.",
        epilog=config_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--config", default=None,
                       help=f"a recipe name ({', '.join(recipe_names())}) or a YAML file; default: the embedded "
                            "default run")
    train.add_argument("--output-dir", default=None, help="run folder (default runs/<config name> or runs/default)")
    train.add_argument("--max-steps", type=int, default=None, help="optimizer steps (= train.max_steps)")
    train.add_argument("--save-every", type=int, default=None, help="checkpoint interval (= train.save_every)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the run folder's newest good checkpoint that passes its checksums (from "
                            "step 0 if none), with the run's own config (from its training_args.json unless "
                            "--config is given); other settings are checked, see --allow-config-change")
    train.add_argument("--resume-from", default=None, metavar="step-N",
                       help="resume from this checkpoint of the run instead (implies --resume)")
    train.add_argument("--allow-config-change", action="append", default=[], metavar="KEY",
                       help="with --resume: let this data, optim or train key differ from the run's (repeatable); "
                            "intervals, max_steps and eval settings may change without it, model and tokenizer "
                            "settings never")
    train.add_argument("--allow-data-change", action="store_true",
                       help="with --resume: go on although the data source changed since the checkpoint (files "
                            "added, removed or edited, a prepared folder made again); without it such a resume is "
                            "refused, naming what changed, since the held-out documents derived from the changed "
                            "source may be documents the run trained on. The run records the step, and `rotarium "
                            "eval` warns of it")
    train.add_argument("--allow-rewind", action="store_true",
                       help="with --resume: let the run go back before the last step it reached (a --max-steps "
                            "below it, or a finished run resumed from an older checkpoint); its final/, the "
                            "checkpoints after the one resumed from and its metrics are kept in "
                            "--output-dir/rewound-from-step-N/. Without it such a resume is refused; --init-from a "
                            "checkpoint starts a new run from older weights instead")
    train.add_argument("--overwrite", action="store_true",
                       help="replace the run in --output-dir: it is kept in --output-dir/previous/ until the new run "
                            "has written its first checkpoint, and put back if the new run fails before that")
    train.add_argument("--init-from", default=None,
                       help="fine-tune this checkpoint folder or Hub id (= model.init_from); its tokenizer is used")
    train.set_defaults(func=run_train, accepts_overrides=True)


def run_train(args: argparse.Namespace) -> int:
    from rotarium.training.config import load_config, parse_overrides
    from rotarium.training.resume import run_config
    from rotarium.training.run_folder import LOSS_CURVE, METRICS
    from rotarium.training.trainer import Trainer, TrainingDiverged
    from rotarium.utils.files import check_writable_folder

    overrides = parse_overrides(args.overrides)
    for key, value in (("train.max_steps", args.max_steps), ("train.save_every", args.save_every),
                       ("model.init_from", args.init_from)):
        if value is not None:
            overrides[key] = value
    name = Path(args.config).stem if args.config else "default"
    run_dir = Path(args.output_dir or Path("runs") / name)
    resume = args.resume or args.resume_from is not None
    if resume and args.config is None:
        overrides = {**run_config(run_dir), **overrides}  # the run's own settings, then the changes asked for
    config = load_config(args.config, overrides)
    check_writable_folder(run_dir, "--output-dir")
    trainer = Trainer(config, run_dir, resume=resume, overwrite=args.overwrite, resume_from=args.resume_from,
                      allow_config_change=args.allow_config_change, allow_rewind=args.allow_rewind,
                      allow_data_change=args.allow_data_change)
    try:  # the run folder stays locked until the evaluation below has written into it too
        try:
            result = trainer.train()
        except TrainingDiverged as error:
            print(f"rotarium train: {error}")
            return 1
        if not trainer.accelerator.is_main_process:
            return 0
        if result.first_val_loss is not None and result.last_val_loss is not None:
            drop = 1 - result.last_val_loss / result.first_val_loss
            change = f"{drop:.0%} lower" if drop >= 0 else f"{-drop:.0%} higher"
            print(f"validation loss {result.first_val_loss:.3f} -> {result.last_val_loss:.3f} ({change}; "
                  f"perplexity {math.exp(result.last_val_loss):.1f}) after {result.steps} steps"
                  + (f", {result.skipped_steps} skipped" if result.skipped_steps else ""))
        if config.eval.run_after:
            evaluate_and_sample(trainer, result.final_dir)
        print(f"final model: {result.final_dir} (AutoModelForCausalLM.from_pretrained after `import rotarium`); "
              f"metrics: {run_dir / METRICS}; loss curve: {run_dir / LOSS_CURVE}")
        return 0
    finally:
        trainer.close()


def evaluate_and_sample(trainer: Trainer, final_dir: Path) -> None:
    """Perplexity against context length on the held-out documents (``rotarium eval``'s perplexity task, at
    ``eval.context_lengths``), and one sample, with the final weights."""
    from rotarium.evaluation.generate import generate_text
    from rotarium.evaluation.perplexity import PerplexityTexts
    from rotarium.evaluation.registry import EVAL_TASKS
    from rotarium.evaluation.tasks import EvalRun
    from rotarium.training.run_folder import EVAL

    config = trainer.config
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    model.config.use_cache = True
    task = EVAL_TASKS["perplexity"]
    run = EvalRun.of(str(final_dir), final_dir / EVAL, context_lengths=config.eval.context_lengths,
                     batch_size=config.train.batch_size, label=trainer.run_dir.name, train_length=config.data.seq_len)
    texts = PerplexityTexts(trainer.data.held_out, "the held-out documents", config.data.max_validation_tokens,
                            measure="validation perplexity")
    record = task.evaluate(texts, model, trainer.tokenizer, run)
    print(task.summary(record, run))
    task.save(record, run)
    sample = generate_text(model, trainer.tokenizer, config.eval.sample_prompt,
                           max_new_tokens=config.eval.sample_tokens, seed=config.train.seed)[0]
    print(f"sample: {sample!r}")
