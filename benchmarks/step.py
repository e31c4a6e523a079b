"""A training step of the 370M presets' layers on CPU, every family beside transformers' Llama of the same shape.

What a user waits for is the step, not the token mixer: the projections, the MLP, the norms, the head and the glue
around the kernels all count. Each contender is the preset's width, heads, MLP and 32k vocabulary at a depth that
keeps a round short (``--layers``), batch 1, one forward and backward of the causal-LM loss; transformers'
``LlamaForCausalLM`` has the Transformer preset's shape. Every contender of a length is timed in the same
round-robin rounds (benchmarks/common.py) and compared with Llama round by round.

Targets (each printed with PASS/FAIL):

- our Transformer <= 1.0x Llama at every length (the same architecture);
- GLA and DeltaNet <= 1.0x Llama at 512, <= 0.85x at 2048, <= 0.6x at 8192 (only the token mixer differs);
- FoX <= 1.1x Llama at every length;
- Selective RoPE <= 1.1x the same family with RoPE;
- the chunked cross-entropy head (never holding the ``[tokens, vocab]`` logits) <= 1.05x the time of the full
  logits (its memory: benchmarks/lm_head.py).

``--busy N`` times the same rounds again with N other processes running Llama's step on the machine (how most
users run) and prints how much each contender slows down against Llama. The busy processes inherit the environment,
so ``OMP_WAIT_POLICY=PASSIVE python benchmarks/step.py --busy 1`` measures both sides with threads that sleep at
once instead of spinning (docs/training.md, "On a shared CPU"). ``--profile`` prints where a step's time goes
(forward and backward separately, per family) instead of timing.

``--bf16`` times each family (RoPE) and Llama in float32 and under bf16 autocast (``train.mixed_precision: bf16``),
with the target that every family's bf16 step is at least 2x faster where the CPU has bf16 matrix units.
``--decode`` times greedy decoding after a prefill of each length with float32 against bfloat16 weights (as a model
loaded for inference in bf16), each family (RoPE) beside Llama in the same dtype.
``--compile`` times each family (RoPE) eager and with its blocks compiled as ``train.compile`` compiles them.

``python benchmarks/step.py [--lengths 512,2048,8192] [--layers 4] [--repeats 3] [--busy 1] [--profile]
[--bf16] [--decode [--decode-steps 16]] [--compile]``
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from common import Decoder, best, paired_ratio, time_rounds, verdict  # beside this script, first on sys.path

from rotarium.configs.presets import preset_config
from rotarium.models import CONFIGS, FAMILY_MODELS

LLAMA = "llama (transformers)"
POSITIONS = ("rope", "selective_rope")
# a family's target against Llama at each length; the rest of the step is the same FLOPs, only the mixer differs
LINEAR_TARGETS = {512: 1.0, 2048: 0.85, 8192: 0.6}
TARGETS: dict[str, Callable[[int], float]] = {
    "transformer": lambda length: 1.0,
    "fox": lambda length: 1.1,
    "gla": lambda length: LINEAR_TARGETS.get(length, 1.0),
    "deltanet": lambda length: LINEAR_TARGETS.get(length, 1.0),
}
SELECTIVE_OVER_ROPE = 1.1
CHUNKED_OVER_FULL = 1.05
BF16_SPEEDUP = 2.0


def config(family: str, position: str, layers: int):
    return preset_config(f"{family}-370m", num_hidden_layers=layers, position_encoding=position)


def build(family: str, position: str, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return FAMILY_MODELS[family].lm(config(family, position, layers)).train()


def llama(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    ours = config("transformer", "rope", layers)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=ours.vocab_size, hidden_size=ours.hidden_size, num_hidden_layers=layers,
        num_attention_heads=ours.num_heads, num_key_value_heads=ours.num_kv_heads or ours.num_heads,
        intermediate_size=ours.intermediate_size, tie_word_embeddings=ours.tie_word_embeddings,
        attn_implementation="sdpa")).train()


def training_step(model: torch.nn.Module, length: int, bf16: bool = False, **forward: object) -> Callable[[], None]:
    """One forward and backward of the causal-LM loss; ``bf16``: under bf16 autocast, as mixed precision trains."""
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids, **forward).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def contenders(length: int, layers: int) -> dict[str, Callable[[], None]]:
    steps = {f"{family}/{position}": training_step(build(family, position, layers), length)
             for family in CONFIGS for position in POSITIONS}
    steps["transformer/rope, full logits"] = training_step(build("transformer", "rope", layers), length,
                                                           return_logits=True)
    steps[LLAMA] = training_step(llama(layers), length)
    return steps


def ratios(samples: dict[str, list[float]]) -> dict[str, float]:
    return {name: paired_ratio(times, samples[LLAMA]) for name, times in samples.items() if name != LLAMA}


def report(length: int, samples: dict[str, list[float]]) -> bool:
    """The table of one length and its targets; True when every target passes."""
    seconds, against = best(samples), ratios(samples)
    print(f"\n## T = {length}\n\n| contender | step (s) | tokens/s | / Llama |\n|---|---:|---:|---:|")
    for name, value in seconds.items():
        print(f"| {name} | {value:.3f} | {length / value:,.0f} | "
              f"{'1.00' if name == LLAMA else f'{against[name]:.2f}x'} |")
    checks = []
    for family in CONFIGS:
        target = TARGETS[family](length)
        checks.append((f"{family}/rope <= {target:.2f}x Llama", against[f"{family}/rope"], target))
        selective = paired_ratio(samples[f"{family}/selective_rope"], samples[f"{family}/rope"])
        checks.append((f"{family}: Selective RoPE <= {SELECTIVE_OVER_ROPE}x RoPE", selective, SELECTIVE_OVER_ROPE))
    chunked = paired_ratio(samples["transformer/rope"], samples["transformer/rope, full logits"])
    checks.append((f"chunked head <= {CHUNKED_OVER_FULL}x full logits", chunked, CHUNKED_OVER_FULL))
    print()
    for text, value, target in checks:
        print(f"{text}: {value:.2f} {verdict(value <= target)}")
    return all(value <= target for _, value, target in checks)


def compare_bf16(length: int, layers: int, repeats: int) -> bool:
    """Each family (RoPE) and Llama, float32 against bf16 autocast on the same model; True when every family meets
    the bf16 target."""
    from rotarium.utils.devices import cpu_bf16_matmul, read_cpuinfo

    models = {f"{family}/rope": build(family, "rope", layers) for family in CONFIGS}
    models[LLAMA] = llama(layers)
    steps = {(name, bf16): training_step(model, length, bf16=bf16) for name, model in models.items()
             for bf16 in (False, True)}
    samples = time_rounds(steps, repeats)
    seconds = best(samples)
    unit = cpu_bf16_matmul(read_cpuinfo())
    print(f"\n## bf16 autocast against float32, T = {length} (bf16 matrix units: {unit or 'none found'})\n")
    print("| contender | float32 (s) | bf16 (s) | speedup |\n|---|---:|---:|---:|")
    passed = True
    for name in models:
        speedup = paired_ratio(samples[name, False], samples[name, True])
        print(f"| {name} | {seconds[name, False]:.3f} | {seconds[name, True]:.3f} | {speedup:.2f}x |")
        if name != LLAMA:
            passed &= speedup >= BF16_SPEEDUP
    print(f"\nevery family >= {BF16_SPEEDUP}x in bf16: {verdict(passed)}"
          + ("" if unit else " (no bf16 matrix unit on this CPU: the target does not apply)"))
    return passed or unit is None


def compare_bf16_decoding(context: int, layers: int, repeats: int, steps: int) -> None:
    """Per-token greedy decoding latency (batch 1, after a prefill of ``context`` tokens) of each family (RoPE) and
    Llama with float32 weights and with bfloat16 weights, each compared with Llama's in the same dtype."""
    calls = {}
    for dtype in (torch.float32, torch.bfloat16):
        for family in CONFIGS:
            calls[f"{family}/rope", dtype] = Decoder(build(family, "rope", layers).to(dtype), context, steps)
        calls[LLAMA, dtype] = Decoder(llama(layers).to(dtype), context, steps)
    samples = time_rounds(calls, repeats)
    seconds = best(samples)
    names = [f"{family}/rope" for family in CONFIGS] + [LLAMA]
    print(f"\n## Decoding after {context} tokens, float32 against bfloat16 weights ({steps} tokens a call)\n")
    print("| contender | float32 (ms/token) | bf16 (ms/token) | bf16 speedup | / Llama float32 | / Llama bf16 |\n"
          "|---|---:|---:|---:|---:|---:|")
    for name in names:
        fp32, bf16 = samples[name, torch.float32], samples[name, torch.bfloat16]
        print(f"| {name} | {seconds[name, torch.float32] / steps * 1e3:.2f} | "
              f"{seconds[name, torch.bfloat16] / steps * 1e3:.2f} | {paired_ratio(fp32, bf16):.2f}x | "
              f"{paired_ratio(fp32, samples[LLAMA, torch.float32]):.2f}x | "
              f"{paired_ratio(bf16, samples[LLAMA, torch.bfloat16]):.2f}x |")


def compare_compiled(length: int, layers: int, repeats: int) -> None:
    """Each family (RoPE), eager against its blocks compiled as ``train.compile`` compiles them (inductor)."""
    from rotarium.training.build import check_compile_supported, compile_blocks

    check_compile_supported()
    steps = {}
    for family in CONFIGS:
        steps[family, "eager"] = training_step(build(family, "rope", layers), length)
        compiled = build(family, "rope", layers)
        compile_blocks(compiled)
        steps[family, "compiled"] = training_step(compiled, length)
    samples = time_rounds(steps, repeats, warmup=2)  # the warm-up compiles
    seconds = best(samples)
    print(f"\n## Compiled blocks against eager, T = {length}\n")
    print("| family | eager (s) | compiled (s) | compiled / eager |\n|---|---:|---:|---:|")
    for family in CONFIGS:
        ratio = paired_ratio(samples[family, "compiled"], samples[family, "eager"])
        print(f"| {family}/rope | {seconds[family, 'eager']:.3f} | {seconds[family, 'compiled']:.3f} | {ratio:.2f}x |")


def busy_processes(count: int, length: int, layers: int) -> list[subprocess.Popen]:
    """``count`` processes running Llama's step at ``length`` until killed."""
    command = [sys.executable, str(Path(__file__).resolve()), "--burn", str(length), "--layers", str(layers)]
    return [subprocess.Popen(command, stdout=subprocess.DEVNULL) for _ in range(count)]


def burn(length: int, layers: int) -> None:
    step = training_step(llama(layers), length)
    while True:
        step()


def profile(length: int, layers: int, rows: int) -> None:
    """Per family (RoPE) and Llama: the operators taking the most self time, forward and backward apart."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    models = {f"{family}/rope": build(family, "rope", layers) for family in CONFIGS}
    models[LLAMA] = llama(layers)
    ids = torch.randint(0, 32000, (1, length), generator=torch.Generator().manual_seed(0))
    for name, model in models.items():
        model(input_ids=ids, labels=ids).loss.backward()  # warm-up
        model.zero_grad(set_to_none=True)
        with profiler(activities=[ProfilerActivity.CPU]) as forward:
            loss = model(input_ids=ids, labels=ids).loss
        with profiler(activities=[ProfilerActivity.CPU]) as backward:
            loss.backward()
        model.zero_grad(set_to_none=True)
        for part, recorded in (("forward", forward), ("backward", backward)):
            print(f"\n## {name}, {part}, T = {length}\n")
            print(recorded.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,2048,8192", help="comma-separated sequence lengths")
    parser.add_argument("--layers", type=int, default=4, help="depth of every contender (the presets': 24)")
    parser.add_argument("--repeats", type=int, default=3, help="round-robin rounds per length")
    parser.add_argument("--busy", type=int, default=0, help="also time with this many busy processes beside")
    parser.add_argument("--profile", action="store_true", help="print profiles instead of timing")
    parser.add_argument("--profile-rows", type=int, default=15)
    parser.add_argument("--bf16", action="store_true", help="time float32 against bf16 autocast instead")
    parser.add_argument("--decode", action="store_true", help="time decoding, float32 against bf16 weights, instead")
    parser.add_argument("--decode-steps", type=int, default=16, help="tokens a decoding call makes (--decode)")
    parser.add_argument("--compile", action="store_true", help="time eager against compiled blocks instead")
    parser.add_argument("--burn", type=int, default=0, help=argparse.SUPPRESS)  # a busy process's length
    args = parser.parse_args()
    if args.burn:
        return burn(args.burn, args.layers)
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"the 370M presets' layers x {args.layers}, batch 1, float32, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs, {torch.backends.cpu.get_cpu_capability()}")
    if args.profile:
        for length in lengths:
            profile(length, args.layers, args.profile_rows)
        return
    if args.bf16 or args.compile or args.decode:
        passed = True
        for length in lengths:
            if args.bf16:
                passed &= compare_bf16(length, args.layers, args.repeats)
            if args.decode:
                compare_bf16_decoding(length, args.layers, args.repeats, args.decode_steps)
            if args.compile:
                compare_compiled(length, args.layers, args.repeats)
        if args.bf16:
            print(f"\nbf16 target: {verdict(passed)}")
        return
    passed = True
    for length in lengths:
        steps = contenders(length, args.layers)
        idle = time_rounds(steps, args.repeats)
        passed &= report(length, idle)
        if args.busy:
            others = busy_processes(args.busy, length, args.layers)
            try:
                busy = time_rounds(steps, args.repeats)
            finally:
                for process in others:
                    process.kill()
            print(f"\nWith {args.busy} busy process(es) running Llama's step beside: each contender's ratio to "
                  "Llama, busy over idle (above 1: it suffers more from the shared machine than Llama)\n")
            print("| contender | / Llama idle | / Llama busy | busy / idle |\n|---|---:|---:|---:|")
            for name, value in ratios(busy).items():
                print(f"| {name} | {ratios(idle)[name]:.2f}x | {value:.2f}x | {value / ratios(idle)[name]:.2f} |")
        del steps
    print(f"\nall targets: {verdict(passed)}")


if __name__ == "__main__":
    main()
