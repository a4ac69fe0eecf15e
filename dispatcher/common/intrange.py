"""A JSON Schema integer's bounds (`minimum`, `maximum`, `exclusiveMinimum`,
`exclusiveMaximum`) as a GBNF choice of the integers between them, written as JSON writes
them (no leading zeros, `-` for negatives, no `-0`). llama-cpp-python's converter left the
bounds out (its own TODO), so `{"type": "integer", "minimum": 0, "maximum": 100}` let the
model write -5 or 1000: JSON that the schema refuses. llama-server's converter keeps them.
"""
from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

DIGITS = 16                 # the most digits an unbounded side writes (the converter's own)
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


class EmptyRange(ValueError):
    """No integer lies within the bounds."""


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if isinstance(value, int) or math.isfinite(value) else None


def _refuse_infinite_bounds(schema: dict, kind: str) -> None:
    """EmptyRange for a lower bound of +inf or an upper one of -inf (1e400 in JSON reads
    as infinity: such a bound was taken for none, and `minimum: 1e400` allowed -5);
    the other infinities are no bound."""
    for name, beyond in (("minimum", math.inf), ("exclusiveMinimum", math.inf),
                         ("maximum", -math.inf), ("exclusiveMaximum", -math.inf)):
        value = schema.get(name)
        if isinstance(value, float) and value == beyond:
            raise EmptyRange(f"no {kind} lies beyond its {name} ({beyond})")


def integer_bounds(schema: dict) -> tuple[int | None, int | None]:
    """The least and greatest integers `schema` allows (None: no bound). Draft 4's
    boolean `exclusiveMinimum`/`exclusiveMaximum` make `minimum`/`maximum` exclusive;
    later drafts give them as numbers."""
    _refuse_infinite_bounds(schema, "integer")
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


FRACTION_DIGITS = 16        # the most digits a fraction is written with (the converter's)


def number_bounds(schema: dict):
    """A number's bounds as (least, least exclusive, most, most exclusive), each bound
    a Decimal or None (a bound past 16 whole digits is none; one with more than 16
    after the point is the nearest number written with 16 within it)."""
    _refuse_infinite_bounds(schema, "number")
    bounds = []
    for inclusive, exclusive in (("minimum", "exclusiveMinimum"),
                                 ("maximum", "exclusiveMaximum")):
        value, strict = _number(schema.get(inclusive)), schema.get(exclusive)
        if _number(strict) is not None:          # (a number: later drafts)
            value, strict = (strict, True) if value is None or \
                (strict >= value if inclusive == "minimum" else strict <= value) \
                else (value, False)
        strict = strict is True and value is not None
        if value is not None:
            value = Decimal(str(value))
            beyond = value >= 10 ** DIGITS if inclusive == "minimum" else \
                value <= -10 ** DIGITS
            if beyond:
                raise EmptyRange(f"its bounds ask for numbers of more than {DIGITS} digits")
            if abs(value) >= 10 ** DIGITS:
                value = None                    # (past what is written: no bound)
            elif -value.as_tuple().exponent > FRACTION_DIGITS:
                # between two numbers written with 16 decimals: the nearer one within,
                # which is within whether the bound is open or not
                value = value.quantize(Decimal(10) ** -FRACTION_DIGITS, rounding=(
                    ROUND_CEILING if inclusive == "minimum" else ROUND_FLOOR))
                strict = False
        bounds += [value, strict]
    least, least_open, most, most_open = bounds
    if least is not None and most is not None and (
            least > most or (least == most and (least_open or most_open))):
        raise EmptyRange(f"no number lies between its bounds ({least}, {most})")
    return tuple(bounds)


def _fraction_digits(value: Decimal) -> str:
    """The digits after the point of `value` (>= 0), trailing zeros left out."""
    text = f"{value:f}"
    return text.split(".")[1].rstrip("0") if "." in text else ""


def _nonzero(room: int) -> str:
    """Digit strings of 1..room digits that are not all zeros."""
    if room == 1:
        return "[1-9]"
    return f'[1-9] [0-9]{{0,{room - 1}}} | "0" ({_nonzero(room - 1)})'


def _fractions(low: str | None, low_open: bool, high: str | None, high_open: bool,
               used: int = 0) -> tuple[bool, list[str]]:
    """The digit strings s (after a point, `used` digits already written, 16 in all)
    with low <(=) 0.s <(=) high, where `low` and `high` are digit strings (None: that
    side is already settled): whether the empty one is among them, and sequences for
    the others."""
    empty = (low is None or (low == "" and not low_open)) and \
        (high is None or high != "" or not high_open)
    room = FRACTION_DIGITS - used
    if room <= 0:
        return empty, []
    if low in (None, "") and high in (None, ""):     # (what is left of a bound is zero)
        if high is None:
            return (True, [f"[0-9]{{1,{room}}}"]) if low is None or not low_open \
                else (False, [_nonzero(room)])
        closed = not high_open and (low is None or not low_open)
        return (True, [f'"0"{{1,{room}}}']) if closed else (False, [])
    low_digit = int(low[0]) if low else 0
    high_digit = int(high[0]) if high else (0 if high is not None else 9)
    out = []
    for first, last in ((0, low_digit - 1), (low_digit, low_digit),
                        (low_digit + 1, 9)):
        for f, l in ((first, min(last, high_digit - 1)), (max(first, high_digit),
                                                          min(last, high_digit)),
                     (max(first, high_digit + 1), last)):
            if f > l:
                continue
            below = low is not None and l < low_digit
            above = high is not None and f > high_digit
            if below or above:
                continue
            next_low = None if low is None or f > low_digit else low[1:]
            next_high = None if high is None or l < high_digit else high[1:]
            rest_empty, rest = _fractions(next_low, low_open, next_high, high_open,
                                          used + 1)
            digit = f'"{f}"' if f == l else f"[{f}-{l}]"
            if rest:
                tail = "(" + " | ".join(rest) + ")" + ("?" if rest_empty else "")
                out.append(f"{digit} {tail}")
            elif rest_empty:
                out.append(digit)
    return empty, out


def _fraction(low: str | None, low_open: bool, high: str | None, high_open: bool
              ) -> str | None:
    """The fraction part (none, or a point and digits) for those bounds; None if no
    fraction can be."""
    empty, digits = _fractions(low, low_open, high, high_open)
    if not digits:
        return "" if empty else None
    part = '"." (' + " | ".join(digits) + ")"
    return f"({part})?" if empty else part


def _magnitudes(low: Decimal, low_open: bool, high: Decimal | None, high_open: bool
                ) -> list[str]:
    """Sequences matching the numbers m, low <(=) m <(=) high (low >= 0), written
    without a sign or an exponent: the whole part's range with any fraction, and at
    each bound's whole part the fraction its digits allow."""
    out = []
    low_whole, low_digits = int(low), _fraction_digits(low)
    high_whole = None if high is None else int(high)
    high_digits = None if high is None else _fraction_digits(high)
    if high_whole == low_whole:
        fraction = _fraction(low_digits, low_open, high_digits, high_open)
        return [] if fraction is None else \
            [f"{seq} {fraction}".strip() for seq in _naturals(low_whole, low_whole)]
    fraction = _fraction(low_digits, low_open, None, False)
    if fraction is not None:
        out += [f"{seq} {fraction}".strip() for seq in _naturals(low_whole, low_whole)]
    if high_whole is None or low_whole + 1 <= high_whole - 1:
        inner = None if high_whole is None else high_whole - 1
        out += [f"{seq} {_fraction(None, False, None, False)}"
                for seq in _naturals(low_whole + 1, inner)]
    if high_whole is not None:
        fraction = _fraction(None, False, high_digits, high_open)
        if fraction is not None:
            out += [f"{seq} {fraction}".strip() for seq in _naturals(high_whole, high_whole)]
    return out


def number_range(bounds) -> str:
    """A GBNF choice of the numbers within `bounds` (number_bounds'), without an
    exponent."""
    least, least_open, most, most_open = bounds
    choices = []
    zero = Decimal(0)
    if least is None or least < 0:         # the negatives: -m for m within
        nearest, near_open = (zero, True) if most is None or most >= 0 else (-most, most_open)
        far, far_open = (None, False) if least is None else (-least, least_open)
        choices += [f'"-" {seq}' for seq in _magnitudes(nearest, near_open, far, far_open)]
    if most is None or most >= 0:
        low, low_open = (zero, False) if least is None or least < 0 else (least, least_open)
        choices += _magnitudes(low, low_open, most, most_open)
    return " | ".join(choices)
