"""The PyTorch kernels under autocast (accelerate's bf16 mixed precision): they compute in float32 whatever the
autocast state, so float32 inputs give exactly what they give without autocast, outputs and gradients (the backward
runs after the autocast region, as PyTorch advises and accelerate does)."""
import pytest
import torch
import torch.nn.functional as F

from rotarium import ops

B, T, H, K, V = 2, 150, 2, 16, 8  # several chunks, the last one partial


def inputs() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "q": torch.randn(B, T, H, K),
        "k": F.normalize(torch.randn(B, T, H, K), dim=-1),
        "v": torch.randn(B, T, H, V),
        "g_channel": F.logsigmoid(torch.randn(B, T, H, K) + 2),
        "g_head": F.logsigmoid(torch.randn(B, T, H) + 2),
        "beta": torch.rand(B, T, H),
        "h0": torch.randn(B, H, K, V) * 0.1,
    }


CASES = {
    "chunk_gla": lambda x: ops.chunk_gla(x["q"], x["k"], x["v"], x["g_channel"], initial_state=x["h0"],
                                         output_final_state=True),
    "chunk_delta_rule": lambda x: ops.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], initial_state=x["h0"],
                                                       output_final_state=True),
    "chunk_gated_delta_rule": lambda x: ops.chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g_head"], x["beta"], initial_state=x["h0"], output_final_state=True),
    "parallel_forgetting_attn": lambda x: ops.parallel_forgetting_attn(x["q"], x["k"], x["v"], x["g_head"]),
    "parallel_attn (g=None)": lambda x: ops.parallel_forgetting_attn(x["q"], x["k"], x["v"]),
    "fused_recurrent_gla": lambda x: ops.fused_recurrent_gla(
        x["q"][:, :5], x["k"][:, :5], x["v"][:, :5], gk=x["g_channel"][:, :5], initial_state=x["h0"],
        output_final_state=True),
    "fused_recurrent_gated_delta_rule": lambda x: ops.fused_recurrent_gated_delta_rule(
        x["q"][:, :5], x["k"][:, :5], x["v"][:, :5], x["g_head"][:, :5], beta=x["beta"][:, :5], initial_state=x["h0"],
        output_final_state=True),
    "forgetting_attn_with_cache": lambda x: ops.forgetting_attn_with_cache(
        x["q"][:, -3:], x["k"], x["v"], x["g_head"].cumsum(1)[:, -3:], x["g_head"].cumsum(1)),
}


def forward_and_backward(case, autocast: bool):
    x = {name: t.requires_grad_() for name, t in inputs().items()}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = case(x)
        o, state = out if isinstance(out, tuple) else (out, None)
        loss = o.square().sum() + (state.square().sum() if state is not None else 0)
    loss.backward()
    return o.detach(), {name: t.grad for name, t in x.items() if t.grad is not None}


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_autocast_leaves_the_float32_kernels_unchanged(name):
    o_plain, grads_plain = forward_and_backward(CASES[name], autocast=False)
    o_autocast, grads_autocast = forward_and_backward(CASES[name], autocast=True)
    assert o_autocast.dtype == torch.float32
    torch.testing.assert_close(o_autocast, o_plain, rtol=0, atol=0)
    assert grads_autocast.keys() == grads_plain.keys()
    for key in grads_plain:
        torch.testing.assert_close(grads_autocast[key], grads_plain[key], rtol=0, atol=0, msg=key)
