"""A grammar's alphabet (workers/engine/alphabet.py): the tokens it could ever accept,
a superset of what llama.cpp's grammar allows, and the picks it changes none of. The
first tests are unit tests over a made-up vocabulary; the last ones load the bundled
model in-process and compare with llama.cpp's own grammar sampler."""
import os

import numpy as np
import pytest

from dispatcher.common import grammar as gbnf
from workers.engine import alphabet
from workers.engine.alphabet import MAX_CODE_POINT, TokenTexts, grammar_ranges
from workers.sampling import SamplingParams

THREADS = len(os.sched_getaffinity(0))


def ranges(text):
    return grammar_ranges(gbnf.check(text))


def test_classes_literals_and_negations_become_code_point_ranges():
    assert ranges('root ::= "ab" [c-e] [x]') == ([(ord("a"), ord("e")), (ord("x"), ord("x"))],
                                                 set())
    assert ranges("root ::= [^e]*") == ([(0, ord("e") - 1), (ord("e") + 1, MAX_CODE_POINT)],
                                        set())
    assert ranges("root ::= [^a-c0]") == ([(0, ord("0") - 1), (ord("0") + 1, ord("a") - 1),
                                          (ord("c") + 1, MAX_CODE_POINT)], set())
    assert ranges('root ::= "一" | <[7]> "z"') == ([(ord("z"), ord("z")),
                                                   (0x4E00, 0x4E00)], {7})
    assert ranges('root ::= "a" | other\nother ::= [b-c]+') == ([(ord("a"), ord("c"))], set())


@pytest.mark.parametrize("text", ["root ::= .*", "root ::= !<[3]>", 'root ::= <hi> "a"'])
def test_any_character_any_token_or_a_token_by_its_text_has_no_alphabet(text):
    assert ranges(text) is None


VOCAB = ["", "a", "ab", "e", "be", "yes", "no", "n", "\u4e00", "x\u4e00", "<eos>", "0", "9"]
PIECES = [t.encode() for t in VOCAB] + [b"\xe4\xb8"]          # (a character's first bytes)
EOS = VOCAB.index("<eos>")


def texts():
    made = TokenTexts(len(PIECES), PIECES.__getitem__, lambda t: t == EOS)
    made.build()
    return made


def kept(made, grammar):
    ids = made.allowed_ids(grammar)
    return None if ids is None else {PIECES[i] for i in ids}


def test_a_token_is_kept_when_every_character_is_in_the_alphabet(monkeypatch):
    import workers.engine.alphabet as alphabet
    monkeypatch.setattr(alphabet, "USEFUL_SHARE", 1.0)
    made = texts()
    always = {b"", b"<eos>", b"\xe4\xb8"}          # no text, the end, a split character
    assert kept(made, 'root ::= "yes" | "no"') == always | {b"yes", b"no", b"n", b"e"}
    assert kept(made, "root ::= [0-9]+") == always | {b"0", b"9"}
    assert kept(made, 'root ::= "x" "一"') == always | {"\u4e00".encode(), "x\u4e00".encode()}
    assert kept(made, "root ::= <[5]>") == always | {b"yes"}
    # every printable ASCII character: not worth a pass
    assert kept(made, "root ::= [ -~]*") is None


def test_a_mask_keeping_most_of_the_vocabulary_is_not_used():
    assert kept(texts(), "root ::= [^e]*") is not None           # 11 of 14
    assert kept(texts(), "root ::= [^q]*") is None               # every one: over 90%


def test_a_grammars_alphabet_is_kept_for_its_own_tenant_only(monkeypatch):
    """A grammar's alphabet (its check, up to ~0.8 s) is made once per tenant: kept for
    every key, another key's grammar was answered sooner, an oracle of its grammars."""
    from workers.engine import samplers
    made, calls = texts(), []
    real = made._allowed
    monkeypatch.setattr(made, "_allowed", lambda g: calls.append(g) or real(g))
    for tenant in ("a", "a", "b", None, "b", None):
        assert made.allowed_ids("root ::= [0-9]+", tenant) is not None
    assert len(calls) == 3
    # kept for all keys together: a key sending many grammars pushes out its own
    for i in range(3 * alphabet.KEPT_MASKS):
        made.allowed_ids(f"root ::= [0-{i % 10}]+ \"{i}\"", "flood")
    made.allowed_ids("root ::= [0-9]+", "a")
    assert len(calls) == 3 + 3 * alphabet.KEPT_MASKS
    # the worker's own check of a grammar's token references, the same way
    verdicts, checked = samplers.TenantLRU(samplers.KEPT_VERDICTS), []
    monkeypatch.setattr(samplers.gbnf, "check", lambda *a, **k: checked.append(a))
    for tenant in ("a", "a", "b"):
        samplers.check_grammar("root ::= <[7]>", 100, verdicts=verdicts, tenant=tenant)
    assert len(checked) == 2
    for i in range(3 * samplers.KEPT_VERDICTS):
        samplers.check_grammar(f'root ::= "{i}"', 100, verdicts=verdicts, tenant="flood")
    samplers.check_grammar("root ::= <[7]>", 100, verdicts=verdicts, tenant="a")
    samplers.check_grammar("root ::= <[7]>", 100, verdicts=verdicts, tenant="b")
    assert len(checked) == 2 + 3 * samplers.KEPT_VERDICTS


def test_a_grammar_asking_before_the_texts_are_made_waits_for_them():
    """Whether a chain has its alphabet never depends on timing (one seed, one text):
    asking starts the texts and waits; once the engine closes, none is made."""
    made = TokenTexts(len(PIECES), PIECES.__getitem__, lambda t: t == EOS)
    assert made.allowed_ids("root ::= [0-9]+") is not None
    closed = TokenTexts(len(PIECES), PIECES.__getitem__, lambda t: t == EOS)
    closed.close()
    assert closed.allowed_ids("root ::= [0-9]+") is None


# -- against llama.cpp's own grammar sampler (the bundled model, in-process) ---------------
@pytest.fixture(scope="module")
def engine():
    from dispatcher.common.models import bundled_model_path
    from workers.engine.llama import LlamaEngine
    made = LlamaEngine(str(bundled_model_path()), 1024, 1, THREADS, 0, draft_max=0)
    made.candidates.texts.build()
    yield made
    made.close()


GRAMMARS = ["root ::= [^e]*", 'root ::= "yes" | "no" | "maybe"', "root ::= [0-9]+ [.]?",
            'root ::= [a-z ,.]* "!"', 'root ::= "一" [二-十]*', "root ::= [^a-zA-Z0-9 ]+",
            'root ::= ("x" | <[106]>)+']


@pytest.mark.integration
@pytest.mark.parametrize("grammar", GRAMMARS)
def test_every_token_llama_cpp_allows_at_the_start_is_in_the_alphabet(engine, grammar):
    lib, candidates = engine.lib, engine.candidates
    sampler = lib.llama_sampler_init_grammar(engine.vocab, grammar.encode(), b"root")
    try:
        array = candidates.whole(np.zeros(engine.n_vocab, dtype=np.float32))
        lib.llama_sampler_apply(sampler, array)
        allowed = set(np.flatnonzero(np.isfinite(candidates.data["logit"])).tolist())
    finally:
        lib.llama_sampler_free(sampler)
    ids = candidates.texts.allowed_ids(grammar)
    assert allowed
    if ids is not None:
        assert allowed <= set(ids.tolist())
        assert len(ids) < engine.n_vocab


def run(engine, sampling, prompt="The history of the Roman Empire, part one, is", n=40):
    from test_engine import sampled
    return sampled(engine, prompt, sampling, n)


@pytest.mark.integration
@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=0.8, top_k=40,
                                                                seed=7)])
def test_the_alphabet_changes_no_pick(engine, monkeypatch, params):
    """Greedy and top-k: token for token what the whole vocabulary gives (the grammar
    applied to the alphabet's tokens alone, where the whole vocabulary is refused)."""
    from workers.engine import samplers
    monkeypatch.setattr(samplers, "TOP_CANDIDATES", 0)           # the refused path each time
    sampling = SamplingParams(grammar="root ::= [^e]*", **params)
    texts = engine.candidates.texts
    assert texts.allowed_ids("root ::= [^e]*") is not None
    subsets = []
    real = samplers.Candidates.subset
    monkeypatch.setattr(samplers.Candidates, "subset",
                        lambda self, logits, ids: subsets.append(len(ids)) or
                        real(self, logits, ids))
    with_alphabet = run(engine, sampling)
    assert subsets, "the grammar was never fought"
    monkeypatch.setattr(engine.candidates, "texts", None)
    assert run(engine, sampling) == with_alphabet
    assert b"e" not in b"".join(engine.piece(t) for t in with_alphabet)


@pytest.mark.integration
def test_a_sampled_fought_grammar_draws_from_its_alphabet_and_never_from_the_whole(
        engine, monkeypatch):
    """A temperature alone: drawn at once from the alphabet's tokens, the grammar obeyed,
    and never applied to the whole vocabulary (the cost that slowed its neighbours)."""
    from workers.engine import samplers
    wholes = []
    real = samplers.Candidates.whole
    monkeypatch.setattr(samplers.Candidates, "whole",
                        lambda self, logits: wholes.append(1) or real(self, logits))
    for seed in (1, 2, 3):
        tokens = run(engine, SamplingParams(temperature=0.8, seed=seed,
                                            grammar="root ::= [^e]*"))
        assert b"e" not in b"".join(engine.piece(t) for t in tokens)
    assert not wholes
