"""The model card reads metrics.jsonl's null for a non-finite loss, and states what the checkpoint itself saw."""
from __future__ import annotations

import json

from rotarium.hub import read_checkpoint
from rotarium.hub.card import model_card
from rotarium.training.metrics import append_record
from tests.hub.helpers import make_checkpoint


def test_the_card_of_a_run_that_ended_on_a_non_finite_loss(tmp_path):
    make_checkpoint(tmp_path / "run" / "final", "gla", "rope")
    append_record(tmp_path / "run" / "metrics.jsonl", {"step": 7, "loss": float("nan"), "tokens": 700})
    checkpoint = read_checkpoint(tmp_path / "run" / "final")
    card = model_card(checkpoint, repo="someone/tiny", num_parameters=1000)
    assert "Training loss at step 7: not finite." in card and "Tokens: 700" in card


def _run_with_later_records(run, checkpoint_name: str) -> None:
    """A run that logged steps 1-4 (validation at 2 and 4), planned 4 steps, beside its checkpoint of step 2."""
    make_checkpoint(run / checkpoint_name, "gla", "rope")
    for step in (1, 2, 3, 4):
        append_record(run / "metrics.jsonl", {"step": step, "loss": 5.0 - step, "tokens": 100 * step})
        if step % 2 == 0:
            append_record(run / "metrics.jsonl", {"step": step, "val_loss": 6.0 - step, "val_perplexity": 9.0})
    (run / "training_args.json").write_text(json.dumps({"train.max_steps": 4, "max_tokens": 400}))


def test_the_card_of_a_checkpoint_reports_its_own_step_not_the_runs_later_ones(tmp_path):
    """`rotarium train`'s <run>/checkpoints/step-<N>/ (its trainer_state.json says the step and tokens) and a
    Trainer's <run>/checkpoint-<N>/ beside a metrics.jsonl that went on: the card states what that checkpoint saw."""
    _run_with_later_records(tmp_path / "run", "checkpoints/step-2")
    (tmp_path / "run" / "checkpoints" / "step-2" / "trainer_state.json").write_text(
        json.dumps({"step": 2, "tokens": 200, "good": True}))
    _run_with_later_records(tmp_path / "hf", "checkpoint-2")
    for folder in (tmp_path / "run" / "checkpoints" / "step-2", tmp_path / "hf" / "checkpoint-2"):
        checkpoint = read_checkpoint(folder)
        assert checkpoint.step == 2
        card = model_card(checkpoint, repo="someone/tiny", num_parameters=1000)
        assert "Tokens: 200 (200)." in card, card
        assert "Training loss at step 2: 3." in card
        assert "Validation loss at step 2: 4 (perplexity 9)." in card
        assert "step 4" not in card and "Tokens: 400" not in card


def test_the_card_of_a_final_model_reports_the_whole_run(tmp_path):
    _run_with_later_records(tmp_path / "run", "final")
    checkpoint = read_checkpoint(tmp_path / "run" / "final")
    card = model_card(checkpoint, repo="someone/tiny", num_parameters=1000)
    assert checkpoint.step is None
    assert "Tokens: 400 (400)." in card and "Training loss at step 4: 1." in card


def test_the_card_names_the_hub_dataset_a_run_trained_on(tmp_path):
    """rotarium train records its ``data.source``: a Hub id (streaming), or a prepared folder that records the Hub id
    it was made from (every recipe). The embedded corpus, a local file and a folder gone since name nothing."""
    prepared = tmp_path / "data" / "fineweb-edu-10bt"
    prepared.mkdir(parents=True)
    (prepared / "metadata.json").write_text(json.dumps({"settings": {"source": "HuggingFaceFW/fineweb-edu"}}))
    cases = {"HuggingFaceFW/fineweb-edu": ["HuggingFaceFW/fineweb-edu"],
             str(prepared): ["HuggingFaceFW/fineweb-edu"],
             "embedded": [], str(tmp_path / "corpus.jsonl"): [], str(tmp_path / "gone"): []}
    for n, (source, expected) in enumerate(cases.items()):
        folder = tmp_path / f"run{n}" / "final"
        make_checkpoint(folder, "gla", "rope")
        (folder / "training_args.json").write_text(json.dumps({"data.source": source}))
        checkpoint = read_checkpoint(folder)
        assert checkpoint.datasets == expected, source
        card = model_card(checkpoint, repo="someone/tiny", num_parameters=1000)
        assert ("datasets:\n- HuggingFaceFW/fineweb-edu" in card) is bool(expected)
