"""Integer bounds in JSON schemas (dispatcher/common/intrange.py): the grammar of the
integers between two bounds takes exactly them, as JSON writes them."""
import random

import pytest

from dispatcher.common import intrange
from test_schemagrammar import _texts_of


def _written(least, most, length):
    """Every integer in the bounds whose JSON text has at most `length` characters."""
    low = -(10 ** (length - 1)) + 1 if least is None else least
    high = 10 ** length - 1 if most is None else most
    return {str(i) for i in range(max(low, -(10 ** (length - 1)) + 1), high + 1)
            if len(str(i)) <= length}


BOUNDS = [(0, 100), (1, 9), (5, 5), (-5, 5), (-100, -3), (0, 0), (10, 19), (99, 1000),
          (123, 4567), (None, 7), (None, -20), (-30, None), (250, None), (None, None),
          (0, None), (-1, -1), (1, None), (9, 10), (998, 1002)]


@pytest.mark.parametrize("least, most", BOUNDS + [
    tuple(sorted(random.Random(seed).sample(range(-2000, 12000), 2))) for seed in range(20)])
def test_the_grammar_takes_exactly_the_integers_within_the_bounds(least, most):
    grammar = f"root ::= {intrange.integer_range(least, most)}\n"
    assert _texts_of(grammar, "-0123456789", 4) == _written(least, most, 4)


@pytest.mark.parametrize("schema, bounds", [
    ({"minimum": 0, "maximum": 100}, (0, 100)),
    ({"exclusiveMinimum": 0, "exclusiveMaximum": 10}, (1, 9)),
    ({"minimum": 0.5, "maximum": 2.5}, (1, 2)),
    ({"exclusiveMinimum": 0.5}, (1, None)),
    ({"minimum": 3, "exclusiveMinimum": True, "maximum": 5, "exclusiveMaximum": True},
     (4, 4)),                                              # (draft 4's booleans)
    ({"minimum": 0, "exclusiveMinimum": 5}, (6, None)),    # (the tighter of the two)
    ({"maximum": -1}, (None, -1)), ({}, (None, None))])
def test_schema_bounds_are_the_least_and_greatest_integers_allowed(schema, bounds):
    assert intrange.integer_bounds(schema) == bounds


def test_bounds_no_integer_lies_within_are_refused():
    with pytest.raises(intrange.EmptyRange):
        intrange.integer_bounds({"minimum": 0.2, "maximum": 0.8})
    with pytest.raises(intrange.EmptyRange):          # (more digits than are written)
        intrange.integer_bounds({"minimum": 1e300})
    # bounds past what is written are no bounds
    assert intrange.integer_bounds({"minimum": -1e300, "maximum": 10 ** 400}) == (None, None)
