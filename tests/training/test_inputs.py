"""Wrong input stops `rotarium train` before anything is written: exit code 2 and one line naming the problem,
never a traceback. A mistyped model option, a YAML syntax error (in the file or an override), an empty or non-UTF-8
data file, and an --output-dir that is a file or cannot be written."""
from __future__ import annotations

from pathlib import Path

import pytest

from rotarium.data.documents import embedded_documents
from rotarium.training.config import load_config
from tests.cli_cases import error_line, run_cli_cases
from tests.training.helpers import cli_args

INPUTS = {
    "corpus.txt": "\n\n\n".join(embedded_documents()[:40]).encode(),
    "typo.yaml": b"model:\n  options:\n    selective_rope_decy: false\n",
    "broken.yaml": b"optim:\n  lr: 1e-3\n  betas: [0.9, 0.95\ntrain:\n  max_steps: 2\n",
    "empty.txt": b"",
    "latin1.txt": "Caf\u00e9 cr\u00e8me, a first document.\n\n\nA second one.\n".encode("latin-1"),
    "jsonl/good.jsonl": b'{"text": "a first document"}\n{"text": "a second document"}\n',
    "jsonl/latin1.jsonl": '{"text": "caf\u00e9"}\n'.encode("latin-1"),
    "a_file": b"not a folder\n",
}


def _cases(folder: Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (arguments after `train`, texts the error line must hold)."""
    def run(name: str) -> list[str]:
        return ["--output-dir", str(folder / "runs" / name.replace(" ", "-"))]

    return {
        "mistyped model option": (
            [*run("option"), "--model.options.selective_rope_decy", "false"],
            ["model.options.selective_rope_decy", "did you mean selective_rope_decay", "the options are"]),
        "mistyped model option in YAML": (
            [*run("option-yaml"), "--config", str(folder / "typo.yaml")],
            ["model.options.selective_rope_decy", "did you mean selective_rope_decay"]),
        "YAML syntax error": (
            [*run("yaml"), "--config", str(folder / "broken.yaml")],
            [str(folder / "broken.yaml"), "not valid YAML", "line 4"]),
        "YAML syntax error in an override": (
            [*run("yaml-override"), "--optim.betas", "[0.9,"], ["optim.betas", "not valid YAML"]),
        "empty data file": (
            [*run("empty"), "--data.source", str(folder / "empty.txt")], [str(folder / "empty.txt"), "no text"]),
        "non-UTF-8 text file": (
            [*run("latin1-txt"), "--data.source", str(folder / "latin1.txt")],
            [str(folder / "latin1.txt"), "not UTF-8", "byte 3"]),
        "non-UTF-8 JSON Lines file in a folder": (
            [*run("latin1-jsonl"), "--data.source", str(folder / "jsonl")],
            [str(folder / "jsonl" / "latin1.jsonl"), "not UTF-8"]),
        "output folder that is a file": (
            ["--output-dir", str(folder / "a_file")], ["--output-dir", str(folder / "a_file"), "not a folder"]),
        "output folder inside a file": (
            ["--output-dir", str(folder / "a_file" / "run")], [str(folder / "a_file"), "is a file"]),
        "read-only output folder": (
            ["--output-dir", str(folder / "read_only")], [str(folder / "read_only"), "not writable"]),
    }


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("inputs")
    for name, data in INPUTS.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    (folder / "read_only").mkdir()
    (folder / "read_only").chmod(0o555)
    return folder


@pytest.fixture(scope="module")
def results(folder) -> dict[str, tuple[int, str] | None]:
    # the corpus and sizes first, so that each case's own --data.source / --config wins
    tiny = cli_args(folder / "corpus.txt", train__max_steps=2, train__eval_every=2)
    cases = {name: ["train", *tiny, *args] for name, (args, _) in _cases(folder).items()}
    return run_cli_cases(cases, folder, skip_if_writable={"read-only output folder": folder / "read_only"})


# These tests share the input files and their cases (module fixtures, made again in each worker that runs one of
# them): one worker runs them all (xdist_group), so those are made once.
@pytest.mark.slow
@pytest.mark.xdist_group("inputs")
@pytest.mark.parametrize("case", list(_cases(Path("."))))
def test_bad_input_is_one_line_with_exit_code_2(case, folder, results):
    message = error_line(results[case], "train")
    args, expected = _cases(folder)[case]
    for text in expected:
        assert text in message, f"{text!r} not in {message!r}"
    output = Path(args[args.index("--output-dir") + 1])
    assert not output.is_dir() or not any(output.iterdir())  # stopped before anything of a run was written


def test_model_options_are_checked_against_the_family_of_the_run():
    assert load_config(None, {"model.options.selective_rope_decay": "false"}).model.options == {
        "selective_rope_decay": False}
    # a preset's family decides: qk_norm is a FoX field, not a GLA one
    assert load_config(None, {"model.preset": "fox-370m", "model.options.qk_norm": "true"}).model.options == {
        "qk_norm": True}
    with pytest.raises(ValueError, match="unknown model option `model.options.qk_norm` for a gla model"):
        load_config(None, {"model.options.qk_norm": "true"})
    with pytest.raises(ValueError, match="model.options.vocab_size` is set by the tokenizer"):
        load_config(None, {"model.options.vocab_size": "100"})
    with pytest.raises(ValueError, match="cannot be combined with `--init-from"):
        load_config(None, {"model.options.rope_theta": "500", "model.init_from": "runs/default/final"})
    # close matches come first, then every other name
    with pytest.raises(ValueError, match=r"did you mean norm_eps\? the options are norm_eps, conv_size"):
        load_config(None, {"model.options.norm_epz": "1e-5"})
