"""The CPU harness of fla (``fla_cpu.py``) runs fla's four CPU-buildable models, and its stand-ins agree with each
other: fla's own decoding path (step-wise kernels, convolution cache, state layouts) continues a prefill exactly as
the full forward computes it, and padding (fla's packed-sequence path) changes no real token's logits."""
import importlib

import pytest
import torch
import torch.nn.functional as F
from fla.models.utils import Cache
from fla.modules import ShortConvolution
from torch import nn

from tests.asserts import assert_close_at_scale
from tests.fla_cpu import LEAVES, MODEL_TYPES, causal_conv1d, fla_on_cpu, tiny_fla_model

BATCH, LENGTH, PREFILL = 2, 70, 66  # longer than fla's 64-token chunk, so its chunked kernels run too
TOL = 1e-4  # at the logits' scale
# fla warns whenever a model turns its short convolutions off, which one variant does on purpose
pytestmark = pytest.mark.filterwarnings("ignore:ShortConvolution is crucial:UserWarning")

# fla's defaults for each model type, fla's own initialisation, then variants that reach the other leaves and
# options: short convolutions in GLA, its unfused gate (ACT2FN's swish) and feature maps, GQA, output gates and their
# norms, qk normalisers, the gated delta rule's grouped value heads and negative eigenvalues, FoX's QK-norm and
# output gate.
CASES = [pytest.param(model_type, {}, id=model_type) for model_type in MODEL_TYPES] + [
    pytest.param("delta_net", {"spread": False}, id="delta_net-fla-init"),
    pytest.param("gla", {"use_short_conv": True, "fuse_norm": False, "feature_map": "relu", "num_kv_heads": 2},
                 id="gla-conv-unfused-relu-gqa"),
    pytest.param("gla", {"use_output_gate": False, "clamp_min": -0.05, "expand_k": 1.0, "feature_map": "swish"},
                 id="gla-no-gate-clamp-swish"),
    pytest.param("delta_net", {"use_gate": True, "qk_activation": "elu", "qk_norm": "sum",
                               "allow_neg_eigval": True}, id="delta_net-gate-elu-sum"),
    pytest.param("delta_net", {"use_short_conv": False, "use_beta": False, "qk_activation": "relu"},
                 id="delta_net-no-conv-no-beta"),
    pytest.param("gated_deltanet", {"num_v_heads": 8, "use_gate": False, "allow_neg_eigval": True},
                 id="gated_deltanet-gva-no-gate"),
    pytest.param("gated_deltanet", {"output_gate_activation": "sigmoid", "conv_size": 3},
                 id="gated_deltanet-sigmoid-gate"),
    pytest.param("forgetting_transformer", {"qk_norm": True, "use_output_gate": True, "num_kv_heads": 2,
                                            "qkv_bias": True}, id="forgetting_transformer-pro-gqa"),
]


def token_ids(vocab_size: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("model_type", "overrides"), CASES)
def test_forward_is_finite_and_decoding_continues_it(model_type, overrides):
    model = tiny_fla_model(model_type, **overrides)
    ids = token_ids()
    # fla's forgetting attention decodes only through its padded path: it needs the attention mask
    needs_mask = model_type == "forgetting_transformer"

    def mask(length: int) -> torch.Tensor | None:
        return torch.ones(BATCH, length, dtype=torch.long) if needs_mask else None

    cache = Cache()
    with fla_on_cpu(), torch.no_grad():
        full = model(ids, labels=ids, use_cache=False)
        prefill = model(ids[:, :PREFILL], attention_mask=mask(PREFILL), past_key_values=cache, use_cache=True).logits
        steps = [model(ids[:, t:t + 1], attention_mask=mask(t + 1), past_key_values=cache, use_cache=True).logits
                 for t in range(PREFILL, LENGTH)]
    assert full.logits.shape == (BATCH, LENGTH, 128)
    assert torch.isfinite(full.logits).all()
    expected_loss = F.cross_entropy(full.logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(full.loss, expected_loss)
    assert_close_at_scale(prefill, full.logits[:, :PREFILL], TOL)
    assert_close_at_scale(torch.cat(steps, 1), full.logits[:, PREFILL:], TOL)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_left_padding_changes_no_real_token(model_type):
    model = tiny_fla_model(model_type)
    ids, pad = token_ids(), 6
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[0, :pad] = 0
    with fla_on_cpu(), torch.no_grad():
        padded = model(ids, attention_mask=mask, use_cache=False).logits
        alone = model(ids[:1, pad:], use_cache=False).logits
        full = model(ids[1:], use_cache=False).logits
    assert_close_at_scale(padded[:1, pad:], alone, TOL)
    assert_close_at_scale(padded[1:], full, TOL)


def test_short_convolution_stand_in_is_the_causal_conv1d():
    """The stand-in against nn.Conv1d itself (fla's ShortConvolution is one, padded by W - 1 on both sides)."""
    conv = ShortConvolution(hidden_size=8, kernel_size=4, bias=True, activation="silu")
    x = torch.randn(2, 11, 8)
    y, state = causal_conv1d(x, conv.weight[:, 0], conv.bias, activation="silu", output_final_state=True)
    with torch.no_grad():
        expected = F.silu(nn.Conv1d.forward(conv, x.transpose(1, 2))[..., :11].transpose(1, 2))
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(state, x[:, -4:].transpose(1, 2))


def test_every_leaf_is_restored_on_exit():
    modules = {name: importlib.import_module(name) for name in LEAVES}
    originals = {(m, leaf): getattr(modules[m], leaf) for m, leaves in LEAVES.items() for leaf in leaves}
    with fla_on_cpu():
        assert all(getattr(modules[m], leaf) is LEAVES[m][leaf] for m, leaf in originals)
    assert all(getattr(modules[m], leaf) is original for (m, leaf), original in originals.items())
