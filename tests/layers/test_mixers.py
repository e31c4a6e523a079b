"""Every mixer x positional option: caching, packing, padding, dtypes."""
import pytest
import torch

from tests.asserts import assert_close_at_scale
from tests.layers.helpers import COMBINATIONS, FAMILIES, HIDDEN, make_mixer, run

T = 40


@pytest.mark.parametrize("family,pe", COMBINATIONS)
def test_prefix_then_token_by_token_decoding_equals_full_forward(family, pe):
    mixer = make_mixer(family, pe)
    x = torch.randn(2, T, HIDDEN)
    full, _ = run(mixer, x)
    prefix = 13
    out, state = run(mixer, x[:, :prefix], use_cache=True)
    outs = [out]
    for t in range(prefix, T):
        out, state = run(mixer, x[:, t:t + 1], state, use_cache=True)
        outs.append(out)
    assert_close_at_scale(torch.cat(outs, 1), full, 1e-5)


@pytest.mark.parametrize("family,pe", COMBINATIONS)
def test_multi_token_decoding_and_long_continuation(family, pe):
    mixer = make_mixer(family, pe)
    x = torch.randn(1, 150, HIDDEN)
    full, _ = run(mixer, x)
    outs, state = [], None
    for start, stop in [(0, 5), (5, 8), (8, 80), (80, 150)]:  # short and chunked continuations alike
        out, state = run(mixer, x[:, start:stop], state, use_cache=True)
        outs.append(out)
    assert_close_at_scale(torch.cat(outs, 1), full, 1e-5)


@pytest.mark.parametrize("family,pe", COMBINATIONS)
def test_packed_batch_equals_separate_runs(family, pe):
    mixer = make_mixer(family, pe)
    lengths = [7, 1, 30, 12]
    docs = [torch.randn(1, n, HIDDEN) for n in lengths]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed, _ = run(mixer, torch.cat(docs, 1), cu_seqlens=cu_seqlens)
    separate = torch.cat([run(mixer, d)[0] for d in docs], 1)
    assert_close_at_scale(packed, separate, 1e-5)


@pytest.mark.parametrize("family,pe", COMBINATIONS)
def test_left_padding_equals_unpadded_and_decodes_on(family, pe):
    mixer = make_mixer(family, pe)
    a, b = torch.randn(1, 20, HIDDEN), torch.randn(1, 14, HIDDEN)
    batch = torch.cat([a, torch.cat([torch.randn(1, 6, HIDDEN), b], 1)])
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :6] = 0
    out, state = run(mixer, batch, use_cache=True, attention_mask=mask)
    assert_close_at_scale(out[0], run(mixer, a)[0][0], 1e-5)
    assert_close_at_scale(out[1, 6:], run(mixer, b)[0][0], 1e-5)
    # decoding continues each row from its own true position
    nxt = torch.randn(2, 1, HIDDEN)
    step_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    step, _ = run(mixer, nxt, state, use_cache=True, attention_mask=step_mask)
    assert_close_at_scale(step[1], run(mixer, torch.cat([b, nxt[1:]], 1))[0][0, -1:], 1e-5)


@pytest.mark.parametrize("family,pe", COMBINATIONS)
def test_bfloat16_runs_and_tracks_float32(family, pe):
    mixer = make_mixer(family, pe)
    x = torch.randn(2, 70, HIDDEN)
    ref, _ = run(mixer, x)
    out, _ = run(mixer.to(torch.bfloat16), x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert (out.float() - ref).norm() / ref.norm() < 0.05


def check_gradients_reach_input_and_every_parameter(mixer):
    # the input needs its gradient, as every layer's but the first does in a model: some backward paths only run then
    x = torch.randn(2, 70, HIDDEN, requires_grad=True)
    out, _ = run(mixer, x)
    out.square().mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for name, p in mixer.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("family,pe", COMBINATIONS)
def test_gradients_reach_every_parameter(family, pe):
    check_gradients_reach_input_and_every_parameter(make_mixer(family, pe))


SELECTIVE_VARIANTS = [
    {"selective_rope_rank": None},  # per-head weight-normalised full-rank projection
    {"selective_rope_rank": 4, "selective_rope_activation": None, "selective_rope_conv_size": 1},
    {"selective_rope_bias": True, "selective_rope_phase_gate": True},
    {"selective_rope_spectrum": "rfa", "selective_rope_learn_temperature": True},
]


@pytest.mark.parametrize("options", SELECTIVE_VARIANTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_selective_rope_variants_train_and_decode(family, options):
    mixer = make_mixer(family, "selective_rope", **options)
    check_gradients_reach_input_and_every_parameter(mixer)
    x = torch.randn(2, T, HIDDEN)
    full, _ = run(mixer, x)
    outs, state = [], None
    for start, stop in [(0, 9), (9, 10), (10, T)]:
        out, state = run(mixer, x[:, start:stop], state, use_cache=True)
        outs.append(out)
    assert_close_at_scale(torch.cat(outs, 1), full, 1e-5)
