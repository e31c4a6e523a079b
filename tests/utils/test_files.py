"""Atomic writing: a target is either its old or its new self, whatever fails, and nothing is left behind."""
import os

import pytest

from rotarium.utils import files
from rotarium.utils.files import read_jsonl, write_folder_atomic, write_json_atomic, write_text_atomic


def _entries(folder):
    return sorted(p.name for p in folder.iterdir())


def test_text_and_json_replace_the_file_whole(tmp_path):
    path = tmp_path / "sub" / "a.txt"
    write_text_atomic(path, "one\r\ntwo\n")
    assert path.read_bytes() == b"one\r\ntwo\n"  # written as given
    write_json_atomic(path, {"x": [1, 2]})
    assert path.read_text() == '{\n  "x": [\n    1,\n    2\n  ]\n}\n'
    assert _entries(path.parent) == ["a.txt"]


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "a.txt"
    path.write_text("old")

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_text_atomic(path, "new")
    assert path.read_text() == "old" and _entries(tmp_path) == ["a.txt"]


def test_folder_is_replaced_whole_or_not_at_all(tmp_path):
    target = tmp_path / "out"
    write_folder_atomic(target, lambda folder: (folder / "x").write_text("1"))
    assert _entries(target) == ["x"]

    def write(folder):
        (folder / "y").write_text("2")
        return "done"

    assert write_folder_atomic(target, write) == "done"
    assert _entries(target) == ["y"] and _entries(tmp_path) == ["out"]

    def broken(folder):
        (folder / "z").write_text("3")
        raise RuntimeError("cut short")

    with pytest.raises(RuntimeError, match="cut short"):
        write_folder_atomic(target, broken)
    assert _entries(target) == ["y"] and _entries(tmp_path) == ["out"]


def test_a_failed_rename_puts_the_old_folder_back(tmp_path, monkeypatch):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep").write_text("mine")
    real = os.replace
    calls = []

    def second_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the new folder's rename, after the old one was moved aside
            raise OSError("no")
        return real(src, dst)

    monkeypatch.setattr(files.os, "replace", second_fails)
    with pytest.raises(OSError):
        write_folder_atomic(target, lambda folder: (folder / "new").write_text("x"))
    assert _entries(target) == ["keep"] and _entries(tmp_path) == ["out"]


def test_jsonl_skips_a_cut_line(tmp_path):
    path = tmp_path / "m.jsonl"
    assert read_jsonl(path) == []
    path.write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]


def test_atomic_writes_get_the_permissions_of_plain_ones(tmp_path):
    """The temporary file and folder are private while written; what is put in place is not (shared run folders)."""
    previous = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "a.txt", "x")
        write_folder_atomic(tmp_path / "out", lambda folder: (folder / "w.json").write_text("{}"))
        plain_file, plain_dir = tmp_path / "plain.txt", tmp_path / "plain"
        plain_file.write_text("x")
        plain_dir.mkdir()
    finally:
        os.umask(previous)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == plain_file.stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "out").stat().st_mode & 0o777 == plain_dir.stat().st_mode & 0o777 == 0o755


def test_a_published_folder_gets_plain_permissions_whatever_wrote_its_files(tmp_path):
    """safetensors writes its files 0600: a model folder's weights read as its other files do."""
    import numpy as np
    from safetensors.numpy import save_file

    def write(folder):
        save_file({"w": np.zeros(2, dtype=np.float32)}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text("{}")

    previous = os.umask(0o022)
    try:
        write_folder_atomic(tmp_path / "model", write)
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "model").iterdir()}
    assert modes == {"model.safetensors": 0o644, "config.json": 0o644}


def test_a_failed_write_names_the_file_it_was_writing(tmp_path):
    """A full disk fails a write, which names no file: the error names the target, never the temporary file."""
    import errno

    def full(tmp):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match=f"No space left on device: '{tmp_path / 'a.npy'}'") as caught:
        files.write_file_atomic(tmp_path / "a.npy", full)
    assert caught.value.errno == errno.ENOSPC

    def full_inside(folder):
        with open(folder / "weights.bin", "wb") as f:
            raise OSError(errno.ENOSPC, "No space left on device", f.name)

    with pytest.raises(OSError, match=f"'{tmp_path / 'model' / 'weights.bin'}'"):
        write_folder_atomic(tmp_path / "model", full_inside)
    assert _entries(tmp_path) == []
