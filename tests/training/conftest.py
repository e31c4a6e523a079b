from pathlib import Path

import pytest

from tests.training.helpers import cli_args, ok, run_child


@pytest.fixture(scope="session")
def reference(corpus, tmp_path_factory) -> Path:
    """An uninterrupted 12-step run."""
    run_dir = tmp_path_factory.mktemp("runs") / "reference"
    ok(run_child(["train", "--output-dir", str(run_dir), *cli_args(corpus)]))
    return run_dir


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one precision per process: a run in another precision (a bf16 run; TRL's trainers, whose
    configs default to bf16) needs the state reset before and after, for the float32 runs of the tests that follow
    in this process."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
