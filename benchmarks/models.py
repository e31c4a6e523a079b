"""Model-level speed on CPU, every number from one run.

1. Training throughput (forward+backward tokens/s) of each family at one small shape, and of transformers'
   ``LlamaForCausalLM`` with the same width, depth and heads beside our Transformer (target: ours >= 0.9x Llama).
2. Per-token decoding latency of each family after a context of 256 and of 4096 tokens (targets: the linear
   families within 1.3x of each other at each context; the Transformer's latency grows with the context).

``python benchmarks/models.py [--hidden 256] [--layers 4] [--heads 4] [--seq-len 512] [--batch 4]``
"""
from __future__ import annotations

import argparse

import torch
from common import Decoder, best, paired_ratio, time_rounds, verdict  # beside this script, first on sys.path

from rotarium.layers import SoftmaxAttention
from rotarium.models import CONFIGS, FAMILY_MODELS, MIXERS

VOCAB = 32000


def build(family: str, args, **overrides):
    config = CONFIGS[family](vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=args.layers,
                             num_heads=args.heads, **overrides)
    torch.manual_seed(0)
    return FAMILY_MODELS[family].lm(config)


def llama(args, intermediate_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, intermediate_size=intermediate_size,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def training_step(model, args):
    model.train()
    ids = torch.randint(0, VOCAB, (args.batch, args.seq_len))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=9)  # the median of paired ratios needs rounds here
    parser.add_argument("--decode-steps", type=int, default=32)
    args = parser.parse_args()
    print(f"d={args.hidden} layers={args.layers} heads={args.heads} B={args.batch} T={args.seq_len}, float32, "
          f"{torch.get_num_threads()} threads")

    print("\n## training throughput (forward+backward)")
    steps = {family: training_step(build(family, args), args) for family in CONFIGS}  # the Transformer uses RoPE
    llama_model = llama(args, build("transformer", args).config.intermediate_size)
    steps["llama (transformers)"] = training_step(llama_model, args)
    samples = time_rounds(steps, args.repeats)
    for name, seconds in best(samples).items():
        print(f"| {name} | {args.batch * args.seq_len / seconds:,.0f} tokens/s |")
    # a speed ratio: Llama's time over ours, each round's pair measured back to back
    ratio = paired_ratio(samples["llama (transformers)"], samples["transformer"])
    print(f"rotarium Transformer / Llama speed: {ratio:.2f} (target >= 0.90) {verdict(ratio >= 0.9)}")

    print("\n## per-token decoding latency (batch 1, after a prefill of the context)")
    # every family and context in the same rounds, so that the machine's drift does not land on one of them
    calls = {(family, context): Decoder(model, context, args.decode_steps)
             for family, model in ((family, build(family, args)) for family in CONFIGS) for context in (256, 4096)}
    rounds = best(time_rounds(calls, repeats=3))
    latency = {family: {context: rounds[family, context] / args.decode_steps for context in (256, 4096)}
               for family in CONFIGS}
    for family in CONFIGS:
        print(f"| {family} | ctx 256: {latency[family][256] * 1e3:.2f} ms | ctx 4096: "
              f"{latency[family][4096] * 1e3:.2f} ms |")
    # FoX is softmax attention: its cache grows like the Transformer's
    linear = [family for family, mixer in MIXERS.items() if not issubclass(mixer, SoftmaxAttention)]
    for context in (256, 4096):
        values = [latency[f][context] for f in linear]
        spread = max(values) / min(values)
        print(f"linear families at ctx {context}: spread {spread:.2f}x (target <= 1.3) {verdict(spread <= 1.3)}")
    growth = latency["transformer"][4096] / latency["transformer"][256]
    print(f"Transformer latency 4096 / 256: {growth:.2f}x (grows: {verdict(growth > 1.05)})")


if __name__ == "__main__":
    main()
