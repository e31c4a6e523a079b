"""The eager forgetting attention (the path of ``output_attentions=True``) against the step-by-step references."""
import pytest
import torch

from rotarium.ops.forgetting_attn import (
    eager_forgetting_attn,
    naive_forgetting_attn,
    naive_forgetting_attn_with_cache,
)
from tests.asserts import assert_close


@pytest.mark.parametrize("gated", [True, False], ids=["fox", "softmax"])
def test_eager_attention_equals_the_reference_on_packed_documents(gated):
    q, k, v = torch.randn(1, 11, 4, 8), torch.randn(1, 11, 2, 8), torch.randn(1, 11, 2, 6)
    g = torch.nn.functional.logsigmoid(torch.randn(1, 11, 4)) if gated else None
    cu = torch.tensor([0, 4, 5, 11])
    # the gate's cumulative sum may run across documents: a bias shared by a query's scores cancels in its softmax
    c = None if g is None else g.cumsum(1)
    o, weights = eager_forgetting_attn(q, k, v, c, c, cu_seqlens=cu)
    assert_close(o, naive_forgetting_attn(q, k, v, g, cu_seqlens=cu), atol=1e-5, what="output")
    assert weights.shape == (1, 4, 11, 11)
    assert torch.all(weights[..., 4:, :4] == 0) and torch.all(weights[..., :4, 4:] == 0)
    assert_close(weights.sum(-1), torch.ones(1, 4, 11), atol=1e-5, what="row sums")


def test_eager_attention_equals_the_reference_against_cached_padded_keys():
    q, k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 9, 4, 8), torch.randn(2, 9, 4, 8)
    cq = torch.randn(2, 3, 4).cumsum(1) - 5
    ck = torch.randn(2, 9, 4).cumsum(1) - 5
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :7] = 0  # the second row's first query sees no key
    o, weights = eager_forgetting_attn(q, k, v, cq, ck, scale=0.3, attention_mask=mask)
    expected = naive_forgetting_attn_with_cache(q, k, v, cq, ck, scale=0.3, attention_mask=mask)
    assert_close(o, expected, atol=1e-5, what="output")
    assert torch.all(weights[1, :, 0] == 0) and torch.isfinite(weights).all()
