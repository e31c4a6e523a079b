"""Rows of a JSON Lines file without the text field are counted and reported, not read as documents."""
from __future__ import annotations

import json
import logging

from rotarium.data.config import DataSection
from rotarium.data.documents import embedded_documents, iter_documents

DOCS = embedded_documents()[:40]


def _jsonl(rows: list) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def test_rows_without_the_text_field_are_counted_and_reported(tmp_path, caplog):
    rows = [{"text": d} for d in DOCS[:10]]
    rows[3] = {"body": "no text here"}
    rows[7] = {"text": None}
    path = tmp_path / "some.jsonl"
    path.write_text(_jsonl(rows))
    with caplog.at_level(logging.WARNING):
        documents = list(iter_documents(DataSection(source=str(path))))
    assert len(documents) == 8
    assert f"2 of the 10 rows read have no `text` (the first: {path} row 4)" in caplog.text


def test_a_parquet_file_of_no_rows_is_called_empty(tmp_path):
    """datasets cannot read a 0-row Parquet file and raises a DatasetGenerationError that says nothing of why."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import pytest

    path = tmp_path / "none.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    with pytest.raises(ValueError, match=f"`data.source={path}` is empty: no parquet rows to train on"):
        list(iter_documents(DataSection(source=str(path))))
