"""The record of the documents a run held out catches a changed stream."""
from __future__ import annotations

import pytest

from rotarium.data.config import DataSection
from rotarium.data.documents import embedded_documents, held_out_documents
from rotarium.data.heldout import check_held_out, held_out_record


def test_a_stream_s_held_out_part_is_verified(tmp_path):
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n\n\n".join(embedded_documents()[:12]))
    section = DataSection(source=str(corpus), streaming=True, validation_documents=3)
    record = held_out_record(section, held_out_documents(section, 0))
    check_held_out(record, section, held_out_documents(section, 0), "training_args.json")
    corpus.write_text("\n\n\n".join(embedded_documents()[1:12]))  # the first document removed
    with pytest.raises(ValueError, match=r"changed since training: the stream's held-out part \(its first 3"):
        check_held_out(record, section, held_out_documents(section, 0), "training_args.json")
