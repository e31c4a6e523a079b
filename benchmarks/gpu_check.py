"""On a CUDA machine: every op's fla path against the PyTorch path (outputs, final states, gradients) and timings,
then every family x positional option end to end (training loss and gradients, packed documents, cached decoding)
with the ops forced to fla and to PyTorch.

Usage: ``python benchmarks/gpu_check.py [--T 4096] [--repeats 5] [--ops NAME,...] [--dtypes bf16,fp32]
[--families gla,...] [--no-models]``. Exits non-zero when a comparison fails. Every line is printed as soon as it is
measured, so a run cut short by a time limit still reports what it did. On a fresh machine most of the time goes to
compiling and autotuning fla's Triton kernels, once per kernel and shape, so a short lease is best spent on a chosen
subset (``--ops``, ``--families``) per call. CI never runs this (it needs a GPU).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from common import best, paired_ratio, time_rounds, verdict  # beside this script, first on sys.path

from rotarium import ops
from rotarium.layers import POSITION_ENCODINGS
from rotarium.models import CONFIGS, FAMILY_MODELS
from rotarium.ops.backend import ENV_VAR


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
    "parallel_attn": (lambda x, be: ops.parallel_forgetting_attn(x["q"], x["k"], x["v"], backend=be),
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


def model_checks(tol: float, families: list[str], dev: str = "cuda") -> bool:
    """Tiny models of every family x positional option under bf16 autocast (how they train on a GPU), ops forced to
    fla and then to PyTorch: loss and gradients of a batch, loss of packed documents, and on the fla path a prefill
    followed by token-by-token decoding against the full forward's logits."""
    ok = True
    for family in families:
        for encoding in POSITION_ENCODINGS:
            config = CONFIGS[family](vocab_size=512, hidden_size=256, num_hidden_layers=2, num_heads=4,
                                     intermediate_size=512, position_encoding=encoding, bos_token_id=None,
                                     eos_token_id=None)
            torch.manual_seed(0)
            model = FAMILY_MODELS[family].lm(config).to(dev)
            ids = torch.randint(0, 512, (2, 300), device=dev)  # past several chunks, not a multiple of 64
            packed = torch.randint(0, 512, (1, 300), device=dev)
            cu_seqlens = torch.tensor([0, 70, 71, 230, 300], device=dev)

            def run(backend: str, model=model, ids=ids, packed=packed, cu_seqlens=cu_seqlens, dev=dev):
                os.environ[ENV_VAR] = backend
                model.train().zero_grad(set_to_none=True)
                with torch.autocast(dev, dtype=torch.bfloat16):
                    loss = model(ids, labels=ids).loss
                loss.backward()  # outside autocast, as accelerate runs it
                with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16):
                    packed_loss = model(packed, labels=packed, cu_seqlens=cu_seqlens).loss
                grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
                return loss.float(), grads, packed_loss.float()

            def decoding(model=model, ids=ids, dev=dev):
                os.environ[ENV_VAR] = "fla"
                model.eval()
                with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16):
                    full = model(ids[:, :140]).logits[:, 130:].float()
                    out = model(ids[:, :130], use_cache=True)
                    steps, cache = [], out.past_key_values
                    for t in range(130, 140):
                        out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
                        steps.append(out.logits.float())
                        cache = out.past_key_values
                return rel_err(torch.cat(steps, 1), full)

            def compare(family=family, encoding=encoding, run=run, decoding=decoding):
                (loss_f, grads_f, packed_f), (loss_t, grads_t, packed_t) = run("fla"), run("torch")
                errs = {"loss": rel_err(loss_f, loss_t), "grads": rel_err(grads_f, grads_t),
                        "packed loss": rel_err(packed_f, packed_t), "decode vs full (fla)": decoding()}
                return report(f"{family} + {encoding}", errs, tol)

            ok &= guarded(f"{family} + {encoding}", compare)
    os.environ.pop(ENV_VAR, None)
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-models", action="store_true", help="only the ops")
    parser.add_argument("--ops", default=",".join(CASES), help="comma-separated ops to compare and time (or none)")
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma-separated op dtypes: bf16, fp32")
    parser.add_argument("--families", default=",".join(CONFIGS), help="comma-separated model families")
    args = parser.parse_args()
    chosen = [name for name in args.ops.split(",") if name and name != "none"]
    unknown = sorted(set(chosen) - set(CASES)) + sorted(set(args.families.split(",")) - set(CONFIGS))
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    unknown += sorted(set(args.dtypes.split(",")) - set(dtypes))
    if unknown:
        parser.error(f"unknown names {unknown}; ops: {list(CASES)}, families: {list(CONFIGS)}, dtypes: {list(dtypes)}")
    cases = {name: CASES[name] for name in chosen}
    sys.stdout.reconfigure(line_buffering=True)  # a run cut short by its time limit keeps every line it printed
    assert torch.cuda.is_available() and ops.fla_available(), "needs a CUDA GPU with fla and triton"
    import fla

    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} fla {getattr(fla, '__version__', '?')}")
    ok = True
    for dtype in (dtypes[name] for name in args.dtypes.split(",")):
        x = inputs(2, 1000, 4, 64, 64, dtype)  # T not a multiple of 64 on purpose
        print(f"\n## fla vs torch path, dtype {dtype}, B=2 T=1000 H=4 K=V=64 (relative L2 errors)")
        if dtype == torch.float32:
            print("(fla's chunked delta-rule kernels reject float32: rotarium runs its PyTorch path for both sides)")
        tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
        for name, (fn, grads) in cases.items():
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
    for name, (fn, grads) in cases.items():
        def timing(name=name, fn=fn, grads=grads):
            samples = time_rounds({backend: lambda backend=backend: run_case(fn, x, grads, backend)
                                   for backend in ("fla", "torch")}, args.repeats)
            times = best(samples)
            print(f"{name}: fla {times['fla'] * 1e3:.2f} ms | torch {times['torch'] * 1e3:.2f} ms | "
                  f"torch/fla {paired_ratio(samples['torch'], samples['fla']):.1f}x")
            return True
        ok &= guarded(name, timing)
    if not args.no_models:
        print("\n## models, bf16 autocast, fla vs torch (relative L2 errors; d=256, 2 layers, T=300)")
        ok &= model_checks(tol=5e-2, families=args.families.split(","))
    print(f"\nall comparisons: {verdict(ok)}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
