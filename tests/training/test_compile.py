"""`train.compile`: every block compiled (torch.compile), with no graph break for any family x positional option,
no new compilation as the length and the number of packed documents change, and the losses and gradients of eager
mode."""
import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from rotarium.cli import main
from rotarium.layers import Block, SequenceInfo
from rotarium.training import build
from rotarium.training.config import load_config
from tests.asserts import assert_close, assert_close_at_scale
from tests.models.helpers import COMBINATIONS, VOCAB, one_option_each, tiny_model
from tests.training.helpers import cli_args

# Packed batches of different lengths and numbers of documents, as training hands them to the model.
BATCHES = [[0, 5, 17, 24], [0, 11, 30], [0, 3, 9, 20, 33, 40]]


def packed_batch(bounds: list[int]) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (1, bounds[-1]), generator=torch.Generator().manual_seed(bounds[-1]))
    return {"input_ids": ids, "labels": ids, "cu_seqlens": torch.tensor(bounds)}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # the graph breaks counted so far, which reset() keeps
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(("family", "option"), COMBINATIONS)
def test_the_blocks_and_the_loss_trace_without_a_graph_break(family, option):
    model = tiny_model(family, option, num_hidden_layers=1).train()
    hidden = torch.randn(1, 24, model.config.hidden_size, requires_grad=True)
    seq = SequenceInfo.build(hidden, cu_seqlens=torch.tensor(BATCHES[0]))
    labels = torch.randint(0, VOCAB, (1, 24))

    def step(hidden, seq, labels):
        for block in model.model.layers:
            hidden = block(hidden, seq)[0]
        return model.chunked_loss(model.model.norm(hidden), labels)

    explained = torch._dynamo.explain(step)(hidden, seq, labels)
    reasons = [f"{b.reason.splitlines()[0]} at {b.user_stack[-1].filename}:{b.user_stack[-1].lineno}"
               for b in explained.break_reasons]
    assert explained.graph_break_count == 0, reasons
    assert explained.graph_count == 1


# every family and every option once (the graph-break test above covers each combination)
@pytest.mark.parametrize(("family", "option"), one_option_each(
    {"gla": "selective_rope", "fox": "rove", "deltanet": "rope", "transformer": "nope"}))
def test_compiled_blocks_train_as_eager_without_compiling_again(family, option):
    """Dynamo's graphs run as they are (the eager backend), the kernels' operators and their backward included, with
    the dynamic shapes of train.compile; inductor's slow code generation is the test below."""
    eager = tiny_model(family, option).train()
    compiled = copy.deepcopy(eager)
    counter = CompileCounter()
    assert build.compile_blocks(compiled, backend=counter) == 2
    frames = []
    for bounds in BATCHES:
        batch = packed_batch(bounds)
        expected, got = eager(**batch).loss, compiled(**batch).loss
        expected.backward()
        got.backward()
        assert_close(got, expected, atol=0, rtol=1e-5)
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
            assert_close_at_scale(q.grad, p.grad, 1e-4, what=name)
        frames.append(counter.frame_count)
    # one graph serves every block (the first block's input is no view of the embeddings, which would make a second),
    # and no other length compiles again
    assert frames == [1] * len(BATCHES), f"graphs compiled after each batch: {frames}"
    assert build.compile_failures() == ""


@pytest.mark.parametrize(("family", "option"), one_option_each(
    {"gla": "selective_rope", "fox": "rope", "deltanet": "rove", "transformer": "nope"}))
def test_validation_without_gradients_runs_each_block_as_one_graph(family, option):
    """Validation, generation and decoding run the compiled blocks without gradients, which dynamo traces apart."""
    model = tiny_model(family, option, num_hidden_layers=2).eval()
    counter = CompileCounter()
    build.compile_blocks(model, backend=counter)
    graphs = []
    with torch.no_grad():
        for batch in (packed_batch(BATCHES[0]), packed_batch(BATCHES[1]), {"input_ids": torch.ones(2, 9).long()}):
            model(**batch)
            graphs.append(counter.frame_count)
    assert graphs == [1, 1, 2], graphs  # one graph for packed documents, of any length, and one for plain batches
    assert build.compile_failures() == ""


@pytest.mark.parametrize(("family", "option"), one_option_each(
    {"gla": "rope", "fox": "selective_rope", "deltanet": "nope", "transformer": "rove"}))
def test_decoding_through_compiled_blocks_breaks_no_graph(family, option):
    """The training CLI samples from its compiled model: a prefill, then tokens one at a time from the cache (the
    recurrent families decode with kernels that enter the graph as traced code, whose value checks must not read)."""
    eager = tiny_model(family, option, num_hidden_layers=2).eval()
    compiled = copy.deepcopy(eager)
    build.compile_blocks(compiled, backend="eager")
    ids = torch.randint(1, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = (model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True,
                                        return_dict_in_generate=True) for model in (eager, compiled))
    assert torch.equal(got.sequences, expected.sequences)
    assert_close_at_scale(torch.stack(got.logits), torch.stack(expected.logits), 1e-5, what="logits")
    assert build.compile_failures() == ""



def test_compile_failures_names_graph_breaks_and_frames_given_up():
    def broken(x: torch.Tensor) -> torch.Tensor:
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    def refused(x: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"refused {x.shape}")

    assert build.compile_failures() == ""
    torch.compile(broken, backend="eager")(torch.ones(2))
    assert build.compile_failures().startswith("1 graph break(s), 0 frame(s) given up")
    torch._dynamo.utils.counters.clear()
    with pytest.raises(ValueError):
        torch.compile(refused, backend="eager")(torch.ones(2))
    assert build.compile_failures().startswith("0 graph break(s), 1 frame(s) given up")


@pytest.mark.slow  # inductor generates and compiles C++ for the block's forward and backward (tens of seconds)
def test_inductor_compiled_steps_give_the_eager_losses():
    eager = tiny_model("gla", "selective_rope", num_hidden_layers=1).train()
    compiled = copy.deepcopy(eager)
    build.compile_blocks(compiled)
    losses = []
    for model in (eager, compiled):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses.append([])
        for bounds in BATCHES[:2]:
            loss = model(**packed_batch(bounds)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[-1].append(loss.detach())
    assert_close(torch.stack(losses[1]), torch.stack(losses[0]), atol=0, rtol=1e-5)


def test_the_option_parses_and_build_model_compiles_every_block(corpus, capsys):
    config = load_config(None, {"train.compile": True, "model.num_hidden_layers": 2, "model.hidden_size": 32,
                                "model.num_heads": 2, "data.source": str(corpus)})
    assert load_config().train.compile is False
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: VOCAB, "pad_token_id": 0, "bos_token_id": 1,
                                       "eos_token_id": 2})()
    model = build.build_model(config, tokenizer)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    assert len(blocks) == 2
    assert all(block._compiled_call_impl is not None for block in blocks)
    assert "train.compile: each of the 2 blocks is compiled" in capsys.readouterr().out
    assert set(model.state_dict()) == set(copy.deepcopy(model).state_dict())  # the weights keep their names
    assert not any("_orig_mod" in name for name in model.state_dict())


def test_a_length_dependent_rope_scaling_is_refused():
    model = tiny_model("gla", "rope", rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"train.compile.*'dynamic'.*linear, yarn, llama3"):
        build.compile_blocks(model)


def test_a_cpu_without_a_cpp_compiler_stops_the_run_in_one_line(corpus, tmp_path, capsys, monkeypatch):
    from torch._inductor import cpp_builder

    def no_compiler():
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    monkeypatch.setattr(build, "_model", lambda *args: pytest.fail("the model was built"))
    code = main(["train", "--output-dir", str(tmp_path / "run"), *cli_args(corpus), "--train.compile", "true"])
    err = capsys.readouterr().err
    assert code == 2, err
    message = err.strip().splitlines()[-1]
    assert message.startswith("rotarium train: error: `train.compile` on CPU needs a C++ compiler"), err
    assert "g++" in message and "leave train.compile off" in message
    assert "Traceback" not in err
