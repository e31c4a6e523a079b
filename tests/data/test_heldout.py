"""The record of the documents a run held out catches a changed stream."""
from __future__ import annotations

import json

import pytest

from rotarium.data.config import DataSection
from rotarium.data.documents import embedded_documents, held_out_documents
from rotarium.data.heldout import check_held_out, check_source, held_out_record


def test_a_stream_s_held_out_part_is_verified(tmp_path):
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n\n\n".join(embedded_documents()[:12]))
    section = DataSection(source=str(corpus), streaming=True, validation_documents=3)
    record = held_out_record(section, held_out_documents(section, 0))
    check_held_out(record, section, held_out_documents(section, 0), "training_args.json")
    corpus.write_text("\n\n\n".join(embedded_documents()[1:12]))  # the first document removed
    with pytest.raises(ValueError, match=r"changed since training: the stream's held-out part \(its first 3"):
        check_held_out(record, section, held_out_documents(section, 0), "training_args.json")


def _jsonl(path, documents):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))


def test_a_stream_s_shards_are_identified_and_a_deleted_row_or_renamed_shard_is_named(tmp_path, caplog):
    folder = tmp_path / "shards"
    folder.mkdir()
    documents = embedded_documents()[:40]
    for k in range(4):
        _jsonl(folder / f"part-{k}.jsonl", documents[10 * k:10 * k + 10])
    section = DataSection(source=str(folder), streaming=True, validation_documents=3)
    record = held_out_record(section, held_out_documents(section, 0))
    assert sorted(record["identity"]["files"]) == [f"part-{k}.jsonl" for k in range(4)]
    assert not check_source(record, section, "training_args.json")
    _jsonl(folder / "part-2.jsonl", documents[20:28])  # two rows deleted, far from the held-out head
    with pytest.raises(ValueError, match=r"`data.source=.*shards` is not the source recorded in training_args.json: "
                                         r"part-2.jsonl has \d+ bytes, \d+ bytes were recorded; .*--allow-data-change"):
        check_source(record, section, "training_args.json")
    _jsonl(folder / "part-2.jsonl", documents[20:30])
    (folder / "part-1.jsonl").rename(folder / "part-9.jsonl")
    with pytest.raises(ValueError, match="part-1.jsonl is gone; part-9.jsonl is new"):
        check_source(record, section, "training_args.json")
    assert check_source(record, section, "training_args.json", allow=True)  # knowingly: a warning
    assert "the held-out documents may now include documents the run trained on" in caplog.text


def test_a_hub_stream_is_identified_by_its_shard_files_names_and_sizes(tmp_path):
    from rotarium.data.documents import StreamShards
    from rotarium.data.heldout import identity_changes, stream_identity

    for k in range(2):
        _jsonl(tmp_path / f"s{k}.jsonl", embedded_documents()[k * 5:k * 5 + 5])
    stream = StreamShards(DataSection(source=str(tmp_path), streaming=True))
    identity = stream_identity(stream)
    assert identity == {"shards": {str(tmp_path / f"s{k}.jsonl"): {"bytes": (tmp_path / f"s{k}.jsonl").stat().st_size}
                                   for k in range(2)}}
    _jsonl(tmp_path / "s1.jsonl", embedded_documents()[5:9])
    now = stream_identity(StreamShards(DataSection(source=str(tmp_path), streaming=True)))
    before, after = identity["shards"][str(tmp_path / "s1.jsonl")]["bytes"], (tmp_path / "s1.jsonl").stat().st_size
    changes = identity_changes(identity, now)
    assert changes == [f"{tmp_path / 's1.jsonl'} has {after} bytes, {before} bytes were recorded"]


def test_a_large_file_is_identified_by_its_size_and_ends(tmp_path, monkeypatch):
    from rotarium.data import heldout

    monkeypatch.setattr(heldout, "LARGE_FILE", 1000)
    monkeypatch.setattr(heldout, "END_BLOCK", 100)
    path = tmp_path / "big.txt"
    path.write_bytes(b"a" * 5000)
    section = DataSection(source=str(path))
    identity = heldout.source_identity(section)
    assert set(identity["files"]["big.txt"]) == {"bytes", "ends_sha256"}
    path.write_bytes(b"a" * 4999 + b"b")  # the last block changed
    assert heldout.identity_changes(identity, heldout.source_identity(section)) == [
        "big.txt has other content of the same size"]
