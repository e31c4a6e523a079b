"""A model's values are set once, by its ``_init_weights`` (transformers' route): the models build their modules on
the meta device, so that the modules' own initialisation draws nothing, and a model built twice from one seed is
the same model."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.initialization import no_init_weights

from rotarium.models import FAMILY_MODELS
from tests.models.helpers import tiny_config

# Every module with values of its own: Selective RoPE's full-rank map, frozen first difference, offsets, phase gate,
# temperatures (frozen and learned) and decay; Gated DeltaNet's A and dt; QK-norms, output gates, biases.
CASES = {
    "gla-full-rank-selective-rope": ("gla", {"position_encoding": "selective_rope", "selective_rope_rank": None}),
    "gla-rope": ("gla", {"position_encoding": "rope", "head_dim": 8}),
    "fox-rove-pro": ("fox", {"position_encoding": "rove", "qk_norm": True, "qk_norm_per_head": True,
                             "output_gate": True, "attention_bias": True}),
    "gated-deltanet-selective-rope": ("deltanet", {"position_encoding": "selective_rope", "use_gated_delta": True,
                                                   "use_output_gate": True}),
    "deltanet-selective-rope-options": ("deltanet", {
        "position_encoding": "selective_rope", "selective_rope_skip_conv": True, "selective_rope_bias": True,
        "selective_rope_phase_gate": True, "selective_rope_learn_temperature": True}),
    "transformer-selective-rope": ("transformer", {"position_encoding": "selective_rope", "qk_norm": True}),
}
# Parameters whose random values a module's ``special_init`` draws into a tensor of its own and then copies.
DRAWN_BY_SPECIAL_INIT = ("A_log", "dt_bias", "phi_direction")


def build(name: str) -> nn.Module:
    family, options = CASES[name]
    torch.manual_seed(0)
    return FAMILY_MODELS[family].lm(tiny_config(family, **{"position_encoding": "nope", **options}))


def poison_to_empty(monkeypatch) -> None:
    """Storage that ``to_empty`` gives is filled with NaN, so that a value nothing sets shows."""
    to_empty = nn.Module.to_empty

    def poisoned(module, *, device, recurse=True):
        module = to_empty(module, device=device, recurse=recurse)
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                if tensor.is_floating_point():
                    tensor.fill_(float("nan"))
        return module

    monkeypatch.setattr(nn.Module, "to_empty", poisoned)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_model_built_twice_from_one_seed_is_the_same(name):
    first, second = build(name).state_dict(), build(name).state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first), name


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_value_is_set_by_the_model(name, monkeypatch):
    """The modules are built without values; storage they get is filled with NaN here, so a value the model's
    initialisation forgot shows."""
    poison_to_empty(monkeypatch)
    model = build(name)
    unset = [key for key, value in model.state_dict().items() if value.is_floating_point() and value.isnan().any()]
    assert not unset


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_value_is_drawn_twice(name, monkeypatch):
    drawn: list[torch.Tensor] = []  # kept alive, so that no two of them share an address

    def counted(original):
        def draw(tensor, *args, **kwargs):
            if tensor.device.type != "meta":
                drawn.append(tensor)
            return original(tensor, *args, **kwargs)
        return draw

    for method in ("normal_", "uniform_"):
        monkeypatch.setattr(torch.Tensor, method, counted(getattr(torch.Tensor, method)))
    model = build(name)
    monkeypatch.undo()
    parameters = dict(model.named_parameters())
    for key, parameter in parameters.items():
        draws = sum(t.untyped_storage().data_ptr() == parameter.untyped_storage().data_ptr() for t in drawn)
        assert draws <= 1, f"{key} drawn {draws} times"
    addresses = {p.untyped_storage().data_ptr() for p in parameters.values()}
    elsewhere = sum(t.numel() for t in drawn if t.untyped_storage().data_ptr() not in addresses)
    assert elsewhere == sum(p.numel() for key, p in parameters.items() if key.endswith(DRAWN_BY_SPECIAL_INIT))


@pytest.mark.parametrize("name", sorted(CASES))
def test_buffers_hold_their_values_without_the_initialisation(name, monkeypatch):
    """transformers' convention (its `test_init_weights_can_init_buffers`): buffers are computed, not drawn, so a
    model built with its initialisation skipped (`no_init_weights`, as loading a checkpoint does) holds them."""
    expected = dict(build(name).named_buffers())
    poison_to_empty(monkeypatch)
    with no_init_weights():
        got = dict(build(name).named_buffers())
    assert got.keys() == expected.keys()
    assert [key for key in expected if not torch.equal(got[key], expected[key])] == []


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_model_built_on_the_meta_device_initialises_every_buffer(name, monkeypatch):
    """FSDP's meta initialisation: the whole model on the meta device, given storage, then `init_weights`."""
    expected = dict(build(name).named_buffers())
    family, options = CASES[name]
    with torch.device("meta"):
        model = FAMILY_MODELS[family].lm(tiny_config(family, **{"position_encoding": "nope", **options}))
    poison_to_empty(monkeypatch)
    model.to_empty(device="cpu")
    model.init_weights()
    got = dict(model.named_buffers())
    assert got.keys() == expected.keys()
    assert [key for key in expected if not torch.equal(got[key], expected[key])] == []
    assert not [key for key, value in model.state_dict().items() if value.is_floating_point() and value.isnan().any()]
