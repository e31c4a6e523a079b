import os
from pathlib import Path

import pytest
import torch

# Under pytest-xdist every worker gets one thread: with more threads than cores the workers' threads fight, and the
# step-by-step oracles, which run many tiny ops, slow down most.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


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
