"""argparse value types shared by the sub-commands."""
from __future__ import annotations

import argparse
from collections.abc import Callable


def int_list(flag: str, minimum: int = 1) -> Callable[[str], list[int]]:
    """An argparse type: ``"64,128"`` -> ``[64, 128]``, every value at least ``minimum``, errors naming ``flag``."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes integers separated by commas, got {text!r}") from None
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"{flag} must be integers >= {minimum}, got {text!r}")
        return values
    return parse
