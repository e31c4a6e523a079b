"""Training throughput of `rotarium train` itself, in one process and in two (DDP over gloo), every number from one
run.

Each measurement is a real ``rotarium train`` child process on the embedded default config (d=256, 4 layers,
seq_len 128, batch 16 sequences per process, the embedded corpus), only shortened: ``--max-steps``, no evaluation
or checkpoint inside the loop, no evaluation after. Tokens per second are read from the run's ``metrics.jsonl``
(global: every process's tokens), over every logged window but the first (warm-up). One process runs 2 threads;
two processes (``accelerate launch --num_processes 2 --num_cpu_threads_per_process 1`` with
``rotarium/configs/accelerate/ddp_cpu.yaml``) run 1 thread each, so both use two cores.

``python benchmarks/train.py [--position selective_rope] [--steps 24] [--log-every 4] [--families gla fox ...]``
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rotarium.models import FAMILY_MODELS

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE_CONFIG = ROOT / "rotarium" / "configs" / "accelerate" / "ddp_cpu.yaml"
FAMILIES = tuple(FAMILY_MODELS)
NEVER = str(10 ** 9)  # an eval / save interval past the last step


def train_args(family: str, args, run_dir: Path, threads: int) -> list[str]:
    return ["train", "--output-dir", str(run_dir), "--max-steps", str(args.steps),
            "--train.log_every", str(args.log_every), "--train.eval_every", NEVER, "--train.save_every", NEVER,
            "--train.eval_batches", "1", "--eval.run_after", "false", "--train.num_threads", str(threads),
            "--model.family", family, "--model.position_encoding", args.position]


def command(family: str, processes: int, args, run_dir: Path) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    if processes == 1:
        env["OMP_NUM_THREADS"] = "2"
        return [sys.executable, "-m", "rotarium", *train_args(family, args, run_dir, 2)], env
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIG),
              "--num_processes", str(processes), "--num_cpu_threads_per_process", "1", "-m", "rotarium"]
    return [*launch, *train_args(family, args, run_dir, 1)], env


def measured_throughput(metrics: Path) -> tuple[float, list[float]]:
    """(tokens / seconds over every logged window but the first, each window's tokens/s)."""
    windows, previous = [], 0
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if "tokens_per_second" in record:
            tokens = record["tokens"] - previous
            previous = record["tokens"]
            windows.append((tokens, tokens / record["tokens_per_second"], record["tokens_per_second"]))
    measured = windows[1:]
    if not measured:
        raise RuntimeError(f"{metrics}: fewer than 2 logged windows; raise --steps or lower --log-every")
    return sum(w[0] for w in measured) / sum(w[1] for w in measured), [w[2] for w in measured]


def run(family: str, processes: int, args) -> float | None:
    run_dir = Path(tempfile.mkdtemp(prefix=f"rotarium-bench-{family}-{processes}p-"))
    try:
        cmd, env = command(family, processes, args, run_dir / "run")
        start = time.perf_counter()
        result = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout,
                                check=False)
        wall = time.perf_counter() - start
        if result.returncode != 0:
            print(f"{family} {processes}p: FAILED (return code {result.returncode})\n{result.stderr[-3000:]}")
            return None
        tps, windows = measured_throughput(run_dir / "run" / "metrics.jsonl")
        print(f"{family} {processes}p: {tps:,.0f} tokens/s (windows after warm-up: "
              f"{', '.join(f'{w:,.0f}' for w in windows)}; {wall:.0f} s wall in all)", flush=True)
        return tps
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--position", default="selective_rope", help="model.position_encoding for every family")
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps per run")
    parser.add_argument("--log-every", type=int, default=4, help="steps per logged window (the first is dropped)")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--timeout", type=int, default=900, help="seconds allowed to one run")
    args = parser.parse_args()
    if args.steps < 2 * args.log_every:
        parser.error("--steps must be at least 2 x --log-every (the first window is warm-up)")

    from rotarium.training.config import load_config

    c = load_config()
    print(f"rotarium train, embedded default: d={c.model.hidden_size} layers={c.model.num_hidden_layers} "
          f"heads={c.model.num_heads} seq_len={c.data.seq_len} batch={c.train.batch_size} per process, "
          f"position={args.position}, {args.steps} steps, tokens/s over windows of {args.log_every} steps after the "
          f"first")
    print(f"threads: 1 process x 2 threads (--train.num_threads 2, OMP_NUM_THREADS=2) against 2 processes x 1 thread "
          f"(accelerate launch --num_processes 2 --num_cpu_threads_per_process 1, {ACCELERATE_CONFIG.name}); "
          f"this machine has {os.cpu_count()} CPUs")
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: load average {load:.1f} before starting: other processes share the CPUs, numbers are noisy")

    start = time.perf_counter()
    results = {family: {p: run(family, p, args) for p in (1, 2)} for family in args.families}
    print(f"\n{time.perf_counter() - start:.0f} s in all; load average now {os.getloadavg()[0]:.1f}\n")
    print("| family | 1 process tok/s | 2 processes tok/s | ratio 2p/1p |")
    print("|---|---|---|---|")
    for family, r in results.items():
        one, two = r[1], r[2]
        ratio = f"{two / one:.2f}" if one and two else "-"
        print(f"| {family} | {f'{one:,.0f}' if one else 'failed'} | {f'{two:,.0f}' if two else 'failed'} | {ratio} |")


if __name__ == "__main__":
    main()
