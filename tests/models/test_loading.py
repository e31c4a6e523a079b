"""``load_pretrained`` takes a checkpoint whose output layer is tied to the embeddings as whole, and refuses weights
that changed since training wrote them or that two saves left side by side."""
from __future__ import annotations

import pytest
from safetensors.torch import load_file

from rotarium.models import GLAConfig, GLAForCausalLM, load_pretrained


def test_tied_weights_are_not_missing(tmp_path):
    config = GLAConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_heads=2, tie_word_embeddings=True)
    GLAForCausalLM(config).save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model = load_pretrained(str(tmp_path), flag="--model")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def _checkpoint_with_checksums(folder):
    """A model saved as ``rotarium train`` saves a checkpoint: its files' sizes and hashes in checksums.json."""
    from rotarium.training.run_folder import mark_complete

    config = GLAConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_heads=2)
    GLAForCausalLM(config).save_pretrained(folder)
    mark_complete(folder, 2, {"step": 2})


def test_weights_changed_since_training_wrote_them_are_refused(tmp_path):
    """A damaged copy whose safetensors header still reads loads without an error from transformers; its recorded
    hash is what tells. Other files than the weights (a config edited by hand) are the owner's to change."""
    _checkpoint_with_checksums(tmp_path)
    load_pretrained(str(tmp_path), flag="--model")
    config = tmp_path / "config.json"
    config.write_text(config.read_text().replace('"use_cache": true', '"use_cache": false'))
    load_pretrained(str(tmp_path), flag="--model")
    weights = tmp_path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x40  # the last byte of the last tensor's data
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"^--model .*: .*model\.safetensors does not match the SHA-256 recorded when "
                                         r"written: the weights changed since training wrote them .* delete its "
                                         r"checksums\.json to load them as they are$"):
        load_pretrained(str(tmp_path), flag="--model")
    (tmp_path / "checksums.json").unlink()
    load_pretrained(str(tmp_path), flag="--model")


def test_a_folder_with_the_weights_of_two_saves_is_refused(tmp_path):
    """save_pretrained leaves a model.safetensors beside a sharded save's index, and transformers loads the stale file
    first: eval, generate and --init-from would use the older weights."""
    config = GLAConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_heads=2)
    GLAForCausalLM(config).save_pretrained(tmp_path)
    GLAForCausalLM(config).save_pretrained(tmp_path, max_shard_size="20KB")
    with pytest.raises(ValueError, match="^--init-from .* holds both model.safetensors and model.safetensors.index"):
        load_pretrained(str(tmp_path), flag="--init-from")
