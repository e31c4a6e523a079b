"""A run holds an exclusive lock on its folder for its lifetime: a second `rotarium train` on the same --output-dir
stops at once (exit 2) naming the holder, without touching the first run's files; the lock goes away with its
process however that ends, so a lock left by a killed run is taken over."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from rotarium.cli import main
from rotarium.training.lock import LOCK, RunLock, RunLocked
from tests.training.helpers import ROOT, cli_args, run_child

# A `rotarium train` child that, inside its first training step, writes `<run>.started` and waits for `<run>.go`.
HELD = """
import os, sys, time
from pathlib import Path
from rotarium.training import trainer
run = Path(sys.argv[sys.argv.index("--output-dir") + 1])
original = trainer.Trainer.train_step
def step(self, *args):
    Path(f"{run}.started").write_text(str(os.getpid()))
    while not Path(f"{run}.go").exists():
        time.sleep(0.05)
    return original(self, *args)
trainer.Trainer.train_step = step
from rotarium.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_second_run_on_the_same_folder_stops_at_once_naming_the_holder(corpus, tmp_path):
    run_dir = tmp_path / "run"
    args = ["train", "--output-dir", str(run_dir), *cli_args(corpus, train__max_steps=2, train__save_every=1,
                                                             train__eval_every=2)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen([sys.executable, "-c", HELD, *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "run.started").exists():
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the first run never reached its first step"
            time.sleep(0.1)
        metrics_before = (run_dir / "metrics.jsonl").read_text()
        second = run_child(args)
        assert second.returncode == 2, second.stderr[-3000:]
        message = second.stderr.strip().splitlines()[-1]
        assert message.startswith("rotarium train: error: --output-dir"), message
        assert f"PID {first.pid}" in message and socket.gethostname() in message and "started 20" in message, message
        assert (run_dir / "metrics.jsonl").read_text() == metrics_before  # the second run wrote nothing
        assert not (run_dir / "checkpoints").exists()
    finally:
        (tmp_path / "run.go").write_text("")
        _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-1"]
    assert not (run_dir / LOCK).exists()  # released at the end


def test_a_held_lock_names_its_holder_and_is_released(tmp_path):
    lock = RunLock(tmp_path / "run")
    try:
        with pytest.raises(RunLocked, match=f"PID {os.getpid()} on host {socket.gethostname()}, started "):
            RunLock(tmp_path / "run")
        code = main(["train", "--output-dir", str(tmp_path / "run"), "--eval.run_after", "false"])
        assert code == 2
    finally:
        lock.release()
    assert not (tmp_path / "run").exists()  # the lock made the folder and nothing else was written
    RunLock(tmp_path / "run").release()


@pytest.mark.slow
def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK).write_text(f'{{"host": "{socket.gethostname()}", "pid": {dead.stdout.strip()}, '
                                '"started": "2020-01-01T00:00:00+00:00"}\n')
    lock = RunLock(run_dir)
    assert lock.holder["pid"] == os.getpid()
    lock.release()
    assert not (run_dir / LOCK).exists() and run_dir.is_dir()


def test_a_failed_start_releases_the_lock(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["train", "--output-dir", str(run_dir), "--data.source", str(tmp_path / "typo.txt")])
    assert code == 2 and "typo.txt" in capsys.readouterr().err
    assert not run_dir.exists()  # nothing left behind: no lock file, no empty folder
    RunLock(run_dir).release()


@pytest.mark.slow
def test_without_file_locks_the_holder_pid_and_host_decide(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = RunLock(tmp_path / "run")  # a live holder: this process
    with pytest.raises(RunLocked, match=f"PID {os.getpid()} .* no file locks"):
        RunLock(tmp_path / "run")
    lock.release()
    (tmp_path / "dead").mkdir()
    test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path / "dead")


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_a_lock_held_only_by_the_orphans_of_a_dead_run_is_taken_over(tmp_path):
    """A killed run's DataLoader workers live on for a few seconds holding the lock's descriptor, which they
    inherited: the recorded holder (the run's main process) is dead, so the lock is stale."""
    import fcntl

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    orphan = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT)  # the descriptor a worker inherited, still locked
    fcntl.flock(orphan, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(orphan, f'{{"host": "{socket.gethostname()}", "pid": {_dead_pid()}, "started": "x"}}\n'.encode())
    try:
        lock = RunLock(run_dir)
        assert lock.holder["pid"] == os.getpid()
        with pytest.raises(RunLocked, match=f"PID {os.getpid()} "):  # and the new lock holds
            RunLock(run_dir)
        lock.release()
    finally:
        os.close(orphan)
    # a live holder's lock is still refused
    live = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(live, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(live, f'{{"host": "{socket.gethostname()}", "pid": {os.getppid()}, "started": "x"}}\n'.encode())
    try:
        with pytest.raises(RunLocked, match=f"PID {os.getppid()} "):
            RunLock(run_dir)
    finally:
        os.close(live)
