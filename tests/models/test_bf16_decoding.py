"""Decoding with bfloat16 weights (``model.to(torch.bfloat16)``) on CPU, every family (one positional option each,
spread over the options that keep a state): the states that accumulate over the sequence (the recurrent state,
Selective RoPE's angles, FoX's cumulative log decay) stay float32 from the prefill through every decoded token, and
the logits stay within bfloat16 rounding of the float32 model's on the same tokens."""
from __future__ import annotations

import pytest
import torch

from tests.models.helpers import VOCAB, one_option_each, tiny_model
from tests.ops.test_autocast_models import ACCUMULATED, state_tensors


@pytest.mark.parametrize(("family", "position_encoding"), one_option_each(
    {"gla": "selective_rope", "fox": "rope", "deltanet": "rove", "transformer": "selective_rope"}))
def test_bf16_weights_decode_with_float32_states(family, position_encoding):
    model = tiny_model(family, position_encoding)
    ids = torch.randint(2, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    bf16 = tiny_model(family, position_encoding).to(torch.bfloat16)
    out = bf16.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)

    states = {f"layer {i}.{path}": t for i, layer in enumerate(out.past_key_values.layers)
              for path, t in state_tensors(layer.state).items()}
    accumulated = {path: t.dtype for path, t in states.items() if path.rsplit(".", 1)[-1] in ACCUMULATED}
    assert all(dtype == torch.float32 for dtype in accumulated.values()), accumulated
    if family in ("gla", "deltanet"):
        assert any(path.endswith(".recurrent") for path in accumulated), states.keys()
    if position_encoding == "selective_rope" or family == "fox":
        assert any(path.endswith((".theta", ".log_decay_cumsum")) for path in accumulated), states.keys()

    decoded = torch.stack(out.logits, 1).float()  # [B, 4, V], the logits of each decoded token
    with torch.no_grad():
        reference = model(out.sequences[:, :-1]).logits[:, ids.shape[1] - 1:]
    assert torch.isfinite(decoded).all()
    # bfloat16 weights and activations round at 2^-8 in every layer, which this model's large weights amplify; a lost
    # context or a wrong position moves the logits by about their own size
    assert (decoded - reference).abs().max() <= 0.25 * reference.abs().max()
