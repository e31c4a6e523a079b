"""No file is written through a link: files written by renaming a new file into place replace a link there, appends
and the folders rotarium makes refuse one."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from rotarium.utils.files import (
    append_text,
    make_folder,
    refuse_links_inside,
    remove_temporary_files,
    write_json_atomic,
    write_text_atomic,
)
from rotarium.utils.plots import save_figure
from tests.utils.helpers import SECRET, plant_link, secret_file


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    return secret_file(tmp_path)


def test_atomic_writes_replace_a_link_and_leave_its_target(tmp_path, outside):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, write in [("a.txt", lambda p: write_text_atomic(p, "new")),
                        ("a.json", lambda p: write_json_atomic(p, {"x": 1})),
                        ("a.png", lambda p: save_figure(plt.subplots()[0], p))]:
        path = tmp_path / name
        plant_link(path, outside)
        write(path)
        assert not path.is_symlink() and path.stat().st_size > 0, name
        assert outside.read_text() == SECRET, name



def test_appends_and_folders_refuse_a_link(tmp_path, outside):
    log = tmp_path / "metrics.jsonl"
    plant_link(log, outside)
    with pytest.raises(ValueError, match="symbolic link"):
        append_text(log, "{}\n")
    folder = tmp_path / "eval"
    folder.symlink_to(outside.parent, target_is_directory=True)
    with pytest.raises(ValueError, match=f"{folder}.*symbolic link"):
        make_folder(folder)
    assert outside.read_text() == SECRET and sorted(os.listdir(outside.parent)) == ["secret.txt"]


def test_folders_made_inside_an_output_refuse_a_link_at_any_level(tmp_path, outside):
    out = tmp_path / "out"
    out.mkdir()
    (out / "train").symlink_to(outside.parent, target_is_directory=True)
    with pytest.raises(ValueError, match=f"{out / 'train'} is a symbolic link"):
        make_folder(out / "train" / "deeper", "the shard folder", inside=out)
    with pytest.raises(ValueError, match=f"{out / 'train'} is a symbolic link"):
        refuse_links_inside(out, "OUT")
    assert make_folder(out / "validation" / "deeper", inside=out).is_dir()
    assert sorted(os.listdir(outside.parent)) == ["secret.txt"]


def test_temporary_files_are_removed_without_following_a_link(tmp_path, outside):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / ".a.npy.x1.tmp").write_text("cut short")
    (folder / ".tokenizer.tmp-x2").mkdir()
    (folder / ".b.npy.x3.tmp").symlink_to(outside)  # named like a temporary file: the link goes, not its target
    (folder / "kept.npy").write_text("whole")
    remove_temporary_files(folder)
    assert sorted(os.listdir(folder)) == ["kept.npy"] and outside.read_text() == SECRET
    linked = tmp_path / "linked"
    linked.symlink_to(outside.parent, target_is_directory=True)
    (outside.parent / ".c.npy.x4.tmp").write_text("not rotarium's to remove through a link")
    with pytest.raises(ValueError, match="symbolic link"):
        remove_temporary_files(linked)
    assert sorted(os.listdir(outside.parent)) == [".c.npy.x4.tmp", "secret.txt"]
