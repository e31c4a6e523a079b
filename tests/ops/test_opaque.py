"""The kernels as single operators of a torch.compile graph (rotarium.ops.opaque): PyTorch's own checks of a custom
operator, a compiled call's values and gradients against eager mode's, and fla's kernels entering the graph the same
way (checked without a GPU: fla is told it can run, and its kernel is a stand-in that, as fla's, dynamo may not
trace)."""
import pytest
import torch
import torch.nn.functional as F

from rotarium import ops
from rotarium.ops import backend as backend_module
from rotarium.ops import opaque
from rotarium.ops.backend import count_dispatches
from tests.asserts import assert_close_at_scale

CU_SEQLENS = torch.tensor([0, 5, 17, 24])


def gla_inputs() -> list[torch.Tensor]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 24, 2, 8) for _ in range(3))
    g = F.logsigmoid(torch.randn(1, 24, 2, 8))
    return [x.requires_grad_() for x in (q, k, v, g)]


def packed_gla(q, k, v, g):
    o, state = ops.chunk_gla(q, k, v, g, output_final_state=True, cu_seqlens=CU_SEQLENS)
    return (o * o).sum() + state.sum()


def test_pytorch_accepts_the_operator():
    q, k, v, g = gla_inputs()
    arguments = repr({"tensors": ["q", "k", "v", "g", "cu_seqlens"],
                      "options": {"output_final_state": True, "scale": None}})
    torch.library.opcheck(opaque._kernel, ("rotarium.ops.gla.chunk.chunk_gla", [q, k, v, g, CU_SEQLENS], arguments))


def test_pytorch_accepts_the_backward_operator():
    """The backward's fake (what inductor plans its buffers by) and its real gradients agree, strides included: the
    kernels' gradients come out in their own layouts (here [B, H, T, D] ones under a [B, T, H, D] shape)."""
    q, k, v, g = gla_inputs()
    o, state = ops.chunk_gla(q, k, v, g, output_final_state=True)
    arguments = repr({"tensors": ["q", "k", "v", "g"], "options": {"output_final_state": True, "scale": None},
                      "wanted": [True] * 4, "graded": [0, 1]})
    grads = [torch.randn_like(o), torch.randn_like(state)]
    torch.library.opcheck(opaque._kernel_backward,
                          ("rotarium.ops.gla.chunk.chunk_gla", [q, k, v, g], grads, arguments),
                          test_utils=("test_schema", "test_faketensor"))


def test_a_compiled_call_has_the_values_and_gradients_of_eager_mode():
    inputs = gla_inputs()
    expected = packed_gla(*inputs)
    expected_grads = torch.autograd.grad(expected, inputs)
    explained = torch._dynamo.explain(packed_gla)(*inputs)
    assert explained.graph_break_count == 0
    compiled = torch.compile(packed_gla, backend="aot_eager", dynamic=True, fullgraph=True)
    got = compiled(*inputs)
    assert_close_at_scale(got, expected, 1e-6)
    for got_grad, expected_grad in zip(torch.autograd.grad(got, inputs), expected_grads):
        assert_close_at_scale(got_grad, expected_grad, 1e-5)


def test_fla_kernels_enter_the_graph_as_one_operator(monkeypatch):
    pytest.importorskip("fla.ops")
    import fla.ops.gla

    monkeypatch.setattr(backend_module, "fla_device", lambda x: True)

    @torch.compiler.disable  # as fla's own kernels are
    def fla_stand_in(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu):
        return ops.chunk_gla(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens=cu_seqlens,
                             cu_seqlens_cpu=cu_seqlens_cpu, backend="torch")

    monkeypatch.setattr(fla.ops.gla, "chunk_gla", fla_stand_in)
    inputs = gla_inputs()
    with count_dispatches() as calls:
        expected = packed_gla(*inputs)
    assert calls[("chunk_gla", "fla")] == 1
    expected_grads = torch.autograd.grad(expected, inputs)
    assert torch._dynamo.explain(packed_gla)(*inputs).graph_break_count == 0
    compiled = torch.compile(packed_gla, backend="eager", dynamic=True, fullgraph=True)
    with count_dispatches() as calls:
        got = compiled(*inputs)
    assert calls[("chunk_gla", "fla")] == 1  # fla's kernel ran, inside the compiled graph
    assert_close_at_scale(got, expected, 1e-6)
    for got_grad, expected_grad in zip(torch.autograd.grad(got, inputs), expected_grads):
        assert_close_at_scale(got_grad, expected_grad, 1e-5)
