"""The GBNF check (dispatcher/common/grammar.py) against llama.cpp's own parser: thousands of
grammars, valid and broken, from a seeded generator, each judged by both. What the check
accepts llama.cpp must accept; what it refuses as not parsing, llama.cpp must refuse too.
llama.cpp runs in a child process (a grammar it cannot take could crash or hang it)."""
import json
import random
import subprocess
import sys
import time

import pytest

from dispatcher.common import grammar as gbnf
from dispatcher.common.models import bundled_model_path

pytestmark = pytest.mark.integration      # llama.cpp's parser on the real model's vocabulary

ORACLE = r"""
import json, sys
import llama_cpp
quiet = llama_cpp.llama_log_callback(lambda *a: None)     # kept: llama.cpp calls it
llama_cpp.llama_log_set(quiet, None)
params = llama_cpp.llama_model_default_params()
params.vocab_only = True
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), params)
vocab = llama_cpp.llama_model_get_vocab(model)
for line in sys.stdin:
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, json.loads(line).encode(), b"root")
    print(json.dumps(bool(sampler)), flush=True)
    if sampler:
        llama_cpp.llama_sampler_free(sampler)
"""


def llama_cpp_accepts(grammars: list[str]) -> list[bool]:
    result = subprocess.run([sys.executable, "-c", ORACLE, str(bundled_model_path())],
                            input="".join(json.dumps(g) + "\n" for g in grammars),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    verdicts = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(verdicts) == len(grammars)
    return verdicts


NAMES = ["root", "a", "b", "x-1", "r2", "A9"]
GOOD_CHARS = ["a", "z", " ", "é", "\\n", "\\t", "\\\\", '\\"', "\\x41", "\\u00e9",
              "\\U0001F600", "\\]", "\\[", "\\-", "#", "|", "\u4e2d"]
BAD_CHARS = ["\\q", "\\x4", "-", "]", '"', "\\U0011ffff"]
GOOD_REPEATS = ["*", "+", "?", "{2}", "{1,3}", "{2,}", "{0,2}", "{ 2 , 4 }", "{0}",
                "{2,9000}", "**"]
BAD_REPEATS = ["{,3}", "{3,1}", "{5000}", "{", "{2", "{x}"]


class Generator:
    """Grammar texts: mostly well formed (rules that exist, constructs that parse),
    sloppy ones (names that may not exist, broken escapes, stray characters)."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def pick(self, good: list, bad: list) -> str:
        return self.rng.choice(bad if self.sloppy and self.rng.random() < 0.3 else good)

    def literal(self) -> str:
        return '"' + "".join(self.pick(GOOD_CHARS, BAD_CHARS)
                             for _ in range(self.rng.randrange(4))) + '"'

    def char_class(self) -> str:
        body = ""
        for _ in range(self.rng.randrange(1, 4)):
            body += self.pick(GOOD_CHARS, BAD_CHARS)
            if self.rng.random() < 0.4:
                body += "-" + self.pick(["\U0001F600", "\u4e2d", "z", "é"], BAD_CHARS)
        return "[" + ("^" if self.rng.random() < 0.3 else "") + body + "]"

    def item(self, depth: int) -> str:
        rng, roll = self.rng, self.rng.random()
        if roll < 0.25:
            out = self.literal()
        elif roll < 0.45:
            out = self.char_class()
        elif roll < 0.6:
            out = rng.choice(self.names if not self.sloppy else NAMES)
        elif roll < 0.72 and depth < 3:
            sep = rng.choice([" | ", "|", " |\n  ", "\n| "])
            out = "(" + sep.join(self.sequence(depth + 1)
                                 for _ in range(rng.randrange(1, 3))) \
                + self.pick([")", " )", "\n)"], ["", "))"])
        elif roll < 0.8:
            out = "."
        elif roll < 0.86:
            out = self.pick(["<[12]>", "!<[3]>", "<[0]>"], ["<[99999999999]>", "<[x]>",
                                                           "<[5>", "!x"])
        else:
            out = ""
        if rng.random() < 0.35:
            out += self.pick(GOOD_REPEATS, BAD_REPEATS)
        return out

    def sequence(self, depth: int = 0) -> str:
        return " ".join(self.item(depth) for _ in range(self.rng.randrange(0, 4)))

    def grammar(self) -> str:
        rng = self.rng
        self.sloppy = rng.random() < 0.5
        self.names = ["root"] + rng.sample(NAMES[1:], rng.randrange(0, 3))
        rules = []
        for name in self.names:
            alternates = " | ".join(self.sequence() for _ in range(rng.randrange(1, 3)))
            arrow = self.pick(["::=", " ::=  "], [":=", "::"])
            rules.append(f"{name} {arrow} {alternates}" + rng.choice(["", " # comment", "\r"]))
        text = rng.choice(["\n", "\n\n", "\r\n"]).join(rules) + rng.choice(["", "\n"])
        for _ in range(rng.choice([0, 1]) if self.sloppy else 0):     # a stray edit
            at = rng.randrange(len(text) + 1)
            text = text[:at] + rng.choice('()[]"{}|:=\\\n<>#?') + text[at + 1:]
        return text


def test_the_check_agrees_with_llama_cpp_on_generated_grammars():
    generator = Generator(random.Random(20261201))
    grammars = [generator.grammar() for _ in range(4000)]
    verdicts = {}
    for g in grammars:
        try:
            gbnf.check(g)
            verdicts[g] = "accepted"
        except gbnf.GrammarRefused:
            verdicts[g] = "refused"         # stricter than llama.cpp on purpose
        except gbnf.GrammarError:
            verdicts[g] = "invalid"
    asked = [g for g in dict.fromkeys(grammars) if verdicts[g] != "refused"]
    llama = dict(zip(asked, llama_cpp_accepts(asked)))
    accepted = [g for g in asked if verdicts[g] == "accepted"]
    invalid = [g for g in asked if verdicts[g] == "invalid"]
    print(f"{len(accepted)} accepted, {len(invalid)} invalid, "
          f"{len(grammars) - len(asked)} refused or repeated")
    assert len(accepted) > 500 and len(invalid) > 500      # both kinds were exercised
    assert [g for g in accepted if not llama[g]] == []
    assert [g for g in invalid if llama[g]] == []


@pytest.mark.parametrize("grammar", [
    'root ::= "a"', 'root ::= [a-z]+ ("," [0-9]{1,3})* "."', "root ::= x?\nx ::= \"a\" root",
    'root ::= "x" # a comment\n\n  # another\nitem ::= "y"\n', 'root ::= <[12]> !<[3]>',
    'root ::= ( "a"\n  | "b" )\n', 'root ::= [\\]\\-\\\\]', 'root ::= "\\U0001F600"{0,2000}',
])
def test_grammars_llama_cpp_takes_are_taken(grammar):
    gbnf.check(grammar)
    assert llama_cpp_accepts([grammar]) == [True]


def chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + \
        f'r{n} ::= "x"\n'


@pytest.mark.parametrize("grammar, words", [
    (chain(75_000), "characters"),                             # crashed a worker
    (chain(gbnf.MAX_LEFT_DEPTH + 10), "deep"),                 # within the size limit
    ('root ::= "' + "a" * 50_000 + '"{2000}', "elements"),     # 1.6 GB in a worker
    ("root ::= r0\n" + "".join(f"r{i} ::= r{i + 1} | r{i + 1}\n" for i in range(40))
     + 'r40 ::= "x"\n', "ways"),                               # 2^40 calls in llama.cpp
    ("root ::= " + "(" * 101 + '"a"' + ")" * 101, "nests"),
    # 596 characters whose repetitions make 98,001 rules: 2.7 s a check, three a request
    ("root ::= " + " ".join(['"a"{0,2000}'] * 49), "rules"),
])
def test_costly_grammars_are_refused_quickly(grammar, words):
    started = time.perf_counter()
    with pytest.raises(gbnf.GrammarTooLarge) as caught:
        gbnf.check(grammar)
    assert words in str(caught.value)
    print(f"refused in {time.perf_counter() - started:.3f} s: {caught.value}")


@pytest.mark.parametrize("grammar, words", [
    ("root ::= [\\U0010FFFF-\\x00]", "empty character range"),
    ('root ::= "a"{3,1}', "maximum is below its minimum"),    # llama.cpp would loop
    ('root ::= "\\UFFFFFFFF"', "above U+10FFFF"),
    ('root ::= "a"\x00garbage', "NUL"),
])
def test_grammars_that_could_never_work_are_refused(grammar, words):
    with pytest.raises(gbnf.GrammarRefused) as caught:
        gbnf.check(grammar)
    assert words in str(caught.value)


def test_token_references_are_checked_against_the_vocabulary():
    gbnf.check("root ::= <[999999]>")                 # the front end has no vocabulary
    with pytest.raises(gbnf.GrammarRefused, match="outside the vocabulary"):
        gbnf.check("root ::= <[999999]>", n_vocab=1000)
    one = {"<think>": 7}.get
    gbnf.check("root ::= <think>", n_vocab=1000, token_of=one)
    with pytest.raises(gbnf.GrammarError, match="not one token"):
        gbnf.check("root ::= <thinking>", n_vocab=1000, token_of=one)


@pytest.mark.parametrize("grammar", ['root ::= "\\x00"', 'root ::= "a\\u0000b" | "c"',
                                     "root ::= [\\x00]", "root ::= [\\x00-\\x00]",
                                     'root ::= x\nx ::= "\\U00000000"'])
def test_a_nul_asked_for_is_refused(grammar):
    """llama.cpp reads a token's text up to a NUL: a grammar that needs one failed midway
    through generation ("the grammar allows no token here", a 500)."""
    with pytest.raises(gbnf.GrammarRefused, match="NUL"):
        gbnf.check(grammar)


@pytest.mark.parametrize("grammar", ["root ::= [\\x00-\\x1f]", "root ::= [^\\x00]",
                                     "root ::= [a\\x00]", 'root ::= "\\x01"',
                                     "root ::= [\\x00-\\x00a]", "root ::= [a\\uD800]",
                                     "root ::= [^\\uD800-\\uDFFF]+",
                                     'root ::= "\\U0001F600"'])
def test_a_class_that_allows_more_than_nul_is_not(grammar):
    gbnf.check(grammar)


@pytest.mark.parametrize("grammar", ['root ::= "\\uD83D\\uDE00"',
                                     "root ::= [\\uD800-\\uDFFF]+",
                                     'root ::= "a" [\\uDC00]'])
def test_a_surrogate_asked_for_is_refused(grammar):
    """No UTF-8 text holds a UTF-16 surrogate: a grammar that needs one could be met
    only by byte tokens that are not UTF-8 (the answer's text broken). Refused, saying
    to write the character itself."""
    with pytest.raises(gbnf.GrammarRefused, match="surrogate U\\+D[89A-F]"):
        gbnf.check(grammar)


def test_an_end_of_generation_token_asked_for_is_refused():
    """llama.cpp lets an end token through only where the grammar is complete, so one the
    grammar asks for never comes (a 500 midway); one it forbids is fine."""
    ends = {1, 106}.__contains__
    one = {"<eos>": 1, "<start>": 2}.get
    for grammar in ("root ::= <[1]>", 'root ::= "a" <eos>', "root ::= x\nx ::= <[106]>"):
        with pytest.raises(gbnf.GrammarRefused, match="ends generation"):
            gbnf.check(grammar, 1000, one, ends)
    for grammar in ('root ::= !<[1]> "a"', "root ::= <start>", "root ::= <[5]>"):
        gbnf.check(grammar, 1000, one, ends)


def test_errors_say_where():
    with pytest.raises(gbnf.GrammarError, match=r"line 2, column 11"):
        gbnf.check('root ::= a\na ::= "x" )')


@pytest.mark.parametrize("grammar", ["root ::= [^\\x00-\\U0010FFFF]",
                                     "root ::= [^\\x01-\\U0010FFFF]",
                                     "root ::= [^a-\\U0010FFFF\\x01-b]",
                                     'root ::= "x" [^\\x00-\\x7f\\x80-\\U0010FFFF]'])
def test_a_negated_class_that_leaves_no_character_is_refused(grammar):
    """A class negating every character can never match, as an empty range cannot:
    llama.cpp let a partial UTF-8 sequence's bytes through it, and the answer (200,
    finish_reason stop) was not UTF-8."""
    with pytest.raises(gbnf.GrammarRefused, match="leaves no character"):
        gbnf.check(grammar)


@pytest.mark.parametrize("grammar", ["root ::= [^\\x02-\\U0010FFFF]", "root ::= [^a]",
                                     "root ::= [^\\x00-\\x7f]"])
def test_a_negated_class_that_leaves_some_is_fine(grammar):
    gbnf.check(grammar)
