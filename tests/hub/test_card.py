"""The model card reads metrics.jsonl's null for a non-finite loss."""
from __future__ import annotations

from rotarium.hub import read_checkpoint
from rotarium.hub.card import model_card
from rotarium.training.metrics import append_record
from tests.hub.helpers import make_checkpoint


def test_the_card_of_a_run_that_ended_on_a_non_finite_loss(tmp_path):
    make_checkpoint(tmp_path / "run" / "final", "gla", "rope")
    append_record(tmp_path / "run" / "metrics.jsonl", {"step": 7, "loss": float("nan"), "tokens": 700})
    checkpoint = read_checkpoint(tmp_path / "run" / "final")
    card = model_card(checkpoint, repo="someone/tiny", num_parameters=1000)
    assert "Final training loss at step 7: not finite." in card and "Tokens: 700" in card
