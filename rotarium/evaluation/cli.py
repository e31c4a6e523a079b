"""``rotarium eval`` (perplexity against context length) and ``rotarium generate``."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from rotarium.evaluation.outputs import check_result_paths
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


# the flags that one evaluation reads: flag -> (its attribute, the evaluation)
ONE_EVALUATION_FLAGS = {"--data": ("data", "perplexity"), "--max-tokens": ("max_tokens", "perplexity"),
                        "--allow-data-change": ("allow_data_change", "perplexity"),
                        "--samples": ("samples", "--ruler"), "--seed": ("seed", "--ruler"),
                        "--ruler-words": ("ruler_words", "--ruler"),
                        "--num-fewshot": ("num_fewshot", "--tasks"), "--include-path": ("include_path", "--tasks")}


def check_flags(args: argparse.Namespace) -> None:
    """Raises ``ValueError`` naming the flag when one is given that the evaluation asked for would ignore."""
    running = {"--ruler": args.ruler is not None, "--tasks": args.tasks is not None}
    running["perplexity"] = not any(running.values())
    for flag, (attribute, evaluation) in ONE_EVALUATION_FLAGS.items():
        value = getattr(args, attribute)
        if value is None or value is False or running[evaluation]:  # not given (False: a switch left off)
            continue
        if evaluation == "perplexity":
            raise ValueError(f"{flag} applies to perplexity only, which --ruler and --tasks replace (they bring their "
                             f"own texts); leave {flag} out")
        raise ValueError(f"{flag} applies to {evaluation} only, which this command does not run; add {evaluation} "
                         f"TASKS or leave {flag} out")


def run_eval(args: argparse.Namespace) -> int:
    from rotarium.evaluation.generate import check_model_path
    from rotarium.evaluation.perplexity import (
        MAX_TOKENS,
        RESULT_FILES,
        check_settings,
        evaluation_documents,
        evaluation_tokens,
        format_table,
        perplexity_by_context,
        save_results,
    )

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
    if args.ruler is not None or args.tasks is not None:
        return run_benchmarks(args, output, what, scaling)
    max_tokens = MAX_TOKENS if args.max_tokens is None else args.max_tokens
    check_settings(max_tokens, args.batch_size)
    check_result_paths(output, RESULT_FILES, scaling, what)
    documents, description = evaluation_documents("validation" if args.data is None else args.data,
                                                  args.model if local else None,
                                                  allow_data_change=args.allow_data_change)
    model, tokenizer = load_for(args, scaling)
    train_length = getattr(model.config, "max_position_embeddings", None)
    lengths = args.context_lengths or sorted({max(2, train_length // 2 if train_length else 64), *(
        (train_length * m for m in (1, 2, 4)) if train_length else (128, 256, 512))})
    tokens = evaluation_tokens(documents, tokenizer, max(max_tokens, *lengths))
    rows = perplexity_by_context(model, tokens, lengths, max_tokens=max_tokens, batch_size=args.batch_size)
    scaled = f" with RoPE scaling {json.dumps(scaling)}" if scaling is not None else ""
    print(f"{args.model}{scaled} on {description} ({tokens.numel()} tokens):")
    print(format_table(rows, train_length))
    table, plot = save_results(rows, output, title=f"{Path(args.model).name}{scaled}: perplexity on {description}",
                               train_length=train_length, rope_scaling=scaling)
    print(f"wrote {table} and {plot}")
    return 0


def run_benchmarks(args: argparse.Namespace, output: Path, what: str, scaling: dict | None) -> int:
    """``--ruler`` and ``--tasks`` (in place of perplexity): their settings and where their results go are checked
    before the model loads, once, through :func:`load_for`."""
    from rotarium.evaluation import downstream, ruler

    ruler_tasks = ruler.parse_tasks(args.ruler) if args.ruler is not None else []
    samples = ruler.SAMPLES if args.samples is None else args.samples
    seed = ruler.SEED if args.seed is None else args.seed
    if ruler_tasks:
        ruler.check_settings(samples, args.batch_size)
        check_result_paths(output, ruler.RESULT_FILES, scaling, what)
    words = None if not ruler_tasks else ruler.load_words() if args.ruler_words is None else ruler.load_words(
        args.ruler_words)
    lm_tasks, manager = [], None
    if args.tasks is not None:
        downstream.require_lm_eval()
        downstream.check_settings(args.batch_size, args.num_fewshot)
        lm_tasks = downstream.expand_tasks(args.tasks)
        check_result_paths(output, downstream.RESULT_FILES, scaling, what)
        # lm-eval's own RULER tasks read the tokenizer and lengths from here
        metadata = {"pretrained": args.model, **({"max_seq_lengths": args.context_lengths}
                                                  if args.context_lengths else {})}
        manager = downstream.task_manager(lm_tasks, args.include_path, metadata)
    model, tokenizer = load_for(args, scaling)
    if ruler_tasks:
        ruler.run_ruler(model, tokenizer, ruler_tasks, args.context_lengths, output=output, model_name=args.model,
                        num_samples=samples, seed=seed, batch_size=args.batch_size, words=words,
                        rope_scaling=scaling)
    if lm_tasks:
        downstream.run_tasks(model, tokenizer, lm_tasks, manager, output=output, model_name=args.model,
                             batch_size=args.batch_size, num_fewshot=args.num_fewshot, rope_scaling=scaling)
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from rotarium.evaluation.generate import check_prompt, generate_text

    check_prompt(args.prompt)
    if args.device:
        check_device(args.device)
    model, tokenizer = load_for(args)
    texts = generate_text(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
                          do_sample=not args.greedy, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                          num_return_sequences=args.num_return_sequences, seed=args.seed)
    if args.json:
        print(json.dumps(texts))
    else:
        print("\n\n---\n\n".join(texts))
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    from rotarium.evaluation import ruler
    from rotarium.evaluation.perplexity import MAX_TOKENS

    ev = subparsers.add_parser(
        "eval", help="validation perplexity at several context lengths (table + PNG)",
        description="Perplexity of a checkpoint at several context lengths, including lengths beyond the training "
                    "length (the length-extrapolation curve). Writes eval/perplexity.json and eval/perplexity.png "
                    "into the checkpoint folder (or --output-dir).")
    ev.add_argument("--model", required=True, help="checkpoint folder (e.g. runs/default/final) or Hub id")
    ev.add_argument("--data", default=None,
                    help="'validation': the documents the checkpoint's training run held out, checked against "
                         "the record the run kept of them (default); "
                         "'embedded': the embedded corpus; a prepared folder (its validation split); or a local "
                         ".txt/.jsonl/.parquet file or folder")
    ev.add_argument("--allow-data-change", action="store_true",
                    help="score the run's held-out documents derived from its source as it is now, although the "
                         "source changed since training (they may then include documents the run trained on; "
                         "without it such an evaluation is refused, naming what changed)")
    ev.add_argument("--context-lengths", type=int_list("--context-lengths", minimum=2), default=None,
                    help="comma-separated lengths, e.g. 128,256,512 (default: half, 1x, 2x and 4x the "
                         "training length)")
    ev.add_argument("--max-tokens", type=int, default=None,
                    help=f"tokens scored per context length (default {MAX_TOKENS})")
    ev.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default 8)")
    ev.add_argument("--output-dir", default=None, help="where to write the table and plot (default MODEL/eval)")
    ev.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    ev.add_argument("--dtype", choices=DTYPES, default="auto",
                    help="weights and activations: auto (default) is bfloat16 on CUDA and float32 elsewhere")
    ev.add_argument("--ruler", default=None, metavar="TASKS",
                    help="RULER's synthetic tasks instead of perplexity, built offline with the model's tokenizer: "
                         f"comma-separated names from {', '.join(ruler.TASKS)}, or all; at each "
                         "--context-lengths (default here 1x, 2x, 4x and 8x the training length); writes ruler.json, "
                         "ruler.md and ruler.png")
    ev.add_argument("--samples", type=int, default=None,
                    help=f"--ruler: samples per task and length (default {ruler.SAMPLES})")
    ev.add_argument("--seed", type=int, default=None,
                    help=f"--ruler: the seed the samples are drawn from (default {ruler.SEED})")
    ev.add_argument("--ruler-words", choices=("rotarium", "wonderwords"), default=None,
                    help="--ruler: where keys and words come from: rotarium's list (default) or the wonderwords "
                         "package's, as RULER's")
    ev.add_argument("--tasks", default=None, metavar="TASKS",
                    help="lm-evaluation-harness tasks instead of perplexity (pip install 'rotarium[eval]'): "
                         "comma-separated task or group names, or papers (the GLA / DeltaNet / FoX tables' list); "
                         "writes downstream.json and downstream.md; --batch-size sets lm-eval's batch size")
    ev.add_argument("--num-fewshot", type=int, default=None,
                    help="--tasks: examples in each prompt (default: each task's own, 0 for papers)")
    ev.add_argument("--include-path", default=None,
                    help="--tasks: a folder of lm-eval task YAML files (local tasks) to add to lm-eval's")
    ev.add_argument("--rope-scaling", default=None, metavar="JSON",
                    help="RoPE scaling at inference, without retraining, for RoPE and RoVE checkpoints: transformers' "
                         "rope_parameters as JSON, e.g. '{\"rope_type\": \"yarn\", \"factor\": 4}' (also linear, "
                         "dynamic, llama3, longrope); the original length defaults to the checkpoint's training "
                         "length (max_position_embeddings); applies to perplexity, --ruler and --tasks alike, whose "
                         "files are then named after it (perplexity.rope-yarn-x4.json) and record it")
    ev.set_defaults(func=run_eval)

    gen = subparsers.add_parser(
        "generate", help="sample a continuation of a prompt",
        description="Continue --prompt with a checkpoint (sampling with temperature / top-k / top-p, or greedy).")
    gen.add_argument("--model", required=True, help="checkpoint folder or Hub id")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    gen.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    gen.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8)")
    gen.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (default 50; 0 off)")
    gen.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95; 1 off)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (default 1)")
    gen.add_argument("--num-return-sequences", type=int, default=1, help="samples to draw (default 1)")
    gen.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    gen.add_argument("--json", action="store_true", help="print the samples as a JSON list")
    gen.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    gen.add_argument("--dtype", choices=DTYPES, default="auto",
                    help="weights and activations: auto (default) is bfloat16 on CUDA and float32 elsewhere")
    gen.set_defaults(func=run_generate)
