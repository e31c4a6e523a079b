"""The FLOPs-per-token estimate of each family against a count by hand for a tiny model (width 32, 2 layers of 2
heads, MLP 64, vocabulary 320, no positional option), the peak table, and the throughput a run logs."""
import json
import time
import types

import pytest

import rotarium  # noqa: F401  (registers the model types)
from rotarium.layers import SoftmaxAttention
from rotarium.models import MIXERS
from rotarium.models.configuration import CONFIGS
from rotarium.models.modeling import FAMILY_MODELS
from rotarium.training.flops import flops_per_token, peak_flops, weight_parameters
from rotarium.training.state import LoopCounters
from rotarium.training.trainer import StepResult, Trainer

D, L, H, I, VOCAB, T, C = 32, 2, 2, 64, 320, 32, 64  # C: the chunk of the linear kernels
MLP_AND_NORMS = 3 * D * I + 2 * D  # SwiGLU's three matrices and the block's two norms
OUTSIDE = D + VOCAB * D  # the final norm and the untied output layer (the input embedding is not counted)

# N by hand, a layer's mixer at a time
TRANSFORMER_MIXER = 4 * D * D  # q, k, v, o
FOX_MIXER = TRANSFORMER_MIXER + D * H + H  # and the forget gate's projection with its bias
GLA_MIXER = (2 * D * 16 + D * D  # q and k to K = 0.5 x 32, v to 32
             + (16 + 16 + 32) * 4  # short convolutions of width 4 on q, k, v
             + D * 16 + 16 * 16 + 16  # the gate's low-rank projection (rank 16) with its bias
             + D * D + 16 + D * D)  # the output gate, the per-head norm (V = 16), the output projection
DELTANET_MIXER = 3 * D * D + 3 * D * 4 + D * H + 16 + D * D  # q k v, their convolutions, beta, the norm, output

# the mixers' own work, forward, per token and layer (flops.py's docstring)
ATTENTION = 4 * H * (D // H) * T  # scores and values: 2 x Q each per query head and context position
GLA = H * (4 * 8 * 16 + 2 * C * (8 + 16))  # K = 8, V = 16 per head
DELTANET = H * (6 * 16 * 16 + 6 * C * 16 + 4 * C * 16 + 2 * C * C // 3)  # K = V = 16 per head

HAND = {  # family: (N, forward work of one layer's mixer); a family missing here fails its test
    "transformer": (L * (TRANSFORMER_MIXER + MLP_AND_NORMS) + OUTSIDE, ATTENTION),
    "fox": (L * (FOX_MIXER + MLP_AND_NORMS) + OUTSIDE, ATTENTION),
    "gla": (L * (GLA_MIXER + MLP_AND_NORMS) + OUTSIDE, GLA),
    "deltanet": (L * (DELTANET_MIXER + MLP_AND_NORMS) + OUTSIDE, DELTANET),
}


def _tiny(family):
    config = CONFIGS[family](hidden_size=D, num_hidden_layers=L, num_heads=H, intermediate_size=I, vocab_size=VOCAB,
                             position_encoding="nope")
    return FAMILY_MODELS[config.family].lm(config)


@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_flops_per_token_is_the_hand_count(family):
    model = _tiny(family)
    n, mixer = HAND[family]
    assert weight_parameters(model) == n
    assert flops_per_token(model, T) == 6 * n + 3 * L * mixer


def test_only_softmax_attention_grows_with_the_sequence():
    for family, mixer in MIXERS.items():
        model = _tiny(family)
        grows = flops_per_token(model, 2 * T) - flops_per_token(model, T)
        assert grows == (3 * L * ATTENTION if issubclass(mixer, SoftmaxAttention) else 0)


def test_a_tied_output_layer_is_counted():
    config = CONFIGS["transformer"](hidden_size=D, num_hidden_layers=L, num_heads=H, intermediate_size=I,
                                    vocab_size=VOCAB, tie_word_embeddings=True)
    model = FAMILY_MODELS["transformer"].lm(config)
    assert weight_parameters(model) == sum(p.numel() for p in model.parameters())


def test_peak_flops_of_known_gpus_and_none_else():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("NVIDIA H100 NVL") == 835e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12 and peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA GeForce RTX 3090") is None


def _log_step(monkeypatch, peak, updated=None):
    """``Trainer.log_step``'s record for a window of 2 steps of 1000 tokens that took 0.5 s, on 4 processes
    (``updated``: the losses of the steps that updated the weights, all of them by default)."""
    logged, postfix = [], {}
    trainer = types.SimpleNamespace(
        _window=[2.0, 2.0] if updated is None else updated, _window_start=0.0, tokens_per_step=1000,
        counters=LoopCounters(tokens=2000), _data_wait=0.0,
        _window_steps=2, flops_per_token=1e6, peak_flops=peak, accelerator=types.SimpleNamespace(num_processes=4),
        _bar=types.SimpleNamespace(set_postfix=lambda **kw: postfix.update(kw)), _log=logged.append)
    monkeypatch.setattr(time, "perf_counter", lambda: 0.5)
    Trainer.log_step(trainer, 2, StepResult(2.0, 1.0, 1e-3, True))
    monkeypatch.undo()
    return logged[0], postfix


def test_the_record_has_flops_per_second_and_on_a_known_gpu_the_utilisation(monkeypatch):
    record, postfix = _log_step(monkeypatch, None)
    assert record["tokens_per_second"] == 4000 and record["flops_per_second"] == 4e9
    assert "mfu" not in record and postfix["flops"] == "4.00G"
    record, postfix = _log_step(monkeypatch, 1e10)  # 4 processes of 1e10 FLOP/s each
    assert record["mfu"] == pytest.approx(0.1) and postfix["mfu"] == "10.0%" and "flops" not in postfix


def test_a_skipped_step_counts_in_the_throughput(monkeypatch):
    """A step skipped for a non-finite loss read its tokens and took its time like any other: the throughput
    counts it (the loss averages only the steps that updated the weights)."""
    record, _ = _log_step(monkeypatch, None, updated=[2.0])
    assert record["tokens_per_second"] == 4000 and record["loss"] == 2.0


@pytest.mark.slow
def test_a_cpu_run_logs_its_flops_per_second_without_a_utilisation(reference):
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    start = records[0]
    assert start["event"] == "start" and start["flops_per_token"] > 0 and start["peak_flops_per_process"] is None
    steps = [r for r in records if "loss" in r]
    assert steps and all(r["flops_per_second"] == pytest.approx(start["flops_per_token"] * r["tokens_per_second"])
                         for r in steps)
    assert not any("mfu" in r for r in records)
