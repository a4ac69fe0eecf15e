"""TextAssembler: UTF-8 safety and stop-string hold-back; and the worker's Output, which
sends a request's text, logprobs and editors' limits from its tokens (unit, a scripted
engine)."""
from workers.textstream import TextAssembler


def feed_all(assembler, pieces):
    out = [assembler.feed(p) for p in pieces]
    return out


def test_plain_text_passes_through_token_by_token():
    a = TextAssembler()
    assert feed_all(a, [b"Hel", b"lo", b" world"]) == ["Hel", "lo", " world"]
    assert a.finish() == ""


def test_multibyte_character_split_across_tokens_is_never_emitted_broken():
    a = TextAssembler()
    data = "東".encode()          # 3 bytes
    assert a.feed(data[:1]) == ""
    assert a.feed(data[1:2]) == ""
    assert a.feed(data[2:]) == "東"


def test_stop_string_across_tokens_is_cut_and_never_leaked():
    a = TextAssembler(["STOP"])
    out = feed_all(a, [b"abc S", b"T", b"O", b"P and more"])
    assert "".join(out) == "abc "
    assert out[0] == "abc "        # the possible prefix "S" was held back
    assert a.stopped
    assert a.feed(b"ignored") == ""


def test_held_prefix_is_released_when_it_stops_matching():
    a = TextAssembler(["STOP"])
    assert a.feed(b"x ST") == "x "
    assert a.feed(b"ART") == "START"


def test_held_prefix_is_flushed_at_the_end():
    a = TextAssembler(["STOP"])
    assert a.feed(b"end ST") == "end "
    assert a.finish() == "ST"


def test_earliest_of_several_stops_wins():
    a = TextAssembler(["world", "lo w"])
    assert "".join(feed_all(a, [b"hello world"])) == "hel"
    assert a.stopped


def test_stop_at_the_very_start_gives_empty_text():
    a = TextAssembler(["\n"])
    assert a.feed(b"\nfoo") == ""
    assert a.stopped


def test_invalid_utf8_becomes_replacement_character_not_an_exception():
    a = TextAssembler()
    assert a.feed(b"\xff") == "\ufffd"
    assert a.feed(b"\xe6\x9d") == ""
    assert a.finish() == "\ufffd"


def test_stop_strings_are_tried_only_where_they_could_begin():
    """256 stop strings of 512 characters while one of them is held partly matched (511
    characters): the hold-back is right, and the others, whose first character never
    occurs, cost a find each (trying every length took 28 ms a token here)."""
    import time
    stops = ["b" + "x" * 508 + str(i).zfill(3) for i in range(255)] + ["a" * 511 + "Z"]
    assembler = TextAssembler(stops)
    started = time.perf_counter()
    out = "".join(assembler.feed(b"a") for _ in range(600))
    elapsed = time.perf_counter() - started
    assert out == "a" * (600 - 511)                   # 511 a's held: the stop may follow
    assert assembler.feed(b"Z") == "" and assembler.stopped
    assert assembler.stop_word == "a" * 511 + "Z"
    assert elapsed < 5.0                              # (17 s trying every length)


# -- the worker's Output: text events, logprobs and editors' limits from tokens ---------
class ScriptedEngine:
    """A test double: token ids are indexes into `pieces` (bytes); none is end of text."""

    def __init__(self, pieces):
        self.pieces = pieces

    def piece(self, token):
        return self.pieces[token]

    def is_eog(self, token):
        return False

    def draft_stats(self, slot):
        return 0, 0


class Recorder:
    def __init__(self):
        self.events = []

    def publish(self, topic, request_id, event):
        self.events.append(event)


def run_tokens(pieces, tokens, stops=(), logprobs=None, echo=None, limits=None,
               first_at=None, max_tokens=50):
    """The events a request sends for `tokens` (sampled in turn, logprob -0.5 each)."""
    from types import SimpleNamespace

    from workers.active import Active, LogprobLedger
    from workers.faults import FaultInjection
    from workers.output import Output
    engine, recorder = ScriptedEngine(pieces), Recorder()
    output = Output(engine, recorder, lambda *a: None, FaultInjection(),
                    SimpleNamespace(measure=lambda tokens, ms: None),
                    lambda active, keep_cache=True: None)
    active = Active("r", b"fe-000000000001", 1, 0, max_tokens, 4096, 10,
                    TextAssembler(list(stops)),
                    ledger=LogprobLedger(logprobs) if logprobs is not None else None,
                    limits=limits, first_at=first_at)
    if echo is not None:                  # (the prompt's ids, its text)
        active.prompt_ids, active.echo_text, active.echo_pending = echo[0], echo[1], True
    for i, token in enumerate(tokens):
        if active.seq and recorder.events[-1].__class__.__name__ == "End":
            break
        prompt = [(t, -1.0, []) for t in echo[0][1:]] if echo and i == 0 else None
        output.token(active, SimpleNamespace(token=token, logprob=-0.5, top=[],
                                             prompt=prompt))
    texts = [e for e in recorder.events if e.__class__.__name__ == "Text"]
    return texts, recorder.events[-1]


def test_echoed_offsets_count_a_split_character_once():
    """Each token's text_offset is where its text starts in what the client gets: a
    character split over two prompt tokens counts once (it used to count as two
    replacement characters per piece, and the offsets ran past the completion's)."""
    pieces = [b"\xf0\x9f", b"\x99\x82", b" hi", b"!"]
    texts, end = run_tokens(pieces, [3], logprobs=0, echo=([0, 1, 2], "\U0001F642 hi"),
                            max_tokens=1)
    offsets = [o for t in texts + [end] if t.logprobs for o in t.logprobs["text_offset"]]
    assert end.finish_reason == "length"
    assert "".join(t.text for t in texts) == "\U0001F642 hi!"
    assert offsets == [0, 0, 1, 4]


def test_a_line_cut_by_n_indent_reports_no_logprobs_for_it():
    from workers.active import EditorLimits
    pieces = [b"def f():", b"\n", b"x = 1"]
    texts, end = run_tokens(pieces, [0, 1, 2], logprobs=0,
                            limits=EditorLimits(n_indent=4))
    sent = "".join(t.text for t in texts)
    tokens = [tok for t in texts + [end] if t.logprobs for tok in t.logprobs["tokens"]]
    assert sent == "def f():\n" and end.finish_reason == "length"
    assert tokens == ["def f():", "\n"]                    # not the cut line's


def test_n_indent_cuts_what_a_stop_string_held_when_the_completion_ends():
    """Text held back as a possible stop string's start went out unchecked at the end
    (max_tokens, EOS): an under-indented line past n_indent was sent whole."""
    from workers.active import EditorLimits
    pieces = [b"    x = 1", b"\ncl"]
    texts, end = run_tokens(pieces, [0, 1], stops=["\nclass "], max_tokens=2,
                            limits=EditorLimits(n_indent=4))
    assert "".join(t.text for t in texts) == "    x = 1\n"
    assert (end.finish_reason, end.stop_type) == ("length", "limit")
    texts, end = run_tokens([b"    x = 1", b"\n    y"], [0, 1], stops=["\n    y = 2"],
                            max_tokens=2, limits=EditorLimits(n_indent=4))
    assert "".join(t.text for t in texts) == "    x = 1\n    y"        # indented: kept


def test_out_of_time_ends_with_a_token_that_has_a_newline_and_sends_what_was_held():
    """t_max_predict_ms, as llama-server's process_token: once the time is up, a token
    with a newline is the last (the first newline too), so a suggestion ends at a
    line's end, never part way into the next (llama.vim showed the broken line); text
    held for a possible stop string is sent too, as at max_tokens (the limit is not a
    stop string: a trailing newline was lost)."""
    from workers.active import EditorLimits
    pieces = [b"def f():", b"\n", b"x = 1", b"x\n", b"more", b"\n    y"]

    def sent(tokens, stops=(), limit=10):
        texts, end = run_tokens(pieces, tokens, stops=stops, first_at=0.0,  # (long past)
                                limits=EditorLimits(t_max_predict_ms=limit))
        return "".join(t.text for t in texts), end.finish_reason

    assert sent([0, 1, 2, 4]) == ("def f():\n", "length")
    assert sent([0, 2, 3, 4]) == ("def f():x = 1x\n", "length")
    assert sent([0, 5, 4]) == ("def f():\n    y", "length")        # (the token's whole)
    assert sent([0, 1, 3, 4], stops=["\n\n"]) == ("def f():\n", "length")


class Reference:
    """What TextAssembler must do, by definition (every stop tried at every place):
    after each piece, cut before the earliest stop string in the held text (the least,
    as strings compare, of several starting there), else hold back its longest end that
    is a proper beginning of a stop string."""

    def __init__(self, stops):
        self.stops, self.held, self.stopped = [s for s in stops if s], "", False

    def feed(self, text, final=False):
        if self.stopped:
            return ""
        held = self.held + text
        found = [(i, s) for s in self.stops if (i := held.find(s)) >= 0]
        if found:
            self.stopped, self.held = True, ""
            return held[:min(found)[0]]
        keep = 0 if final else max([k for k in range(1, len(held) + 1) for s in self.stops
                                    if len(s) > k and s.startswith(held[-k:])] or [0])
        self.held = held[len(held) - keep:]
        return held[:len(held) - keep]


def test_stop_strings_are_found_and_held_back_as_trying_every_place_would():
    """The automaton (workers.textstream.StopAutomaton) against the definition, over
    thousands of random stop sets and texts of a small alphabet (so that stops overlap,
    nest, repeat and share beginnings), cut into random pieces; and the shape that was
    slowest (many long stops that the text almost matches at every place)."""
    import random
    rng = random.Random(20261206)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(0, 6)))
                 for _ in range(rng.randint(0, 5))]
        text = "".join(rng.choice("ab\nc") for _ in range(rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        ours, ref = TextAssembler(stops), Reference(stops)
        got = [ours.feed(p.encode()) for p in pieces] + [ours.finish()]
        want = [ref.feed(p) for p in pieces] + [ref.feed("", final=True)]
        assert got == want, (stops, pieces)
        assert ours.stopped == ref.stopped
        if ours.stopped:
            cut = len("".join(want))
            assert ours.stop_word in stops and text[cut:].startswith(ours.stop_word)
    stops = ["a" * 62 + "b" + chr(0x100 + i) for i in range(256)]
    worst = TextAssembler(stops)
    automaton = worst._automaton
    assert len(automaton.depth) == 1 + 62 + 1 + 256        # (the stops share a trunk)
    assert "".join(worst.feed(("a" * 61 + "c").encode()) for _ in range(50)) == \
        ("a" * 61 + "c") * 50


def test_top_logprobs_of_two_tokens_of_one_text_keep_the_likelier():
    """OpenAI's top_logprobs maps a text to its logprob: where two tokens write the same
    text (a byte token and its character's, control tokens written as ""), the likelier
    token's figure stands, as the list comes likeliest first (lm-eval reads a greedy
    token by the largest value)."""
    from types import SimpleNamespace
    from workers.output import Output
    pieces = {3: b"a", 9: b"a", 4: b"b", 5: b"", 6: b""}
    engine = SimpleNamespace(piece=pieces.__getitem__)
    output = Output(engine, None, None, None, None, None)
    top = output._top_dict([(3, -0.1), (9, -2.0), (5, -2.5), (4, -3.0), (6, -4.0)])
    assert top == {"a": -0.1, "": -2.5, "b": -3.0}
    assert list(top) == ["a", "", "b"]
