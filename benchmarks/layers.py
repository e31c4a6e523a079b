"""Forward+backward time of every mixer with every positional option, as a ratio to the same mixer with NoPE.

Targets: RoPE and RoVE within 1.10 of NoPE, Selective RoPE within 1.20. The NoPE column is its best time; a ratio is
the median over rounds of the two times measured in the same round (see common.py). The backward includes the
gradient of the mixer's input, as in training. The verdicts are taken with glibc keeping freed memory for every
contender alike (see common.keep_freed_memory), after an informative table under glibc's defaults measured in a
process of its own.

One small CPU shape by default: B=4, T=512, width 512, each family with its 370M preset's head sizes (GLA: keys 128
and values 256 wide per head; DeltaNet: 128; FoX and the Transformer: 64). 512 is the smallest width that holds at
least two of every family's preset heads. The positional layer's work grows with the width and the mixer's
projections with its square, so narrower mixers show larger ratios: docs/benchmarks.md also gives ``--hidden 256
--heads 4`` (the width of ``rotarium train``'s small default model).
``python benchmarks/layers.py [--batch 4] [--seq-len 512] [--hidden 512] [--heads N] [--repeats 30]
[--no-input-grad] [--kept-memory-only]``.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

import torch
from common import best, keep_freed_memory, paired_ratio, time_rounds, verdict  # beside this script, first on sys.path

from rotarium.configs.presets import PRESETS
from rotarium.layers import POSITION_ENCODINGS, PositionalSettings, SequenceInfo
from rotarium.models import MIXERS, build_mixer

TARGETS = {"nope": 1.0, "rope": 1.10, "rove": 1.10, "selective_rope": 1.20}


def preset_heads(family: str, hidden: int) -> int:
    """Heads of ``family``'s 370M preset's width at width ``hidden``."""
    values = PRESETS[f"{family}-370m"][1]
    head_width = values["hidden_size"] // values["num_heads"]
    if hidden % head_width:
        raise ValueError(f"--hidden {hidden} does not hold {family}'s preset heads ({head_width} wide each): use a "
                         f"multiple of {head_width}, or give --heads")
    return hidden // head_width


def build(family: str, hidden: int, heads: int, **positional) -> torch.nn.Module:
    return build_mixer(family, hidden_size=hidden, num_heads=heads, positional=PositionalSettings(**positional))


def training_step(mixer: torch.nn.Module, x: torch.Tensor, seq: SequenceInfo):
    # a dense output gradient, as the residual stream hands a mixer in training (out.sum() would hand it a
    # stride-0 one, which the output projection's backward first copies out)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))

    def step():
        out, _ = mixer(x, seq)
        out.backward(grad_out)
        mixer.zero_grad(set_to_none=True)
        x.grad = None

    return step


def measure(args: argparse.Namespace, x: torch.Tensor, seq: SequenceInfo) -> bool:
    """Prints one table of ratios; True when every target holds."""
    print("| mixer | " + " | ".join(POSITION_ENCODINGS) + " |")
    print("|---|" + "---|" * len(POSITION_ENCODINGS))
    ok = True
    rotation_only = {}
    for family in MIXERS:
        heads = args.heads or preset_heads(family, args.hidden)
        steps = {}
        for name in POSITION_ENCODINGS:
            mixer = build(family, args.hidden, heads, position_encoding=name)
            steps[name] = training_step(mixer, x, seq)
            if name == "selective_rope" and mixer.positional.adds_decay:
                # informative: the same option without the decay it adds to this decay-less mixer, which changes
                # the kernel (softmax -> forgetting attention, delta rule -> gated delta rule)
                mixer = build(family, args.hidden, heads, position_encoding=name, selective_rope_decay=False)
                steps["rotation only"] = training_step(mixer, x, seq)
        samples = time_rounds(steps, args.repeats)
        times = best(samples)
        cells = []
        for pe in POSITION_ENCODINGS:
            ratio = paired_ratio(samples[pe], samples["nope"])
            good = ratio <= TARGETS[pe]
            ok &= good
            cells.append(f"{times[pe] * 1e3:.1f} ms" if pe == "nope" else f"{ratio:.3f} {verdict(good)}")
        print(f"| {family} (H={heads}) | " + " | ".join(cells) + " |")
        if "rotation only" in samples:
            rotation_only[family] = paired_ratio(samples["rotation only"], samples["nope"])
    if rotation_only:
        print("\nSelective RoPE without its added decay (rotation only): "
              + ", ".join(f"{family} {ratio:.3f}" for family, ratio in rotation_only.items()))
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=None,
                        help="the same head count for every family (default: each family's 370M preset head sizes)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--no-input-grad", action="store_true",
                        help="skip the gradient of the mixer's input (training needs it)")
    parser.add_argument("--kept-memory-only", action="store_true",
                        help="skip the informative table under glibc's default allocator")
    parser.add_argument("--default-allocator", action="store_true",
                        help="only the informative table under glibc's default allocator (what the first part runs)")
    args = parser.parse_args()
    # each allocator policy gets a process of its own: the verdicts never measure a heap shaped by the other's run
    kept = not args.default_allocator and keep_freed_memory()
    if not args.default_allocator and not args.kept_memory_only:
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--default-allocator"], check=True)
    torch.manual_seed(0)
    # in training every mixer's input needs its gradient (it comes from the blocks below), so its backward does too
    x = torch.randn(args.batch, args.seq_len, args.hidden, requires_grad=not args.no_input_grad)
    seq = SequenceInfo.build(x)
    if args.default_allocator or args.kept_memory_only:  # the first process to measure says what
        heads = args.heads or "each family's preset head sizes"
        print(f"forward+backward{' (no input gradient)' if args.no_input_grad else ''}, B={args.batch} "
              f"T={args.seq_len} d={args.hidden} H={heads}, float32, {torch.get_num_threads()} threads; ratio to the "
              "same mixer with NoPE")
    if args.default_allocator:
        print("\n## glibc's default allocator (informative: which contender gets fresh pages from the OS depends on "
              "its temporaries' sizes and on the call before it)")
        measure(args, x, seq)
        sys.stdout.flush()
        return
    print("\n## " + ("freed memory kept by the allocator (glibc mallopt: no trimming, no mmap below 256 MB), for "
                     "every contender alike" if kept
                     else "the allocator as it is (not glibc: its policy was left alone)"))
    ok = measure(args, x, seq)
    print(f"\ntargets (RoPE/RoVE <= 1.10, Selective RoPE <= 1.20): {verdict(ok)}")


if __name__ == "__main__":
    main()
