"""The presets' parameter counts, from models built on the meta device: ``python -m rotarium.configs.param_table``."""
from __future__ import annotations

from typing import Any

import torch

from rotarium.configs.presets import PRESETS, preset_config
from rotarium.layers import POSITION_ENCODINGS
from rotarium.models import FAMILY_MODELS


def parameter_count(name: str, **overrides: Any) -> int:
    config = preset_config(name, **overrides)
    with torch.device("meta"):
        model = FAMILY_MODELS[config.family].lm(config)
    return sum(p.numel() for p in model.parameters())


def markdown_table() -> str:
    rows = ["| preset | " + " | ".join(POSITION_ENCODINGS) + " |", "|---|" + "---|" * len(POSITION_ENCODINGS)]
    for name in PRESETS:
        counts = [parameter_count(name, position_encoding=pe) for pe in POSITION_ENCODINGS]
        rows.append(f"| {name} | " + " | ".join(f"{c / 1e6:,.1f}M" for c in counts) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
