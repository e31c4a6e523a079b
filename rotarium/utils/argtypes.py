"""argparse value types shared by the sub-commands."""
from __future__ import annotations

import argparse
from collections.abc import Callable


def int_list(flag: str, minimum: int = 1) -> Callable[[str], list[int]]:
    """An argparse type: ``"64,128"`` -> ``[64, 128]``, every value at least ``minimum`` and given once, errors naming
    ``flag``."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes integers separated by commas, got {text!r}") from None
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"{flag} must be integers >= {minimum}, got {text!r}")
        # a value given twice would be counted twice: a seed as two seeds of a verdict, a length as two rows
        repeated = sorted({x for x in values if values.count(x) > 1})
        if repeated:
            raise argparse.ArgumentTypeError(f"{flag} names {', '.join(map(str, repeated))} more than once, got "
                                             f"{text!r}; give each value once")
        return values
    return parse
