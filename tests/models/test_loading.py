"""``load_pretrained`` takes a checkpoint whose output layer is tied to the embeddings as whole."""
from __future__ import annotations

from safetensors.torch import load_file

from rotarium.models import GLAConfig, GLAForCausalLM, load_pretrained


def test_tied_weights_are_not_missing(tmp_path):
    config = GLAConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_heads=2, tie_word_embeddings=True)
    GLAForCausalLM(config).save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model = load_pretrained(str(tmp_path), flag="--model")
    assert model.lm_head.weight is model.model.embed_tokens.weight
