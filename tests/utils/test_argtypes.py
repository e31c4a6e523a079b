"""The comma-separated integer flags (lengths, seeds, multiples) name the flag in every refusal."""
from __future__ import annotations

import argparse

import pytest

from rotarium.utils.argtypes import int_list


def test_integers_separated_by_commas_are_parsed_in_order():
    assert int_list("--context-lengths")("512,64, 128,") == [512, 64, 128]


@pytest.mark.parametrize("text, message", [
    ("64,x", "--seeds takes integers separated by commas, got '64,x'"),
    ("", "--seeds must be integers >= 0"),
    ("0,-1", "--seeds must be integers >= 0"),
    # a seed given twice would count as two seeds of a verdict; a length twice, as two rows of a table
    ("0,1,0", "--seeds names 0 more than once, got '0,1,0'; give each value once"),
])
def test_bad_values_are_refused_naming_the_flag(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match="^" + message.replace("(", r"\(")):
        int_list("--seeds", minimum=0)(text)
