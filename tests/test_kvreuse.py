"""KV chunk reuse: the pure planner (`workers.engine.kvreuse`) and the engine applying it on the
bundled model."""
import os

import pytest

from workers.engine.kvreuse import chunk_moves
from workers.sampling import SamplingParams

THREADS = len(os.sched_getaffinity(0))      # this test process's cores


def test_text_deleted_before_the_rest_of_the_file_moves_the_rest_into_place():
    prefix, suffix = list(range(100, 140)), list(range(500, 560))
    cache = prefix + [7, 8] + suffix + [9, 9]      # "99": what was generated last time
    prompt = prefix + [7] + suffix                 # the user deleted a character
    moves, in_place = chunk_moves(cache, prompt, start=41, minimum=16)
    assert moves == [(42, 41, 60)]                 # the rest, one position earlier
    assert in_place == len(prompt)


def test_a_context_ring_that_dropped_its_oldest_chunk_is_shifted_whole():
    """llama.vim's extra context: chunks evicted from the front, a new one at the end."""
    c1, c2, c3, c4 = (list(range(k * 100, k * 100 + 30)) for k in range(1, 5))
    moves, in_place = chunk_moves([1] + c1 + c2 + c3, [1] + c2 + c3 + c4, start=1,
                                  minimum=16)
    assert moves == [(31, 1, 60)]
    assert in_place == 61                          # c4 is prefilled


def test_short_runs_reordered_chunks_and_inserted_text():
    a, b = list(range(10, 30)), list(range(40, 60))
    cache = [1] + a + b
    moves, in_place = chunk_moves(cache, [1] + b + a, start=1, minimum=16)
    assert moves == [(21, 1, 20)]          # b moves to the front; a lay before it: gone
    assert in_place == 21
    # new text stops the scan (as in llama.cpp): what follows it is prefilled
    assert chunk_moves(cache, [1] + a[:10] + [0] + a[10:] + b, start=11,
                       minimum=16) == ([], 11)
    assert chunk_moves(cache, [1] + a[:10] + b[:10], start=11, minimum=16) == ([], 11)
    assert chunk_moves(cache, [1] + b, start=1, minimum=0) == ([], 1)     # off


def test_a_chunk_is_taken_from_its_first_occurrence_after_the_previous_one():
    block = list(range(200, 220))
    cache = [1] + block + [5] + block + [6] + block
    moves, in_place = chunk_moves(cache, [1] + block + block + block, start=21, minimum=16)
    assert moves == [(22, 21, 20), (43, 41, 20)]
    assert in_place == 61


@pytest.mark.integration
def test_engine_shifts_a_context_ring_that_dropped_its_oldest_chunk():
    from dispatcher.common.models import bundled_model_path
    from workers.engine.llama import LlamaEngine
    greedy = SamplingParams(temperature=0)
    path = str(bundled_model_path())
    chunks = ["".join(f"def helper_{k}_{i}(value):\n    return value * {i} + {k}\n\n"
                      for i in range(8)) for k in range(4)]
    local = "def main():\n    total ="

    def run(engine, prompt, n=8):
        engine.add(0, prompt, greedy)
        out = []
        while len(out) < n:
            result = engine.step().get(0)
            if result is not None:
                out.append(result.token)
        engine.release(0)
        return out

    engine = LlamaEngine(path, 2048, 1, THREADS, 0, cache_reuse=64)
    try:
        run(engine, engine.tokenize(chunks[0] + chunks[1] + chunks[2] + local), n=4)
        second = engine.tokenize(chunks[1] + chunks[2] + chunks[3] + local)
        moved = len(engine.tokenize(chunks[1] + chunks[2], add_special=False))
        reused = engine.add(0, second, greedy)
        engine.release(0)
        assert reused >= moved - 2                       # the two chunks (joins may differ)
        assert engine.caches.tokens_shifted >= moved - 3
        # the slot's cache is coherent: positions and tokens agree, so the same prompt
        # again reuses all but its last token, and generation goes on from there
        assert len(run(engine, second)) == 8
        assert engine.add(0, second, greedy) == len(second) - 1
        engine.release(0)
    finally:
        engine.close()


@pytest.mark.integration
def test_a_prefix_whose_sliding_window_was_overwritten_is_not_kept():
    """The bundled Gemma 3 has a sliding window (512). A chunk shift leaves a gap that
    the next prompt outgrows; llama.cpp then overwrites cells out of the window and drops
    the window's cells below them, while the sequence's last position still looks right.
    A later prompt sharing a shorter prefix kept it over that hole and wrote other text
    than the same prompt decoded afresh (it parted at the fifth token)."""
    import llama_cpp

    from dispatcher.common.models import bundled_model_path
    from workers.engine.llama import LlamaEngine
    greedy = SamplingParams(temperature=0)

    def chunk(k, n):
        return "".join(f"def helper_{k}_{i}(value):\n    return value * {i} + {k}\n\n"
                       for i in range(n))

    engine = LlamaEngine(str(bundled_model_path()), 4096, 1, THREADS, 0, cache_reuse=64)

    def run(prompt, n):
        reused = engine.add(0, prompt, greedy)
        out = []
        while len(out) < n:
            result = engine.step().get(0)
            for one in result if isinstance(result, list) else [result] if result else []:
                out.append(one.token)
        engine.release(0)
        return reused, out[:n]

    try:
        n_swa = llama_cpp.llama_model_n_swa(engine.model)
        assert n_swa == 512
        run(engine.tokenize(chunk(0, 20) + chunk(1, 40)), 1)        # ~1,280 tokens
        shifted, _ = run(engine.tokenize(chunk(1, 40) + chunk(2, 30)), 1)
        assert shifted > 800                   # chunk 1 moved down, chunk 2 outgrew the gap
        third = engine.tokenize(chunk(1, 20) + "def main():\n    total =")
        reused, kept = run(third, 8)
        assert llama_cpp.llama_memory_seq_pos_min(engine.memory, 0) <= max(0, reused - n_swa) \
            or reused == 0
        engine.caches.forget(engine.slots[0])
        assert run(third, 8) == (0, kept)                    # as decoded afresh
    finally:
        engine.close()


def test_a_prefix_is_kept_only_where_its_sliding_window_is_held():
    """The boundary (llama-server's): a prefix of 600 tokens on a window of 512 needs
    the sequence's cells from position 88 on; one whose lowest position is 89 is emptied.
    Without a window any prefix stays. (A stand-in for llama.cpp's memory.)"""
    from workers.engine.slots import SlotCaches

    class Memory:
        def __init__(self, low):
            self.low, self.removed = low, []

        def llama_memory_seq_rm(self, memory, seq, start, end):
            self.removed.append((start, end))
            return True

        def llama_memory_seq_pos_max(self, memory, seq):
            return 599

        def llama_memory_seq_pos_min(self, memory, seq):
            return self.low

    tokens = list(range(1000))
    for low, n_swa, kept in ((88, 512, 600), (89, 512, 0), (400, 0, 600), (0, 512, 600)):
        lib = Memory(low)
        caches = SlotCaches(lib, None, 1, 0, False, n_swa=n_swa)
        slot = caches.slots[0]
        slot.cached = tokens[:700]
        assert caches.reuse(slot, tokens, 600) == kept, (low, n_swa)
        assert len(slot.cached) == kept and (kept or lib.removed[-1] == (-1, -1))


def test_a_chunk_move_the_memory_refuses_empties_the_cache():
    """A memory that cannot drop the text between two chunks (a recurrent model's state)
    refuses the removal: the moves stop and the caller empties the slot, rather than
    shift a chunk over text still in the state."""
    from workers.engine.kvreuse import shift_into_place

    class Lib:
        def llama_memory_seq_rm(self, memory, seq, start, end):
            return False

        def llama_memory_seq_add(self, *args):
            raise AssertionError("moved after a refused removal")
    cache = list(range(100, 140)) + list(range(40))
    tokens = list(range(40)) + [7]
    assert shift_into_place(Lib(), None, 0, cache, tokens, 0, 16) == (cache, 0, 0)
    cache = [1, 2] + list(range(100, 140)) + list(range(40))
    assert shift_into_place(Lib(), None, 0, cache, [1, 2] + tokens, 2, 16) == ([], 0, 0)


def test_deterministic_mode_never_shifts_the_cache():
    from dispatcher.common.models import bundled_model_path
    from workers.engine.llama import LlamaEngine
    engine = LlamaEngine(str(bundled_model_path()), 512, 1, THREADS, 0, deterministic=True,
                         cache_reuse=16)
    try:
        assert engine.caches.cache_reuse == 0
    finally:
        engine.close()


def test_reusable_counts_the_prefix_and_the_chunks_behind_it():
    from workers.engine.kvreuse import reusable
    a, b = list(range(10, 40)), list(range(50, 80))
    cache = [1] + a + b
    assert reusable(cache, [1] + b + [3], 16) == 31            # BOS + b shifted
    assert reusable(cache, [1] + b + [3], 0) == 1              # off: the prefix alone
    assert reusable(cache, [1] + a + b, 16) == 60              # the last token: decoded
    assert reusable([], [1, 2], 16) == 0
