from pathlib import Path

import pytest

from tests.training.helpers import cli_args, ok, run_child


@pytest.fixture(scope="session")
def reference(corpus, tmp_path_factory) -> Path:
    """An uninterrupted 12-step run."""
    run_dir = tmp_path_factory.mktemp("runs") / "reference"
    ok(run_child(["train", "--output-dir", str(run_dir), *cli_args(corpus)]))
    return run_dir
