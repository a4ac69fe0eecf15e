"""The rules a GBNF grammar becomes, as llama.cpp builds them (llama-grammar.h): each rule
a list of (element type, value) pairs, its alternatives ended by ALT and the rule by END;
and the errors a grammar is refused with. Shared by the parser
(`dispatcher.common.grammar`) and the analysis of what the rules cost llama.cpp
(`dispatcher.common.grammar_cost`)."""
from __future__ import annotations

from dataclasses import dataclass

# element types (llama_gretype)
END, ALT, RULE_REF, CHAR, CHAR_NOT, CHAR_RNG_UPPER, CHAR_ALT, CHAR_ANY, TOKEN, TOKEN_NOT = \
    range(10)
UNBOUNDED = -1


class GrammarError(ValueError):
    """The grammar does not parse (llama.cpp's parser refuses it too)."""


class GrammarRefused(GrammarError):
    """llama.cpp would take the grammar, but it could never work (nothing could match, or
    llama.cpp would loop) or it would cost more than this server allows."""


class GrammarTooLarge(GrammarRefused):
    """The grammar would cost more than this server allows."""


@dataclass
class Grammar:
    rules: list[list[tuple[int, int]]]
    symbols: dict[str, int]
    elements: int
    tokens: list[tuple[int, str]]          # (id or -1, text) of each <token> reference

    @property
    def root(self) -> int:
        return self.symbols["root"]


def ends(element: tuple[int, int]) -> bool:
    """Whether the element ends an alternative (ALT) or the rule (END)."""
    return element[0] in (END, ALT)


def alternatives(rule: list) -> list[tuple[int, int]]:
    """(start, end) of each alternative of a rule (end: its ALT or END element)."""
    spans, start = [], 0
    for i, element in enumerate(rule):
        if ends(element):
            spans.append((start, i))
            start = i + 1
    return spans
