"""One loader interface (rotarium.data.loader.TrainLoader) for the three ways a run reads its training data, built in
one place (rotarium.training.build.prepare_data) from one LoaderSettings: each goes on from the position it reports
with the micro-batches it would have given, and describes its data for the run record."""
from __future__ import annotations

import json

import pytest
import torch

from rotarium.data.config import DataSection
from rotarium.data.documents import iter_documents
from rotarium.data.prepared import PreparedCorpus, prepare
from rotarium.data.tokenizer import train_bpe
from rotarium.training.build import loader_settings, open_data_source, prepare_data
from rotarium.training.config import load_config
from tests.training.helpers import TINY


def _config_and_tokenizer(kind, corpus, tmp_path):
    documents = list(iter_documents(DataSection(source=str(corpus))))
    settings = {**TINY, "data.source": str(corpus), "data.num_workers": 0, "train.gradient_accumulation_steps": 2}
    if kind == "prepared":
        out = tmp_path / "prepared"
        prepare(str(corpus), out, validation_fraction=TINY["data.validation_fraction"], vocab_size=320, num_proc=1,
                progress=False)
        return load_config(None, {**settings, "data.source": str(out)}), PreparedCorpus(out).load_tokenizer()
    if kind == "stream":
        source = tmp_path / "docs.jsonl"
        source.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
        settings.update({"data.source": str(source), "data.streaming": True, "data.validation_documents": 4,
                         "data.shuffle_buffer": 8})
    return load_config(None, settings), train_bpe(documents, 320)


@pytest.mark.parametrize("kind", ["memory", "prepared", "stream"])
def test_each_loader_goes_on_from_the_position_it_reports(kind, corpus, tmp_path):
    config, tokenizer = _config_and_tokenizer(kind, corpus, tmp_path)

    def build():
        return prepare_data(config, tokenizer, open_data_source(config, 1), loader_settings(config, 1)).train

    first = build()
    for step in range(3):
        for micro in range(2):
            first.batch(step, micro)
    position = json.loads(json.dumps(first.position(3)))  # as a checkpoint stores it
    expected = [first.batch(step, micro) for step in range(3, 6) for micro in range(2)]
    first.close()
    resumed = build()
    resumed.restore(3, position)
    got = [resumed.batch(step, micro) for step in range(3, 6) for micro in range(2)]
    for a, b in zip(got, expected):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["cu_seqlens"], b["cu_seqlens"])
    if kind != "memory":  # a loader reading ahead gives each micro-batch once: restored before its first only
        with pytest.raises(RuntimeError, match="before its first batch"):
            resumed.restore(0, {})
    record = resumed.describe()
    resumed.close()
    assert record["documents"] > 0 and record["source"]
    assert ("prepared" in record) == (kind == "prepared") and (resumed.schedule is None) == (kind == "stream")


@pytest.mark.parametrize("kind", ["memory", "prepared", "stream"])
def test_the_validation_rows_scored_are_the_same_for_any_number_of_processes(kind, corpus, tmp_path):
    """At a fixed global batch, one process (2 micro-batches) and two score the same validation rows, so a run resumed
    with another number of processes goes on with the same validation loss."""
    config, tokenizer = _config_and_tokenizer(kind, corpus, tmp_path)
    config.train.global_batch_size = 8

    def rows(world: int) -> list[torch.Tensor]:
        shares = []
        for rank in range(world):
            settings = loader_settings(config, world, rank)
            data = prepare_data(config, tokenizer, open_data_source(config, world), settings)
            data.close()
            shares.append([batch["input_ids"] for batch in data.validation])
        return [shares[k % world][k // world] for k in range(sum(map(len, shares)))]  # dealt out batch by batch

    one, two = rows(1), rows(2)
    assert len(one) == len(two) > TINY["train.eval_batches"]
    assert all(torch.equal(a, b) for a, b in zip(one, two))
