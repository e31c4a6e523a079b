"""``rotarium eval`` (the evaluations of :data:`rotarium.evaluation.registry.EVAL_TASKS`: perplexity against context
length, RULER, lm-eval's tasks) and ``rotarium generate``."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from rotarium.utils.argtypes import int_list
from rotarium.utils.devices import check_device
from rotarium.utils.files import check_writable_folder, refuse_link

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DTYPES = ("auto", "float32", "bfloat16", "float16")


def load_for(args: argparse.Namespace, rope_parameters: dict | None = None
             ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` on ``--device`` in ``--dtype``: "auto" is bfloat16 on CUDA, where fla's kernels
    (the delta rule's, in particular, which refuse float32) serve it, and float32 elsewhere. ``rope_parameters``:
    ``--rope-scaling`` as :func:`check_rope_scaling` returns it, applied at load."""
    import torch

    from rotarium.evaluation.generate import load_checkpoint

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")  # checked where the command starts
    name = args.dtype if args.dtype != "auto" else ("bfloat16" if torch.device(device).type == "cuda" else "float32")
    overrides = {"rope_parameters": rope_parameters} if rope_parameters is not None else {}
    return load_checkpoint(args.model, device=device, dtype=getattr(torch, name), **overrides)


def check_rope_scaling(model: str, text: str) -> dict:
    """``--rope-scaling``'s JSON as ``rope_parameters``, checked against the checkpoint's config before its weights
    load; its original length defaults to the checkpoint's ``max_position_embeddings``, the training length."""
    from transformers import AutoConfig

    import rotarium  # noqa: F401  (registers the Auto classes)
    from rotarium.models import RotariumConfig

    try:
        scaling = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--rope-scaling must be a JSON object such as '{{\"rope_type\": \"yarn\", \"factor\": 4}}'"
                         f", got {text!r} ({error.msg})") from None
    if not isinstance(scaling, dict) or "rope_type" not in scaling and "type" not in scaling:
        raise ValueError("--rope-scaling must be a JSON object with a rope_type, such as "
                         f"'{{\"rope_type\": \"yarn\", \"factor\": 4}}', got {text!r}")
    config = AutoConfig.from_pretrained(model)
    if not isinstance(config, RotariumConfig):
        raise ValueError(  # noqa: TRY004  (a bad flag value: the command reports ValueErrors)
            f"--rope-scaling applies to rotarium checkpoints; --model {model} is a {config.model_type}")
    config.rope_parameters = scaling
    try:
        # the settings' checks and the layers' own (a missing key of the scaling), on the meta device
        config.validate_fields()
    except ValueError as error:
        raise ValueError(f"--rope-scaling: {error}") from None
    return scaling


def check_flags(args: argparse.Namespace) -> None:
    """Raises ``ValueError`` naming the flag when one is given that the evaluations asked for would ignore: each
    evaluation's own flags (:attr:`EvalTask.flags`) apply where it runs only."""
    from rotarium.evaluation.registry import EVAL_TASKS, asked_for, selectable
    from rotarium.evaluation.tasks import listing

    running = asked_for(args)
    for task in EVAL_TASKS.values():
        for flag in task.flags:
            if task in running or not flag.given(args):
                continue
            if task.selector is None:
                replacing = listing([other.label for other in selectable()])
                raise ValueError(f"{flag.name} applies to {task.label} only, which {replacing} replace (they bring "
                                 f"their own texts); leave {flag.name} out")
            raise ValueError(f"{flag.name} applies to {task.label} only, which this command does not run; add "
                             f"{task.label} {task.selector.options.get('metavar', 'TASKS')} or leave {flag.name} out")


def run_eval(args: argparse.Namespace) -> int:
    """Every evaluation asked for (:func:`rotarium.evaluation.registry.asked_for`) is prepared, its settings and
    where its results go checked, before the model loads, once, through :func:`load_for`; then each runs on it,
    prints its table and writes its files."""
    from rotarium.evaluation.generate import check_model_path
    from rotarium.evaluation.registry import asked_for
    from rotarium.evaluation.tasks import EvalRun

    check_flags(args)
    check_model_path(args.model)
    local = Path(args.model).exists()
    output = Path(args.output_dir) if args.output_dir else (Path(args.model) / "eval" if local else Path("eval"))
    what = "--output-dir" if args.output_dir else "the evaluation folder (--output-dir)"
    check_writable_folder(output, what)
    refuse_link(output, what)
    if args.device:
        check_device(args.device)
    scaling = check_rope_scaling(args.model, args.rope_scaling) if args.rope_scaling is not None else None
    run = EvalRun(args, output, what, scaling)
    prepared = [(task, task.prepare(run)) for task in asked_for(args)]
    model, tokenizer = load_for(args, scaling)
    for task, plan in prepared:
        record = task.evaluate(plan, model, tokenizer, run)
        print(task.summary(record, run))
        print(task.wrote(task.save(record, run)))
    return 0


SAMPLING_FLAGS = {"--temperature": "temperature", "--top-k": "top_k", "--top-p": "top_p", "--seed": "seed"}


def run_generate(args: argparse.Namespace) -> int:
    from rotarium.evaluation.generate import check_prompt, generate_text

    check_prompt(args.prompt)
    # the sampling flags default to None, so that one given with --greedy (which would ignore it) is refused
    sampling = {name: getattr(args, name) for name in SAMPLING_FLAGS.values() if getattr(args, name) is not None}
    if args.greedy and sampling:
        given = ", ".join(flag for flag, name in SAMPLING_FLAGS.items() if name in sampling)
        raise ValueError(f"{given} applies to sampling, which --greedy turns off: drop {given} or --greedy")
    if args.device:
        check_device(args.device)
    model, tokenizer = load_for(args)
    texts = generate_text(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
                          do_sample=not args.greedy, repetition_penalty=args.repetition_penalty,
                          num_return_sequences=args.num_return_sequences, **sampling)
    if args.json:
        print(json.dumps(texts))
    else:
        print("\n\n---\n\n".join(texts))
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    from rotarium.evaluation.registry import EVAL_TASKS, selectable
    from rotarium.evaluation.tasks import listing

    ev = subparsers.add_parser(
        "eval", help="validation perplexity at several context lengths (table + PNG)",
        description="Perplexity of a checkpoint at several context lengths, including lengths beyond the training "
                    "length (the length-extrapolation curve). Writes eval/perplexity.json and eval/perplexity.png "
                    "into the checkpoint folder (or --output-dir). "
                    f"{listing([task.label for task in selectable()])} run other evaluations instead.")
    ev.add_argument("--model", required=True, help="checkpoint folder (e.g. runs/default/final) or Hub id")
    defaults = "; ".join(f"{task.label}: {task.lengths_help}" for task in EVAL_TASKS.values())
    ev.add_argument("--context-lengths", type=int_list("--context-lengths", minimum=2), default=None,
                    help=f"comma-separated lengths every evaluation runs at, e.g. 128,256,512 (default, {defaults})")
    ev.add_argument("--batch-size", type=int, default=8,
                    help="sequences in one forward pass, whichever the evaluation: perplexity's windows, RULER's "
                         "prompts, lm-eval's requests (default 8)")
    ev.add_argument("--output-dir", default=None, help="where to write the tables and plots (default MODEL/eval)")
    ev.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    ev.add_argument("--dtype", choices=DTYPES, default="auto",
                    help="weights and activations: auto (default) is bfloat16 on CUDA and float32 elsewhere")
    ev.add_argument("--rope-scaling", default=None, metavar="JSON",
                    help="RoPE scaling at inference, without retraining, for RoPE and RoVE checkpoints: transformers' "
                         "rope_parameters as JSON, e.g. '{\"rope_type\": \"yarn\", \"factor\": 4}' (also linear, "
                         "dynamic, llama3, longrope); the original length defaults to the checkpoint's training "
                         "length (max_position_embeddings); applies to every evaluation, whose files are then named "
                         "after it (perplexity.rope-yarn-x4.json) and record it")
    for task in EVAL_TASKS.values():  # each evaluation's selector and own flags, from the registry
        for flag in (task.selector, *task.flags):
            if flag is not None:
                flag.add_to(ev)
    ev.set_defaults(func=run_eval)

    gen = subparsers.add_parser(
        "generate", help="sample a continuation of a prompt",
        description="Continue --prompt with a checkpoint (sampling with temperature / top-k / top-p, or greedy).")
    gen.add_argument("--model", required=True, help="checkpoint folder or Hub id")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    gen.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    gen.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 0.8)")
    gen.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (default 50; 0 off)")
    gen.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default 0.95; 1 off)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (default 1)")
    gen.add_argument("--num-return-sequences", type=int, default=1, help="samples to draw (default 1)")
    gen.add_argument("--seed", type=int, default=None, help="random seed for sampling (default 0)")
    gen.add_argument("--json", action="store_true", help="print the samples as a JSON list")
    gen.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    gen.add_argument("--dtype", choices=DTYPES, default="auto",
                    help="weights and activations: auto (default) is bfloat16 on CUDA and float32 elsewhere")
    gen.set_defaults(func=run_generate)
