"""Runs `rotarium` command lines in one child process, each through the CLI's whole path (argument parsing to the
exit code), and returns each one's exit code and stderr: one process start for many error cases."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A case that raises is recorded as a traceback with code 1, as `python -m rotarium` would end. A case given a
# "skip_if_writable" folder is skipped (None) when the child may write there.
DRIVER = """
import contextlib, io, json, os, sys, traceback
from rotarium.cli import main
cases, out = json.loads(sys.argv[1]), sys.argv[2]
results = {}
for name, case in cases.items():
    if case["skip_if_writable"] and os.access(case["skip_if_writable"], os.W_OK):
        results[name] = None
        continue
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(case["argv"])
        except SystemExit as error:
            code = error.code
        except BaseException:
            traceback.print_exc()
            code = 1
    results[name] = [code, err.getvalue()]
with open(out, "w") as f:
    json.dump(results, f)
"""


def _drop_permission_override() -> None:
    """In the child before exec: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set (prctl
    PR_CAPBSET_DROP), so that a root child obeys file permissions as any user does. Where that is not allowed, the
    child keeps them (and the cases that need it are skipped)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):
        libc.prctl(24, capability, 0, 0, 0)


def run_cli_cases(cases: dict[str, list[str]], folder: Path,
                  skip_if_writable: dict[str, Path] | None = None) -> dict[str, tuple[int, str] | None]:
    """``{name: argv}`` -> ``{name: (exit code, stderr)}``; a case named in ``skip_if_writable`` gets ``None`` when
    the child may write into that folder (permissions are not enforced for it)."""
    skip = {name: str(path) for name, path in (skip_if_writable or {}).items()}
    payload = {name: {"argv": argv, "skip_if_writable": skip.get(name)} for name, argv in cases.items()}
    out = folder / "cli_results.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    env.pop("HF_TOKEN", None)
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(payload), str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False,
                          preexec_fn=_drop_permission_override if skip and os.geteuid() == 0 else None)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return {name: tuple(result) if result is not None else None
            for name, result in json.loads(out.read_text()).items()}


def error_line(result: tuple[int, str] | None, command: str) -> str:
    """The one error line of a case that must stop with exit code 2, after asserting just that; a case that could
    not run (``None``: see ``skip_if_writable``) skips its test."""
    if result is None:
        pytest.skip("the child process may write into a chmod 555 folder: it runs as root and CAP_DAC_OVERRIDE "
                    "could not be dropped")
    code, err = result
    assert code == 2 and "Traceback" not in err, err[-3000:]
    message = err.strip().splitlines()[-1] if err.strip() else ""  # after any progress bar or load report
    assert message.startswith(f"rotarium {command}: error: "), err[-3000:]
    return message
