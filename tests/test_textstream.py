"""TextAssembler: UTF-8 safety and stop-string hold-back (unit)."""
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
