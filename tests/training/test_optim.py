import itertools
import math

import pytest

import rotarium
from rotarium.training.config import Config
from rotarium.training.optim import lr_multiplier, parameter_groups


def _config(schedule, steps=100, warmup=10):
    config = Config()
    config.optim.schedule, config.optim.warmup_steps, config.train.max_steps = schedule, warmup, steps
    config.optim.min_lr_ratio = 0.1
    return config


def test_warmup_then_cosine_to_the_floor():
    config = _config("cosine")
    values = [lr_multiplier(s, config.optim, config.train.max_steps) for s in range(100)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(values[9:]))
    assert values[-1] == pytest.approx(0.1)
    assert values[(10 + 99) // 2] == pytest.approx(0.55, abs=0.02)


def test_warmup_stable_decay():
    config = _config("wsd")
    config.optim.decay_fraction = 0.2
    values = [lr_multiplier(s, config.optim, config.train.max_steps) for s in range(100)]
    assert all(v == 1.0 for v in values[10:80])
    assert values[-1] == pytest.approx(0.1) and 0.1 < values[90] < 1.0


def test_constant():
    config = _config("constant")
    assert [lr_multiplier(s, config.optim, config.train.max_steps) for s in (50, 99)] == [1.0, 1.0]


def test_no_weight_decay_on_norms_biases_and_embeddings():
    model = rotarium.GLAForCausalLM(rotarium.GLAConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                       num_heads=2, position_encoding="selective_rope"))
    decay, rest = parameter_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in rest["params"]}
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    assert not decayed & kept and len(decayed) + len(kept) == len(names)
    assert any("embed" in n for n in kept) and not any("embed" in n for n in decayed)
    assert all(p.ndim >= 2 for p in decay["params"])
    assert any("norm" in n for n in kept) and not any("norm" in n for n in decayed)
    assert "lm_head.weight" in decayed


def test_tied_embeddings_are_counted_once_without_decay():
    model = rotarium.GLAForCausalLM(rotarium.GLAConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                       num_heads=2, tie_word_embeddings=True))
    decay, rest = parameter_groups(model, 0.1)
    head = model.lm_head.weight
    assert any(p is head for p in rest["params"]) and not any(p is head for p in decay["params"])
    total = sum(p.numel() for g in (decay, rest) for p in g["params"])
    assert total == sum(p.numel() for p in model.parameters())
    assert math.isfinite(total)
