"""`rotarium eval` and `rotarium generate` on a trained checkpoint, and the perplexity computation itself."""
import json
import math

import pytest
import torch

import rotarium
from rotarium import cli
from rotarium.evaluation.generate import generate_text
from rotarium.evaluation.perplexity import perplexity_by_context
from tests.cli_cases import run_cli_cases
from tests.training.helpers import ok, run_child


def test_perplexity_is_the_mean_loss_over_windows():
    model = rotarium.GLAForCausalLM(rotarium.GLAConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                                       num_heads=2)).eval()
    tokens = torch.randint(0, 50, (100,), generator=torch.Generator().manual_seed(0))
    rows = perplexity_by_context(model, tokens, [16, 64, 128], max_tokens=64, batch_size=3, progress=False)
    by_length = {r["context_length"]: r for r in rows}
    windows = tokens[:64].view(4, 16)
    with torch.no_grad():
        logits = model(windows).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten())
    assert by_length[16]["windows"] == 4 and by_length[16]["tokens"] == 4 * 15
    assert by_length[16]["loss"] == pytest.approx(float(expected), abs=1e-4)
    assert by_length[16]["perplexity"] == pytest.approx(math.exp(float(expected)), rel=1e-3)
    assert by_length[64]["windows"] == 1 and by_length[128]["windows"] == 0 and by_length[128]["loss"] is None
    with pytest.raises(ValueError, match="context lengths"):
        perplexity_by_context(model, tokens, [1])
    with pytest.raises(ValueError, match="--batch-size must be >= 1, got 0"):
        perplexity_by_context(model, tokens, [16], batch_size=0)
    with pytest.raises(ValueError, match="--max-tokens must be >= 1, got -5"):
        perplexity_by_context(model, tokens, [16], max_tokens=-5)


@pytest.mark.parametrize("options, message", [
    ({"top_p": 0.0}, r"--top-p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"--top-p must be in \(0, 1\]"),
    ({"top_k": -1}, "--top-k must be >= 0"),
    ({"repetition_penalty": 0.0}, "--repetition-penalty must be > 0"),
    ({"num_return_sequences": 0}, "--num-return-sequences must be >= 1"),
    ({"num_return_sequences": 2, "do_sample": False}, "needs sampling"),
    ({"max_new_tokens": 0}, "--max-new-tokens must be >= 1"),
])
def test_generation_settings_that_cannot_work_are_refused_naming_the_flag(options, message):
    # checked before the tokenizer or the model is touched
    with pytest.raises(ValueError, match=message):
        generate_text(None, None, "x", **options)


@pytest.mark.slow
def test_eval_writes_table_and_plot(reference, tmp_path):
    out = tmp_path / "eval"
    result = run_child(["eval", "--model", str(reference / "final"), "--context-lengths", "16,32,64",
                        "--max-tokens", "2048", "--output-dir", str(out)])
    ok(result)
    assert "| 64 (beyond training) |" in result.stdout and "validation split" in result.stdout
    rows = json.loads((out / "perplexity.json").read_text())
    assert [r["context_length"] for r in rows] == [16, 32, 64]
    assert all(r["windows"] > 0 and math.isfinite(r["perplexity"]) for r in rows)
    assert (out / "perplexity.png").stat().st_size > 1000


@pytest.mark.slow
def test_eval_on_a_local_text_file(reference, corpus, tmp_path):
    result = run_child(["eval", "--model", str(reference / "final"), "--data", str(corpus), "--context-lengths",
                        "32", "--max-tokens", "512", "--output-dir", str(tmp_path)])
    ok(result)
    assert str(corpus) in result.stdout


@pytest.mark.slow
def test_generate_samples_and_greedy_is_deterministic(reference):
    args = ["generate", "--model", str(reference / "final"), "--prompt", "The for", "--max-new-tokens", "8",
            "--json"]
    sampled = run_child([*args, "--num-return-sequences", "2"])
    ok(sampled)
    texts = json.loads(sampled.stdout.strip().splitlines()[-1])
    assert len(texts) == 2 and all(t.startswith("The for") for t in texts)
    greedy = [json.loads(run_child([*args, "--greedy"]).stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert greedy[0] == greedy[1]


BAD_INPUT = [
    (["eval", "--model", "/nonexistent/model"], "--model /nonexistent/model"),
    (["eval", "--model", "x", "--context-lengths", "a,b"], "--context-lengths"),
    (["generate", "--model", "/nonexistent/model", "--prompt", "x"], "--model /nonexistent/model"),
    (["train", "--optim.lrr", "1"], "optim.lrr"),
    (["train", "--config", "nope.yaml"], "no such file"),
    (["eval", "--model", "x", "--bogus", "1"], "unrecognized arguments"),
]


@pytest.fixture(scope="module")
def bad_input_results(tmp_path_factory) -> dict[str, tuple[int, str] | None]:
    """Every BAD_INPUT command line through the CLI's whole path, all in one child process (from the repository
    root, as `python -m rotarium` ran there)."""
    return run_cli_cases({" ".join(args): args for args, _ in BAD_INPUT}, tmp_path_factory.mktemp("bad-input"))


@pytest.mark.slow
@pytest.mark.xdist_group("evaluation-bad-input")  # one worker, so one child runs the cases
@pytest.mark.parametrize("args, message", BAD_INPUT)
def test_bad_input_gets_a_clear_message(args, message, bad_input_results):
    returncode, stderr = bad_input_results[" ".join(args)]
    assert returncode == 2
    assert message in stderr and "Traceback" not in stderr


def test_every_command_explains_its_options(capsys):
    # in this process, through the CLI's own parser (the entry point as a process: tests/test_cli.py and the runs)
    helps = {}
    for command in ("train", "eval", "generate"):
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, "--help"])
        helps[command] = capsys.readouterr().out
        assert exit_.value.code == 0 and "--" in helps[command]
    train_help = helps["train"]
    for flag in ("--config", "--output-dir", "--max-steps", "--save-every", "--resume", "--init-from",
                 "optim:", "global_batch_size"):
        assert flag in train_help
