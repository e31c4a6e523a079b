"""The causal-LM loss with and without the chunked linear cross-entropy: peak memory and time of a training step.

Two contenders from one model and one batch: ``chunked`` (the default when labels are given: the loss goes
through the output projection a chunk of tokens at a time and the ``[tokens, vocab]`` logits never exist) and
``full logits`` (``return_logits=True``: transformers' usual path, logits then F.cross_entropy). Targets: the chunked
step's peak memory lower by at least the size of the float32 logits, its time within 1.05x.

Each contender's peak memory is measured in a fresh process (the peak resident set above the resident set just
before the step, after a warm-up step), since a process's peak only rises, with glibc returning every freed
buffer of 64 KiB or more to the OS at once, so that the resident set follows the live tensors. Times come from
round-robin rounds in one process (benchmarks/common.py).

``python benchmarks/lm_head.py [--preset gla-370m] [--seq-len 2048] [--batch 1] [--repeats 3]
[--head-only]``: ``--head-only`` times the part that differs (final hidden states -> loss -> gradients of the
hidden states and of the projection) at the preset's width and vocabulary, in seconds instead of minutes.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch
from common import (  # beside this script, first on sys.path
    keep_freed_memory,
    paired_ratio,
    release_freed_memory,
    time_rounds,
    verdict,
)

from rotarium.configs.presets import preset_config
from rotarium.models import FAMILY_MODELS, set_activation_checkpointing

CONTENDERS = ("chunked", "full logits")


def status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS: resident now, VmHWM: the peak since the last reset)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Sets the peak resident set (VmHWM) to the current one (Linux's clear_refs, value 5)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def make_step(args: argparse.Namespace):
    """The training step of ``args`` for the contender ``args.contender`` (a closure over the model and batch)."""
    # head only: one layer, since the body is not part of the measurement
    config = preset_config(args.preset, **({"num_hidden_layers": 1} if args.head_only else {}))
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len))
    return_logits = args.contender == "full logits"
    if args.head_only:
        model = FAMILY_MODELS[config.family].lm(config)
        head = model.lm_head
        hidden = torch.randn(args.batch, args.seq_len, config.hidden_size, requires_grad=True)

        def step():
            if return_logits:
                logits = head(hidden).float()
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                         ids[:, 1:].reshape(-1))
            else:
                loss = model.chunked_loss(hidden, ids)
            loss.backward()
            hidden.grad = head.weight.grad = None
            return loss.detach()

        return step
    model = FAMILY_MODELS[config.family].lm(config).train()
    set_activation_checkpointing(model)

    def step():
        loss = model(input_ids=ids, labels=ids, return_logits=return_logits).loss
        loss.backward()
        # The gradients stay allocated between steps, as between the micro-batches of gradient accumulation (the
        # recipes accumulate): the measured peak is then what the micro-batch itself adds. Freed after every step,
        # the gradients' own allocation at the end of the backward would set the peak of a short batch instead.
        model.zero_grad(set_to_none=False)
        return loss.detach()

    return step


def measure_memory(args: argparse.Namespace) -> None:
    """Child process: a warm-up step, then one measured step; prints JSON."""
    release_freed_memory()
    step = make_step(args)
    loss = float(step())
    reset_peak()
    before = status_bytes("VmRSS")
    step()
    print(json.dumps({"contender": args.contender, "loss": loss, "peak_above_start": status_bytes("VmHWM") - before}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gla-370m")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--head-only", action="store_true")
    parser.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)  # the memory child
    args = parser.parse_args()
    if args.contender is not None:
        measure_memory(args)
        return

    config = preset_config(args.preset)
    tokens = args.batch * args.seq_len
    logits_bytes = tokens * config.vocab_size * 4
    what = "head only (hidden -> loss -> grads)" if args.head_only else "training step, gradient checkpointing"
    print(f"{args.preset}, {args.batch} x {args.seq_len} tokens, vocab {config.vocab_size}, {what}; "
          f"float32 logits: {logits_bytes / 2**20:.0f} MiB", flush=True)

    memory = {}
    for contender in CONTENDERS:
        command = [sys.executable, __file__, "--contender", contender, "--preset", args.preset, "--seq-len",
                   str(args.seq_len), "--batch", str(args.batch), *(["--head-only"] if args.head_only else [])]
        result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        memory[contender] = result
        print(f"  {contender:12s} loss {result['loss']:.5f}  peak memory above the start of the step "
              f"{result['peak_above_start'] / 2**20:8.0f} MiB", flush=True)
    saved = memory["full logits"]["peak_above_start"] - memory["chunked"]["peak_above_start"]
    print(f"memory saved: {saved / 2**20:.0f} MiB ({saved / logits_bytes:.2f}x the logits; target >= 1x): "
          f"{verdict(saved >= logits_bytes)}", flush=True)

    keep_freed_memory()
    steps = {contender: make_step(argparse.Namespace(**{**vars(args), "contender": contender}))
             for contender in CONTENDERS}
    samples = time_rounds(steps, repeats=args.repeats)
    ratio = paired_ratio(samples["chunked"], samples["full logits"])
    print(f"time: chunked {min(samples['chunked']):.3f}s, full logits {min(samples['full logits']):.3f}s (best of "
          f"{args.repeats}); chunked / full, median of paired rounds: {ratio:.3f}x (target <= 1.05x): "
          f"{verdict(ratio <= 1.05)}", flush=True)


if __name__ == "__main__":
    main()
