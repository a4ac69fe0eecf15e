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
    # 1e400 reads as infinity: beyond every integer and number, not no bound (it was)
    inf = float("inf")
    for bound in ({"minimum": inf}, {"exclusiveMinimum": inf}, {"maximum": -inf},
                  {"exclusiveMaximum": -inf, "minimum": 0}):
        with pytest.raises(intrange.EmptyRange):
            intrange.integer_bounds(bound)
        with pytest.raises(intrange.EmptyRange):
            intrange.number_bounds(bound)
    assert intrange.integer_bounds({"minimum": -inf, "maximum": inf}) == (None, None)
    assert intrange.number_bounds({"minimum": -inf, "maximum": inf}) == \
        (None, False, None, False)


NUMBER_BOUNDS = [{"minimum": 0, "maximum": 1}, {"exclusiveMinimum": 0, "maximum": 2},
                 {"minimum": -1, "exclusiveMaximum": 1}, {"maximum": -2},
                 {"exclusiveMinimum": -10, "exclusiveMaximum": -9}, {"minimum": 9},
                 {"minimum": -1, "maximum": 1, "exclusiveMinimum": True},     # (draft 4)
                 {"minimum": 1, "exclusiveMinimum": 1.0}, {"maximum": 0, "minimum": 0},
                 {"exclusiveMaximum": 0}, {"minimum": 5, "exclusiveMinimum": 2},
                 {"minimum": 0.5, "maximum": 2.25}, {"exclusiveMinimum": 0.1,
                                                     "exclusiveMaximum": 1.2},
                 {"minimum": -1.5, "maximum": -0.01}, {"minimum": 0.19, "maximum": 0.2},
                 {"exclusiveMinimum": -0.9, "exclusiveMaximum": 0.09},
                 {"minimum": 1.9, "maximum": 1.9}, {"maximum": 0.01}]


@pytest.mark.parametrize("schema", NUMBER_BOUNDS)
def test_the_number_grammar_takes_exactly_the_numbers_within_the_bounds(schema):
    """Every JSON number (no exponent) of up to 5 characters over a few digits is taken
    exactly when it lies within the bounds."""
    import itertools
    import re
    from decimal import Decimal
    bounds = intrange.number_bounds(schema)
    least, least_open, most, most_open = bounds

    def within(text):
        value = Decimal(text)
        return (least is None or value > least or (value == least and not least_open)) \
            and (most is None or value < most or (value == most and not most_open))
    numbers = {"".join(chars) for n in range(1, 6)
               for chars in itertools.product("-01259.", repeat=n)}
    numbers = {t for t in numbers if re.fullmatch(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?", t)}
    grammar = f"root ::= {intrange.number_range(bounds)}\n"
    taken = _texts_of(grammar, "-01259.", 5)
    # (a negative zero is never written: 0 is)
    assert taken == {t for t in numbers if within(t) and not re.fullmatch(r"-0(\.0*)?", t)}


def test_number_bounds_past_the_digits_written_are_none_or_refused():
    from decimal import Decimal
    # (more than 16 digits after the point: the nearest written with 16, within)
    assert intrange.number_bounds({"exclusiveMinimum": 1e-20}) == (
        Decimal("1E-16"), False, None, False)
    assert intrange.number_bounds({"maximum": -1e-20}) == (
        None, False, Decimal("-1E-16"), False)
    with pytest.raises(intrange.EmptyRange):
        intrange.number_bounds({"exclusiveMinimum": 1, "maximum": 1})


def _as_regex(choice: str) -> str:
    """A GBNF choice of literals, classes, groups and bounded repetitions as a regex."""
    import re
    parts = re.findall(r'"[^"]*"|\[[^\]]*\]|\{[^}]*\}|[()|?*+]', choice)
    return "".join(re.escape(p[1:-1]) if p.startswith('"') else "(?:" if p == "(" else p
                   for p in parts)


@pytest.mark.parametrize("schema, taken, refused", [
    ({"exclusiveMinimum": 0.1}, ["0.1000000000000001", "7"], ["0.10000000000000001", "0.1"]),
    ({"exclusiveMaximum": 0.5, "minimum": 0}, ["0.4999999999999999"],
     ["0.49999999999999999", "0.5"]),
    ({"minimum": -1e-20}, ["0", "5"], ["-0.0000000000000001"]),
    ({"minimum": 2.5, "maximum": 1e300}, ["2.5", "9999999999999999"], ["2.4"])])
def test_fractions_are_written_with_16_digits_at_most(schema, taken, refused):
    """A float-based validator reads 0.10000000000000001 as 0.1: past 16 digits an
    exclusive bound's neighbour would be the bound itself."""
    import re
    pattern = re.compile(_as_regex(intrange.number_range(intrange.number_bounds(schema))))
    assert all(pattern.fullmatch(text) for text in taken)
    assert not any(pattern.fullmatch(text) for text in refused)
    with pytest.raises(intrange.EmptyRange):        # (more than 16 whole digits)
        intrange.number_bounds({"minimum": 1e16})
