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
