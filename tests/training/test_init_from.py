"""`rotarium train --init-from CHECKPOINT`: the checkpoint's config is the model and its tokenizer the ids its
embeddings were trained on, so a model setting or a tokenizer given beside it that differs is refused by name
(before, a GLA checkpoint trained as asked for a FoX, recorded as one, or on another tokenizer's ids)."""
import json
from pathlib import Path

import pytest

from rotarium.cli import main
from rotarium.data.documents import embedded_documents
from rotarium.data.tokenizer import train_bpe
from rotarium.models.configuration import CONFIGS
from rotarium.models.modeling import FAMILY_MODELS
from tests.training.helpers import cli_args


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A 2-layer RoPE GLA of width 32 (the tiny run's sizes) and its byte-level BPE of 300 tokens, as
    `save_pretrained` writes them."""
    folder = tmp_path_factory.mktemp("checkpoint")
    tokenizer = train_bpe(embedded_documents()[:40], 300)
    config = CONFIGS["gla"](hidden_size=32, num_hidden_layers=2, num_heads=2, intermediate_size=64,
                            position_encoding="rope", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    FAMILY_MODELS["gla"].lm(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> Path:
    """A BPE of 290 tokens: fewer than the checkpoint's embeddings, so every id fits, but its ids mean other text."""
    folder = tmp_path_factory.mktemp("other_tokenizer")
    train_bpe(embedded_documents()[40:80], 290).save_pretrained(folder)
    return folder


def _train(corpus, run_dir, checkpoint, *extra, capsys) -> tuple[int, str]:
    code = main(["train", *cli_args(corpus, train__max_steps=1, train__eval_every=1), "--output-dir", str(run_dir),
                 "--init-from", str(checkpoint), *extra])
    return code, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("extra, expected", [
    (["--model.family", "fox"], ["model.family 'fox'", "'gla'"]),
    (["--model.position_encoding", "nope"], ["model.position_encoding 'nope'", "'rope'"]),
    (["--model.hidden_size", "64", "--model.num_hidden_layers", "3"],
     ["model.hidden_size 64", "model.num_hidden_layers 3", "(the checkpoint's: 32)"]),
    (["--model.preset", "fox-370m"], ["model.preset 'fox-370m'", "fox"]),
])
def test_model_settings_other_than_the_checkpoints_are_refused(extra, expected, corpus, checkpoint, tmp_path, capsys):
    code, message = _train(corpus, tmp_path / "run", checkpoint, *extra, capsys=capsys)
    assert code == 2 and message.startswith("rotarium train: error: --init-from"), message
    for text in expected:
        assert text in message, message
    assert not (tmp_path / "run" / "training_args.json").exists()


def test_another_tokenizer_is_refused_and_the_checkpoints_own_is_accepted(corpus, checkpoint, other_tokenizer,
                                                                          tmp_path, capsys):
    code, message = _train(corpus, tmp_path / "other", checkpoint, "--tokenizer.name", str(other_tokenizer),
                           capsys=capsys)
    assert code == 2 and "tokenizer.name" in message and f"--init-from {checkpoint}" in message, message
    assert not (tmp_path / "other" / "final").exists()
    # its own tokenizer named again, and the checkpoint's own settings, are no change
    code, message = _train(corpus, tmp_path / "same", checkpoint, "--tokenizer.name", str(checkpoint),
                           "--model.position_encoding", "rope", "--model.hidden_size", "32", capsys=capsys)
    assert code == 0, message
    saved = json.loads((tmp_path / "same" / "final" / "config.json").read_text())
    assert (saved["position_encoding"], saved["hidden_size"], saved["vocab_size"]) == ("rope", 32, 300)


def test_a_folder_without_a_tokenizer_is_named_as_the_init_from_flag(corpus, tmp_path, capsys):
    (tmp_path / "not_a_checkpoint").mkdir()
    code, message = _train(corpus, tmp_path / "run", tmp_path / "not_a_checkpoint", capsys=capsys)
    assert code == 2 and f"--init-from {tmp_path / 'not_a_checkpoint'}" in message, message
    assert "tokenizer.name" not in message, message
