"""What the tests of training runs share: a tiny run's settings as command-line arguments, a `rotarium` child process
that can be killed at a chosen step, and readers of what a run wrote."""
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A model and run small enough for a test to train in seconds on one thread.
TINY = {
    "model.hidden_size": 32, "model.num_hidden_layers": 2, "model.num_heads": 2, "model.intermediate_size": 64,
    "data.seq_len": 32, "data.validation_fraction": 0.2, "tokenizer.vocab_size": 320, "train.batch_size": 4,
    "train.max_steps": 12, "train.eval_every": 6, "train.eval_batches": 2, "train.save_every": 6,
    "train.log_every": 1, "train.num_threads": 1, "optim.warmup_steps": 2, "optim.lr": 1e-2,
    "eval.run_after": False,
}


def cli_args(corpus: Path, **overrides) -> list[str]:
    values = {**TINY, "data.source": str(corpus), **{k.replace("__", "."): v for k, v in overrides.items()}}
    out = []
    for key, value in values.items():
        out += [f"--{key}", json.dumps(value) if not isinstance(value, str) else value]
    return out


# Runs `rotarium ...` in a child process; `kill_at_step` SIGKILLs it from inside right after that optimizer step,
# `kill_in_save` right after the accelerate state of that checkpoint number (1, 2, ...) is written.
CHILD = """
import os, signal, sys
import torch
kill_at_step = int(os.environ.get("KILL_AT_STEP", "0"))
kill_in_save = int(os.environ.get("KILL_IN_SAVE", "0"))
if kill_at_step:
    original_step = torch.optim.AdamW.step
    count = [0]
    def step(self, *args, **kwargs):
        out = original_step(self, *args, **kwargs)
        count[0] += 1
        if count[0] == kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    torch.optim.AdamW.step = step
if kill_in_save:
    from rotarium.training import trainer
    original_save = trainer.Trainer._save_model
    saves = [0]
    def save_model(self, folder):
        saves[0] += 1
        if saves[0] == kill_in_save and folder.name.startswith(".step"):
            original_save(self, folder)
            os.kill(os.getpid(), signal.SIGKILL)
        return original_save(self, folder)
    trainer.Trainer._save_model = save_model
from rotarium.cli import main
sys.exit(main(sys.argv[1:]))
"""


@functools.cache
def child_script() -> Path:
    """CHILD as a file, for launchers that take a script (accelerate launch)."""
    path = Path(tempfile.mkdtemp(prefix="rotarium-child-")) / "child.py"
    path.write_text(CHILD)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_config(name: str) -> str:
    return str(ROOT / "rotarium" / "configs" / "accelerate" / name)


def run_child(args: list[str], *, kill_at_step: int = 0, kill_in_save: int = 0, launch: list[str] | None = None,
              timeout: int = 300) -> subprocess.CompletedProcess:
    """``launch``: run under ``accelerate launch`` with these arguments (a config file, process counts); each launch
    gets its own rendezvous port unless the arguments give one, so that tests in parallel do not meet."""
    env = {**os.environ, "KILL_AT_STEP": str(kill_at_step), "KILL_IN_SAVE": str(kill_in_save),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    if launch is None:
        command = [sys.executable, "-c", CHILD, *args]
    else:
        port = [] if "--main_process_port" in launch else ["--main_process_port", str(free_port())]
        command = [sys.executable, "-m", "accelerate.commands.launch", "--num_cpu_threads_per_process", "1",
                   *port, *launch, str(child_script()), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          check=False)


def losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if key in record:
            out[record["step"]] = record[key]
    return out


def ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


def scale_losses(monkeypatch, factor) -> None:
    """Makes the training loss of the n-th step (from 1) the model's loss times ``factor(n)`` (a spike, a NaN)."""
    from rotarium.models import RotariumForCausalLM

    original = RotariumForCausalLM.forward
    calls = [0]

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.training:
            calls[0] += 1
            out.loss = out.loss * factor(calls[0])
        return out

    monkeypatch.setattr(RotariumForCausalLM, "forward", forward)
