"""On a CUDA machine: every op's fla path against the PyTorch path (outputs, final states, gradients) and timings.

Usage: ``python benchmarks/gpu_check.py [--T 4096] [--repeats 5]``. Exits non-zero when a comparison fails.
CI never runs this (it needs a GPU).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import best, paired_ratio, time_rounds, verdict  # noqa: E402

import rotarium.ops as ops  # noqa: E402


def inputs(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    dev = "cuda"
    return {
        "q": torch.randn(B, T, H, K, device=dev, dtype=dtype),
        "k": F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(dtype),
        "v": torch.randn(B, T, H, V, device=dev, dtype=dtype),
        "g_channel": (F.logsigmoid(torch.randn(B, T, H, K, device=dev) + 3) / 16),
        "g_head": F.logsigmoid(torch.randn(B, T, H, device=dev) + 3),
        "beta": torch.rand(B, T, H, device=dev).to(dtype),
        "h0": torch.randn(B, H, K, V, device=dev) * 0.1,
    }


CASES = {
    "chunk_gla": (lambda x, be: ops.chunk_gla(x["q"], x["k"], x["v"], x["g_channel"], initial_state=x["h0"],
                                              output_final_state=True, backend=be), ("q", "k", "v", "g_channel", "h0")),
    "chunk_delta_rule": (lambda x, be: ops.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], initial_state=x["h0"],
                                                            output_final_state=True, backend=be),
                         ("q", "k", "v", "beta", "h0")),
    "chunk_gated_delta_rule": (lambda x, be: ops.chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g_head"], x["beta"], initial_state=x["h0"], output_final_state=True, backend=be),
        ("q", "k", "v", "g_head", "beta", "h0")),
    "parallel_forgetting_attn": (lambda x, be: ops.parallel_forgetting_attn(x["q"], x["k"], x["v"], x["g_head"],
                                                                            backend=be), ("q", "k", "v", "g_head")),
    "parallel_attn (g=None)": (lambda x, be: ops.parallel_forgetting_attn(x["q"], x["k"], x["v"], backend=be),
                               ("q", "k", "v")),
}


# Decoding: a few new tokens continuing from a state (inference, so outputs and final states only).
DECODING = {
    "fused_recurrent_gla": lambda x, be: ops.fused_recurrent_gla(
        x["q"], x["k"], x["v"], gk=x["g_channel"], initial_state=x["h0"], output_final_state=True, backend=be),
    "fused_recurrent_delta_rule": lambda x, be: ops.fused_recurrent_delta_rule(
        x["q"], x["k"], x["v"], x["beta"], initial_state=x["h0"], output_final_state=True, backend=be),
    "fused_recurrent_gated_delta_rule": lambda x, be: ops.fused_recurrent_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g_head"], x["beta"], initial_state=x["h0"], output_final_state=True, backend=be),
}


def run_case(fn, x: dict[str, torch.Tensor], grad_names: tuple[str, ...], backend: str):
    leaves = {n: t.detach().clone().requires_grad_(n in grad_names) for n, t in x.items()}
    out = fn(leaves, backend)
    o, state = out if isinstance(out, tuple) else (out, None)
    loss = o.float().square().mean() + (state.square().mean() if state is not None else 0)
    loss.backward()
    return o.float(), state, {n: leaves[n].grad.float() for n in grad_names}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def guarded(name: str, check) -> bool:
    """Runs one comparison; an exception (a kernel that rejects a dtype or shape) fails it without ending the run,
    so one launch on a lent machine reports every op."""
    try:
        return check()
    except Exception as error:  # noqa: BLE001 - reported, counted as a failure, and the next op still runs
        print(f"{name}: ERROR {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}  FAIL")
        return False


def report(name: str, errs: dict[str, float], tol: float) -> bool:
    """Prints one comparison's relative errors; whether all are under ``tol``."""
    good = all(e < tol for e in errs.values())
    print(f"{name}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()) + f"  {verdict(good)}")
    return good


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    assert torch.cuda.is_available() and ops.fla_available(), "needs a CUDA GPU with fla and triton"
    import fla

    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} fla {getattr(fla, '__version__', '?')}")
    ok = True
    for dtype in (torch.bfloat16, torch.float32):
        x = inputs(2, 1000, 4, 64, 64, dtype)  # T not a multiple of 64 on purpose
        print(f"\n## fla vs torch path, dtype {dtype}, B=2 T=1000 H=4 K=V=64 (relative L2 errors)")
        if dtype == torch.float32:
            print("(fla's chunked delta-rule kernels reject float32: rotarium runs its PyTorch path for both sides)")
        tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
        for name, (fn, grads) in CASES.items():
            def compare(name=name, fn=fn, grads=grads, x=x, tol=tol):
                of, sf, gf = run_case(fn, x, grads, "fla")
                ot, st, gt = run_case(fn, x, grads, "torch")
                errs = {"o": rel_err(of, ot)} | ({"state": rel_err(sf, st)} if sf is not None else {})
                errs |= {f"d{n}": rel_err(gf[n], gt[n]) for n in grads}
                return report(name, errs, tol)
            ok &= guarded(name, compare)
        steps = inputs(2, 8, 4, 64, 64, dtype)
        print(f"decoding 8 tokens from a state, dtype {dtype}:")
        with torch.no_grad():
            for name, fn in DECODING.items():
                def compare_decoding(name=name, fn=fn, steps=steps, tol=tol):
                    (of, sf), (ot, st) = fn(steps, "fla"), fn(steps, "torch")
                    return report(name, {"o": rel_err(of.float(), ot.float()),
                                         "state": rel_err(sf.float(), st.float())}, tol)
                ok &= guarded(name, compare_decoding)

    print(f"\n## fwd+bwd ms, bf16, B=1 T={args.T} H=4 K=V=64")
    x = inputs(1, args.T, 4, 64, 64, torch.bfloat16)
    for name, (fn, grads) in CASES.items():
        def timing(name=name, fn=fn, grads=grads):
            samples = time_rounds({backend: lambda backend=backend: run_case(fn, x, grads, backend)
                                   for backend in ("fla", "torch")}, args.repeats)
            times = best(samples)
            print(f"{name}: fla {times['fla'] * 1e3:.2f} ms | torch {times['torch'] * 1e3:.2f} ms | "
                  f"torch/fla {paired_ratio(samples['torch'], samples['fla']):.1f}x")
            return True
        ok &= guarded(name, timing)
    print(f"\nall comparisons: {verdict(ok)}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
