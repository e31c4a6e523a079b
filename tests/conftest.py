import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Under pytest-xdist every worker gets one thread: with more threads than cores the workers' threads fight, and the
# step-by-step oracles, which run many tiny ops, slow down most.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


# The programs whose start makes a test `slow`: a Python interpreter and the launchers that start one.
INTERPRETERS = ("python", "rotarium", "accelerate", "torchrun")


def pytest_collection_modifyitems(items):
    """The tests marked slow run first, each kind in its order (a stable sort): under `make test`'s two workers the
    long ones start early and the many short ones fill the end, so neither worker is left alone with a long test.
    (`--dist loadgroup` hands out the xdist groups before any of these.)"""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A local text file of 40 documents of the embedded corpus (documents separated by two blank lines)."""
    from rotarium.data.documents import embedded_documents

    path = tmp_path_factory.mktemp("corpus") / "docs.txt"
    path.write_text("\n\n\n".join(embedded_documents()[:40]))
    return path


def _starts_an_interpreter(args) -> bool:
    if isinstance(args, (str, bytes)):
        args = os.fsdecode(args).split()[:1]
    elif isinstance(args, os.PathLike):
        args = [args]
    program = os.fsdecode(next(iter(args), ""))
    return program == sys.executable or Path(program).name.startswith(INTERPRETERS)


@contextlib.contextmanager
def _interpreters_refused(item: pytest.Item):
    """`make test-fast` selects by the `slow` mark: a test that starts a child interpreter without it fails here, with
    its fixtures, rather than slowing the fast lane unnoticed."""
    if item.get_closest_marker("slow") is not None:
        yield
        return
    original = subprocess.Popen.__init__

    def refuse(self, args, *rest, **kwargs):
        if _starts_an_interpreter(args):
            self._child_created, self.args, self.returncode = False, args, None  # what __del__ and repr read
            raise AssertionError(f"{item.nodeid} starts {args!r}: mark it @pytest.mark.slow")
        original(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = refuse
    try:
        yield
    finally:
        subprocess.Popen.__init__ = original


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _interpreters_refused(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _interpreters_refused(item):
        return (yield)
