"""`rotarium eval` and `rotarium generate` check the device before loading a model, and load bfloat16 on CUDA unless
told otherwise."""
from __future__ import annotations

import argparse

import pytest
import torch

from rotarium.evaluation import cli as eval_cli
from tests.cli_cases import error_line, run_cli_cases


@pytest.mark.slow
def test_eval_and_generate_check_the_device_before_loading(tmp_path):
    results = run_cli_cases({
        "eval": ["eval", "--model", str(tmp_path), "--device", "cuda:7"],
        "generate": ["generate", "--model", str(tmp_path), "--prompt", "hi", "--device", "tpu"],
    }, tmp_path)
    assert "--device cuda:7" in error_line(results["eval"], "eval")
    assert "--device 'tpu' is not a device" in error_line(results["generate"], "generate")



@pytest.mark.parametrize(("device", "requested", "expected"), [
    ("cuda", "auto", torch.bfloat16), ("cpu", "auto", torch.float32), ("cuda", "float32", torch.float32),
])
def test_evaluation_loads_bfloat16_on_cuda_by_default(device, requested, expected, monkeypatch):
    """Evaluation has no autocast: in float32 on a GPU the delta rule would run on the PyTorch path."""
    loaded = {}
    monkeypatch.setattr("rotarium.evaluation.generate.load_checkpoint",
                        lambda path, device=None, dtype=None: loaded.update(device=device, dtype=dtype))
    eval_cli.load_for(argparse.Namespace(model="m", device=device, dtype=requested))
    assert loaded == {"device": device, "dtype": expected}
