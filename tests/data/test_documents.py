"""Rows of a JSON Lines file without the text field are counted and reported, not read as documents; every
help naming a source lists the local files read."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re

import pytest

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


def _option_help(command: str, option: str) -> str:
    from rotarium.cli import build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return next(a for a in subparsers.choices[command]._actions if option in (*a.option_strings, a.dest)).help


def _config_help(key: str) -> str:
    """A config key's help, as `rotarium train --help` lists it."""
    return next(f for f in dataclasses.fields(DataSection) if f.name == key).metadata["help"]


@pytest.mark.parametrize("help_text", [lambda: _option_help("eval", "--data"),
                                       lambda: _option_help("prepare", "source"),
                                       lambda: _config_help("source")], ids=["eval", "prepare", "train"])
def test_a_source_help_names_every_file_kind_read(help_text):
    from rotarium.data.config import LOCAL_FORMATS

    text = help_text()
    assert set(re.findall(r"\.[a-z]+\b", text)) == set(LOCAL_FORMATS), text  # .json is no .jsonl
