"""A tokenizer and untrained tiny models for the evaluation tests: what they check is the tasks, the scoring and the
command, not what a model has learnt."""
from pathlib import Path

import pytest
import torch

import rotarium
from rotarium.data.documents import embedded_documents
from rotarium.data.tokenizer import train_bpe


@pytest.fixture(scope="session")
def tokenizer():
    return train_bpe(embedded_documents()[:60], 1000)


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    config = rotarium.GLAConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_heads=2,
                                intermediate_size=64, max_position_embeddings=256)
    torch.manual_seed(0)
    return rotarium.GLAForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_model, tokenizer, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def rove_checkpoint(tokenizer, tmp_path_factory) -> Path:
    """A RoVE Transformer trained (as it were) at length 32, for ``--rope-scaling``."""
    config = rotarium.TransformerConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_heads=2,
                                        intermediate_size=64, max_position_embeddings=32, position_encoding="rove")
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("rove") / "model"
    rotarium.TransformerForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
