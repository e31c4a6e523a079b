"""benchmarks/common.py: the timing helpers the benchmark scripts share."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from tests.models.helpers import tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def common(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("common")


@pytest.mark.parametrize("name", ["gla", "llama"])
def test_every_decoding_call_starts_from_the_same_prefill(common, name):
    """A round decodes after the prefill's context, not after the tokens the calls before it decoded: each round
    times the same work."""
    model = tiny_model("gla", "rope") if name == "gla" else LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=61)).eval()
    context, steps = 6, 2
    lengths = []  # the cached tokens at each one-token forward

    def record(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 1:
            lengths.append((kwargs.get("cache") or kwargs.get("past_key_values")).get_seq_length())

    model.register_forward_pre_hook(record, with_kwargs=True)
    common.time_rounds({name: common.Decoder(model, context, steps)}, repeats=3, warmup=1)
    assert lengths == [context, context + 1] * 4
