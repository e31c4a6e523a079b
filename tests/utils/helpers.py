"""A file outside a run folder and links to it, for the tests that no write goes through a link."""
from pathlib import Path

SECRET = "a file outside the run, which must stay as it is\n"


def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "elsewhere" / "secret.txt"
    path.parent.mkdir()
    path.write_text(SECRET)
    return path


def plant_link(path: Path, target: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to(target)
