"""Saving matplotlib figures the way every other file is written (:func:`rotarium.utils.files.write_file_atomic`)."""
from __future__ import annotations

import os
from typing import Any

from rotarium.utils.files import write_file_atomic


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 120) -> None:
    """Writes the matplotlib figure ``fig`` to ``path`` as a PNG, atomically and never through a link, then closes
    it."""
    import matplotlib.pyplot as plt

    try:
        write_file_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi))
    finally:
        plt.close(fig)
