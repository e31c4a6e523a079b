"""Forward+backward speed of rotarium's PyTorch kernels, against peers measured in the same run.

1. ``chunk_gated_delta_rule`` against transformers' own PyTorch reference
   (``torch_chunk_gated_delta_rule`` of Qwen3-Next, undecorated) at B=1, T=4096, H=4, K=V=64.
   Target: ours at most 0.5 of its time.
2. Every op at T = 2048 ... 16384 beside PyTorch's causal SDPA. Targets for the linear ops:
   time(16384) <= 4.5 * time(4096) (linear growth) and faster than SDPA from T = 8192 on.
   The growth verdict holds the allocator's behaviour fixed across lengths. Under glibc's defaults it is not: freed
   memory stays in the heap below an adaptive threshold and goes back to the OS above it, so a call at T=4096 reuses
   its pages while one at T=16384 takes fresh zero-filled pages for its outputs and gradients. So the growth is
   measured with glibc told to keep freed memory (as jemalloc / tcmalloc do, which PyTorch's CPU tuning guide
   recommends, and as PyTorch's caching allocator does on GPUs), in a process of its own; the default allocator's
   growth and page faults are printed before it.

Usage: ``python benchmarks/ops.py [--lengths 2048 4096 8192 16384] [--repeats 5]``.
Forces the PyTorch backend so the numbers mean the same on any machine.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

import torch
import torch.nn.functional as F
from common import best, keep_freed_memory, paired_ratio, time_rounds, verdict  # beside this script, first on sys.path

from rotarium.ops import chunk_delta_rule, chunk_gated_delta_rule, chunk_gla, parallel_forgetting_attn


def make_inputs(B: int, T: int, H: int, K: int, V: int) -> dict[str, torch.Tensor]:
    return {
        "q": torch.randn(B, T, H, K),
        "k": F.normalize(torch.randn(B, T, H, K), dim=-1),
        "v": torch.randn(B, T, H, V),
        "g_head": F.logsigmoid(torch.randn(B, T, H) + 3),
        "g_channel": F.logsigmoid(torch.randn(B, T, H, K) + 3) / 16,
        "beta": torch.rand(B, T, H),
    }


def fwd_bwd(fn, *tensors: torch.Tensor):
    leaves = [t.detach().requires_grad_() for t in tensors]
    grad_out = None

    def run():
        nonlocal grad_out
        out = fn(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        # a dense output gradient, as in training (out.sum() would hand the kernels a stride-0 one)
        if grad_out is None:
            grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out)
        out.backward(grad_out)
        for t in leaves:
            t.grad = None

    return run


OPS = {
    "chunk_gla": lambda x: fwd_bwd(lambda q, k, v, g: chunk_gla(q, k, v, g, backend="torch"),
                                   x["q"], x["k"], x["v"], x["g_channel"]),
    "chunk_delta_rule": lambda x: fwd_bwd(lambda q, k, v, b: chunk_delta_rule(q, k, v, b, backend="torch"),
                                          x["q"], x["k"], x["v"], x["beta"]),
    "chunk_gated_delta_rule": lambda x: fwd_bwd(
        lambda q, k, v, g, b: chunk_gated_delta_rule(q, k, v, g, b, backend="torch"),
        x["q"], x["k"], x["v"], x["g_head"], x["beta"]),
    "parallel_forgetting_attn": lambda x: fwd_bwd(
        lambda q, k, v, g: parallel_forgetting_attn(q, k, v, g, backend="torch"), x["q"], x["k"], x["v"], x["g_head"]),
    "sdpa (causal)": lambda x: fwd_bwd(
        lambda q, k, v: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       is_causal=True), x["q"], x["k"], x["v"]),
}
LINEAR_OPS = ("chunk_gla", "chunk_delta_rule", "chunk_gated_delta_rule")


def against_transformers(repeats: int) -> bool:
    from transformers.models.qwen3_next import modeling_qwen3_next

    # The decorated function dispatches to fla's Triton kernel when fla is installed; the peer is the PyTorch body.
    reference = getattr(modeling_qwen3_next.torch_chunk_gated_delta_rule, "__wrapped__",
                        modeling_qwen3_next.torch_chunk_gated_delta_rule)
    x = make_inputs(1, 4096, 4, 64, 64)
    samples = time_rounds({
        "ours": OPS["chunk_gated_delta_rule"](x),
        "theirs": fwd_bwd(lambda q, k, v, g, b: reference(q, k, v, g, b),
                          x["q"], x["k"], x["v"], x["g_head"], x["beta"]),
    }, repeats)
    times = best(samples)
    ours, theirs = times["ours"], times["theirs"]
    ratio = paired_ratio(samples["ours"], samples["theirs"])
    print("## chunk_gated_delta_rule vs transformers' torch_chunk_gated_delta_rule (B=1 T=4096 H=4 K=V=64, fwd+bwd)")
    print(f"rotarium {ours:.3f} s | transformers {theirs:.3f} s | ratio {ratio:.2f} (target <= 0.50) "
          f"{verdict(ratio <= 0.5)}")
    return ratio <= 0.5


def minor_page_faults(call) -> int | None:
    """Fresh pages the process took from the OS during one call (None where the OS does not count them): under glibc's
    defaults, what separates the growth from 4x (the module docstring says why)."""
    try:
        import resource
    except ImportError:
        return None
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    call()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def scaling(lengths: list[int], repeats: int) -> bool:
    inputs = {T: make_inputs(1, T, 4, 64, 64) for T in lengths}
    # Growth: each op in round-robin over its own lengths only, the steady state of a training loop that calls the
    # same ops every step; interleaved with attention's far larger calls, every call would find the allocator's heap
    # in another state.
    calls = {name: {T: make(inputs[T]) for T in lengths} for name, make in OPS.items()}
    samples = {name: time_rounds(calls[name], repeats) for name in OPS}
    times = {name: best(samples[name]) for name in OPS}
    print("\n## forward+backward seconds (best round), B=1 H=4 K=V=64 float32 (PyTorch backend); ratios are medians "
          "of same-round pairs")
    print("| op | " + " | ".join(f"T={T}" for T in lengths) + " | t(16384)/t(4096), default allocator |")
    print("|---|" + "---|" * (len(lengths) + 1))
    has_growth = {4096, 16384} <= set(lengths)
    growth = {name: paired_ratio(samples[name][16384], samples[name][4096]) if has_growth else float("nan")
              for name in OPS}
    for name in OPS:
        print(f"| {name} | " + " | ".join(f"{times[name][T]:.3f}" for T in lengths) + f" | {growth[name]:.2f} |")
    print()
    ok = True
    # Against SDPA: every linear op and SDPA at the same length in the same rounds.
    for T in (T for T in lengths if T >= 8192):
        pairs = time_rounds({name: calls[name][T] for name in (*LINEAR_OPS, "sdpa (causal)")}, repeats)
        for name in LINEAR_OPS:
            ratio = paired_ratio(pairs[name], pairs["sdpa (causal)"])
            ok &= ratio < 1
            print(f"{name}: T={T} time / SDPA {ratio:.2f} (target < 1) {verdict(ratio < 1)}")
    if not has_growth:
        return ok
    print("\ngrowth 4096->16384 with glibc's default allocator (informative: T=4096 reuses freed pages, T=16384 "
          "takes fresh ones from the OS):")
    for name in LINEAR_OPS:
        faults = {T: minor_page_faults(calls[name][T]) for T in (4096, 16384)}
        faulted = "" if None in faults.values() else (
            f"; minor page faults per call {faults[4096]:,} at 4096, {faults[16384]:,} at 16384")
        print(f"{name}: {growth[name]:.2f}x" + faulted)
    # the verdict in a fresh process: a heap already shaped by the calls above is not the policy's steady state
    sys.stdout.flush()
    result = subprocess.run([sys.executable, __file__, "--growth-kept", "--repeats", str(repeats)], check=False)
    return ok and result.returncode == 0


def growth_with_kept_memory(repeats: int) -> bool:
    """The growth verdict, freed memory kept by glibc from this process's start (see common.keep_freed_memory)."""
    kept = keep_freed_memory()
    print("\ngrowth 4096->16384, " + (
        "freed memory kept by the allocator at both lengths (glibc mallopt: no trimming, no mmap below 256 MB; "
        "a process of its own):" if kept else "the allocator as it is (not glibc: its policy was left alone):"))
    torch.manual_seed(0)
    inputs = {T: make_inputs(1, T, 4, 64, 64) for T in (4096, 16384)}
    ok = True
    for name in LINEAR_OPS:
        calls = {T: OPS[name](inputs[T]) for T in (4096, 16384)}
        rounds = time_rounds(calls, repeats)
        ratio = paired_ratio(rounds[16384], rounds[4096])
        ok &= ratio <= 4.5
        faults = minor_page_faults(calls[16384])
        print(f"{name}: growth {ratio:.2f}x (target <= 4.5) {verdict(ratio <= 4.5)}"
              + ("" if faults is None else f"; minor page faults per call at 16384: {faults:,}"))
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--growth-kept", action="store_true", help="only the growth verdict (what the last part runs)")
    args = parser.parse_args()
    if args.growth_kept:
        sys.exit(0 if growth_with_kept_memory(args.repeats) else 1)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    ok = against_transformers(args.repeats)
    ok &= scaling(args.lengths, args.repeats)
    print(f"\nall targets: {verdict(ok)}")


if __name__ == "__main__":
    main()
