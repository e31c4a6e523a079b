import os

import pytest
import torch

# Under pytest-xdist every worker gets one thread: two workers x two threads on two cores thrash, and the
# step-by-step oracles slow down by an order of magnitude when threads fight.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
