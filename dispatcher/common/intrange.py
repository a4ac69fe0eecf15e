"""A JSON Schema integer's bounds (`minimum`, `maximum`, `exclusiveMinimum`,
`exclusiveMaximum`) as a GBNF choice of the integers between them, written as JSON writes
them (no leading zeros, `-` for negatives, no `-0`). llama-cpp-python's converter left the
bounds out (its own TODO), so `{"type": "integer", "minimum": 0, "maximum": 100}` let the
model write -5 or 1000: JSON that the schema refuses. llama-server's converter keeps them.
"""
from __future__ import annotations

import math

DIGITS = 16                 # the most digits an unbounded side writes (the converter's own)
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


class EmptyRange(ValueError):
    """No integer lies within the bounds."""


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if isinstance(value, int) or math.isfinite(value) else None


def integer_bounds(schema: dict) -> tuple[int | None, int | None]:
    """The least and greatest integers `schema` allows (None: no bound). Draft 4's
    boolean `exclusiveMinimum`/`exclusiveMaximum` make `minimum`/`maximum` exclusive;
    later drafts give them as numbers."""
    low, high = _number(schema.get("minimum")), _number(schema.get("maximum"))
    ex_low, ex_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    least = None if low is None else (math.floor(low) + 1 if ex_low is True else math.ceil(low))
    most = None if high is None else (math.ceil(high) - 1 if ex_high is True else math.floor(high))
    if _number(ex_low) is not None:
        bound = math.floor(ex_low) + 1
        least = bound if least is None else max(least, bound)
    if _number(ex_high) is not None:
        bound = math.ceil(ex_high) - 1
        most = bound if most is None else min(most, bound)
    if least is not None and most is not None and least > most:
        raise EmptyRange(f"no integer lies between its bounds ({least} > {most})")
    # (past DIGITS digits a bound says nothing an integer written here could reach)
    least = None if least is not None and least <= -10 ** DIGITS else least
    most = None if most is not None and most >= 10 ** DIGITS else most
    if (least or 0) >= 10 ** DIGITS or (most or 0) <= -10 ** DIGITS:
        raise EmptyRange(f"its bounds ask for integers of more than {DIGITS} digits")
    return least, most


def _digit(low: str, high: str) -> str:
    return f'"{low}"' if low == high else f"[{low}-{high}]"


def _same_length(low: str, high: str) -> list[str]:
    """Sequences matching exactly the decimal strings from `low` to `high`, both of
    one length (`low` <= `high`)."""
    if low == high:
        return [f'"{low}"']
    n = len(low)
    if low == "0" * n and high == "9" * n:
        return ["[0-9]" if n == 1 else f"[0-9]{{{n}}}"]
    if n == 1:
        return [_digit(low, high)]
    if low[0] == high[0]:
        return [f'"{low[0]}" {rest}' for rest in _same_length(low[1:], high[1:])]
    out = [f'"{low[0]}" {rest}' for rest in _same_length(low[1:], "9" * (n - 1))]
    if int(high[0]) - int(low[0]) > 1:
        out.append(_digit(str(int(low[0]) + 1), str(int(high[0]) - 1)) + " "
                   + _same_length("0" * (n - 1), "9" * (n - 1))[0])
    out += [f'"{high[0]}" {rest}' for rest in _same_length("0" * (n - 1), high[1:])]
    return out


def _naturals(least: int, most: int | None) -> list[str]:
    """Sequences matching the integers `least`..`most` (>= 0; None: any number of
    digits up to DIGITS) as JSON writes them."""
    out = []
    if least == 0:
        out.append('"0"')
        least = 1
    top = most if most is not None else 10 ** len(str(least)) - 1
    if top < least:
        return out
    for length in range(len(str(least)), len(str(top)) + 1):
        low, high = max(least, 10 ** (length - 1)), min(top, 10 ** length - 1)
        out += _same_length(str(low), str(high))
    longer = len(str(top))
    if most is None and longer < DIGITS:       # every longer number
        out.append(f"[1-9] [0-9]{{{longer},{DIGITS - 1}}}")
    return out


def integer_range(least: int | None, most: int | None) -> str:
    """A GBNF choice of the integers `least`..`most` (None: unbounded on that side)."""
    choices = []
    if least is None or least < 0:
        # the negatives' magnitudes: from -(the greatest negative) to -(the least)
        nearest = -1 if most is None or most >= 0 else most
        choices += [f'"-" {seq}' for seq in _naturals(-nearest, None if least is None
                                                       else -least)]
    if most is None or most >= 0:
        choices += _naturals(0 if least is None else max(least, 0), most)
    return " | ".join(choices)


# a fraction (as JSON writes it, up to 16 digits as the converter's numbers): any, one
# of zeros only, one that is not zero
ANY_FRACTION = '("." [0-9]{1,16})?'
ZERO_FRACTION = '("." "0"{1,16})?'
NONZERO_FRACTION = '"." "0"{0,15} [1-9] [0-9]{0,15}'


def number_bounds(schema: dict):
    """A number's bounds as (least, least exclusive, most, most exclusive), each bound
    an integer or None; None for all where a bound is not a whole number (such bounds
    are left out, as the converter and llama-server leave them)."""
    bounds = []
    for inclusive, exclusive in (("minimum", "exclusiveMinimum"),
                                 ("maximum", "exclusiveMaximum")):
        value, strict = _number(schema.get(inclusive)), schema.get(exclusive)
        if _number(strict) is not None:          # (a number: later drafts)
            value, strict = (strict, True) if value is None or \
                (strict >= value if inclusive == "minimum" else strict <= value) \
                else (value, False)
        if value is not None and not float(value).is_integer():
            return None
        if value is not None and abs(value) >= 10 ** DIGITS:
            value = None
        bounds += [None if value is None else int(value), strict is True and value is not None]
    least, least_open, most, most_open = bounds
    if least is not None and most is not None and (
            least > most or (least == most and (least_open or most_open))):
        raise EmptyRange(f"no number lies between its bounds ({least}, {most})")
    return tuple(bounds)


def _magnitudes(low: int, low_open: bool, high: int | None, high_open: bool) -> list[str]:
    """Sequences matching the numbers m, low <(=) m <(=) high (low >= 0), written
    without a sign or an exponent: m >= k where its whole part is; m <= k where its
    whole part is less, or is k with no fraction but zeros."""
    out = []
    first = low + 1 if low_open else low
    if low_open:                           # low itself, with a fraction that is not zero
        if high is None or low < high:
            out += [f"{seq} {NONZERO_FRACTION}" for seq in _naturals(low, low)]
    last = None if high is None else high - 1
    if last is None or first <= last:
        out += [f"{seq} {ANY_FRACTION}" for seq in _naturals(first, last)]
    if high is not None and not high_open and high >= first:
        out += [f"{seq} {ZERO_FRACTION}" for seq in _naturals(high, high)]
    return out


def number_range(bounds) -> str:
    """A GBNF choice of the numbers within `bounds` (number_bounds'), without an
    exponent."""
    least, least_open, most, most_open = bounds
    choices = []
    if least is None or least < 0:         # the negatives: -m for m within
        nearest, near_open = (0, True) if most is None or most >= 0 else (-most, most_open)
        far, far_open = (None, False) if least is None else (-least, least_open)
        choices += [f'"-" {seq}' for seq in _magnitudes(nearest, near_open, far, far_open)]
    if most is None or most >= 0:
        low, low_open = (0, False) if least is None or least < 0 else (least, least_open)
        choices += _magnitudes(low, low_open, most, most_open)
    return " | ".join(choices)
