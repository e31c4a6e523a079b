import os

import pytest
import torch

# Under pytest-xdist every worker gets one thread: with more threads than cores the workers' threads fight, and the
# step-by-step oracles, which run many tiny ops, slow down most.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
