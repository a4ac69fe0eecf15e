"""LlamaEngine in this process on the bundled model: batching, prefix reuse, slots."""
import os

import pytest

from workers.sampling import SamplingParams

pytestmark = pytest.mark.integration

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The planets of the solar system are"]
GREEDY = SamplingParams(temperature=0)
THREADS = len(os.sched_getaffinity(0))      # this test process's cores


@pytest.fixture(scope="module")
def model_path():
    from dispatcher.common.models import bundled_model_path
    return str(bundled_model_path())


def make(model_path, slots=4, deterministic=False):
    from workers.engine.llama import LlamaEngine
    return LlamaEngine(model_path, 1024, slots, THREADS, 0, deterministic=deterministic)


def sampled(engine, prompt: str, sampling, n: int, tweak=None) -> list[int]:
    """The first `n` tokens slot 0 samples for `prompt` (none reused; `tweak(slot)`
    first), none of them an error."""
    engine.add(0, engine.tokenize(prompt), sampling, reuse=False)
    if tweak is not None:
        tweak(engine.slots[0])
    tokens = []
    while len(tokens) < n:
        out = engine.step().get(0)
        if out is not None:
            assert out.error is None, out.error
            tokens.append(out.token)
    engine.release(0, keep_cache=False)
    return tokens


def generate(engine, jobs, n=16, logprobs=None):
    """jobs: [(slot, prompt)] started together; returns {slot: [(token, logprob)]}."""
    out = {slot: [] for slot, _ in jobs}
    for slot, prompt in jobs:
        engine.add(slot, engine.tokenize(prompt), GREEDY, logprobs=logprobs)
    while any(len(v) < n for v in out.values()):
        for slot, result in engine.step().items():
            if len(out[slot]) < n:
                out[slot].append((result.token, result.logprob))
    for slot, _ in jobs:
        engine.release(slot)
    return out


def test_a_model_that_will_not_load_is_refused_with_llama_cpps_own_reason(model_path,
                                                                          tmp_path,
                                                                          monkeypatch):
    """llama.cpp says why a load failed only in its log (at any level, whatever the
    worker's): the refusal quotes its last lines, and the log keeps no more of them."""
    from workers.engine.llama import LlamaEngine
    from workers.engine.llamalog import LlamaLog
    from workers.errors import EngineError
    monkeypatch.setenv("COMPLETIONS_EXTRA_BUFFERS", "off")     # (no probe of a cut file)
    made = []
    monkeypatch.setattr("workers.engine.llama.LlamaLog",
                        lambda *a: made.append(LlamaLog(*a)) or made[-1])
    data = open(model_path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) // 2])        # the header whole, the tensors cut
    with pytest.raises(EngineError, match="could not load") as refused:
        LlamaEngine(str(cut), 256, 1, THREADS, 0)
    assert "(llama.cpp: " in str(refused.value) and "token_embd" in str(refused.value)
    assert made and made[0].recent is None


def test_batched_equals_unbatched_in_the_deterministic_configuration(model_path):
    engine = make(model_path, deterministic=True)
    try:
        alone = [generate(engine, [(0, p)], logprobs=0)[0] for p in PROMPTS]
        together = generate(engine, list(enumerate(PROMPTS)), logprobs=0)
        assert [together[i] for i in range(len(PROMPTS))] == alone    # tokens and logprobs
    finally:
        engine.close()


def test_batched_greedy_text_is_close_in_the_default_configuration(model_path):
    """Not bit-identical (batch composition changes the kernels' arithmetic, and which
    kernels run depends on the CPU), but every sequence is served, and every token of
    each agrees with the sequence run alone up to where the two part at a near-tie: the
    batch's token among the alone run's best candidates, within 0.5 nats of its pick.
    Any other difference is a batching fault (a row read from the wrong sequence)."""
    engine = make(model_path)
    try:
        alone = [results(engine, [(0, p)], n=8)[0] for p in PROMPTS]
        engine.clear_caches()
        together = results(engine, list(enumerate(PROMPTS)), n=8)
        assert all(len(together[i]) == 8 for i in range(len(PROMPTS)))
        for i in range(len(PROMPTS)):
            ours, theirs = [o.token for o in together[i]], [o.token for o in alone[i]]
            k = next((k for k in range(8) if ours[k] != theirs[k]), None)
            if k is None:
                continue
            top = dict(alone[i][k].top)
            assert ours[k] in top and top[theirs[k]] - top[ours[k]] < 0.5, \
                (PROMPTS[i], k, ours[k], top)
    finally:
        engine.close()


def results(engine, jobs, n):
    """jobs: [(slot, prompt)] started together, greedy with the five best candidates each
    step; returns {slot: [TokenOut]}."""
    out = {slot: [] for slot, _ in jobs}
    for slot, prompt in jobs:
        engine.add(slot, engine.tokenize(prompt), GREEDY, logprobs=5)
    while any(len(v) < n for v in out.values()):
        for slot, result in engine.step().items():
            if len(out[slot]) < n:
                out[slot].append(result)
    for slot, _ in jobs:
        engine.release(slot)
    return out


def test_a_slot_is_not_taken_for_a_few_shared_tokens(model_path):
    """Two files that differ from their first line share a few tokens: a new prompt takes
    an empty slot rather than the one whose cache holds the other file (which that
    file's next keystroke reuses), and still the one holding its own file."""
    engine = make(model_path, slots=3)
    try:
        body = "x = 1\n" * 60
        mine, other = (engine.tokenize(f"# file {n}\n" + body) for n in (12, 13))
        engine.slots[0].cached = list(other)                 # the other editor's file
        engine.slots[1].cached = engine.tokenize("# file 12")  # a few tokens of mine
        assert engine.best_slot(mine, [0, 1, 2]) == 2          # empty, not 0 or 1
        assert engine.cached_prefix(mine, [0, 1, 2]) == 0      # (what routing weighs)
        engine.slots[2].cached = list(mine[:-3])
        assert engine.best_slot(mine, [0, 1, 2]) == 2          # its own file
        assert engine.cached_prefix(mine, [0, 1, 2]) == len(mine) - 3
        assert engine.best_slot(other + [5], [0, 1]) == 0
    finally:
        for slot in engine.slots:
            slot.cached = []
        engine.close()


def test_a_new_sequence_takes_a_slot_beside_the_busy_ones(model_path):
    """llama.cpp splits a step into one sub-batch per run of consecutive busy slots:
    among slots equally worth taking, the one next to a busy slot (or filling a gap)
    comes first, ahead of one with less cached; a cache worth reusing still wins."""
    engine = make(model_path, slots=6)
    try:
        prompt = engine.tokenize("def handler(event):\n    return event\n")
        for slot in (1, 2):
            engine.add(slot, engine.tokenize(f"# busy {slot}"), GREEDY)
        engine.slots[3].cached = engine.tokenize("an idle editor's file " * 8)
        assert engine.best_slot(prompt, [0, 3, 4, 5]) in (0, 3)      # beside 1-2, not 4/5
        assert engine.best_slot(prompt, [0, 3, 4, 5]) == 0           # (0: nothing cached)
        assert engine.best_slot(prompt, [3, 4, 5]) == 3              # beside, though cached
        engine.slots[5].cached = list(prompt)
        assert engine.best_slot(prompt, [0, 3, 4, 5]) == 5           # its own cache
        engine.add(4, engine.tokenize("# busy 4"), GREEDY)
        engine.step()
        assert engine.totals.batches - engine.totals.steps >= 1     # 1-2 and 4: two runs
    finally:
        for slot in range(6):
            engine.release(slot, keep_cache=False)
        engine.close()


def test_prefix_reuse_keeps_the_common_part_of_the_slot_cache(model_path):
    engine = make(model_path, slots=2)
    try:
        first = engine.tokenize(PROMPTS[0])
        generate(engine, [(0, PROMPTS[0])], n=3)
        extended = engine.tokenize(PROMPTS[0] + " a city")
        assert engine.best_slot(extended, [0, 1]) == 0                 # where the cache is
        reused = engine.add(0, extended, GREEDY)
        assert reused == len(first)
        assert engine.slots[0].pending == extended[reused:]
        engine.step()                                   # decodes the new part
        engine.release(0)
        # the same prompt again: all but the last token (its logits start generation)
        assert engine.add(0, extended, GREEDY) == len(extended) - 1
        engine.release(0)
        assert engine.add(0, extended, GREEDY, reuse=False) == 0       # cache_prompt: false
        engine.release(0)
    finally:
        engine.close()


def test_deterministic_mode_never_reuses(model_path):
    engine = make(model_path, slots=1, deterministic=True)
    try:
        generate(engine, [(0, PROMPTS[0])], n=2)
        assert engine.add(0, engine.tokenize(PROMPTS[0]), GREEDY) == 0
        engine.release(0)
    finally:
        engine.close()


def test_release_frees_a_slot_mid_generation_for_the_next_request(model_path):
    engine = make(model_path, slots=1)
    try:
        engine.add(0, engine.tokenize(PROMPTS[1]), GREEDY)
        engine.step()
        engine.step()
        engine.release(0)                                              # a cancel
        assert not engine.slots[0].busy
        out = generate(engine, [(0, PROMPTS[2])], n=4)
        assert len(out[0]) == 4
    finally:
        engine.close()


def test_a_long_prompt_is_prefilled_in_chunks_alongside_generating_slots(model_path):
    engine = make(model_path, slots=2)
    try:
        long_prompt = "word " * 700                                    # > n_batch tokens
        engine.add(0, engine.tokenize(PROMPTS[0]), GREEDY)
        engine.step()                                                  # slot 0 generating
        engine.add(1, engine.tokenize(long_prompt), GREEDY)
        steps_with_both = 0
        while engine.slots[1].pending:
            produced = engine.step()
            assert 0 in produced                                       # never starved
            steps_with_both += 1
        assert steps_with_both >= 2                                    # chunked
    finally:
        engine.close()


def test_chunked_prefill_never_stalls_a_running_stream_and_serves_short_prompts_first(
        model_path):
    from workers.engine.llama import LlamaEngine
    engine = LlamaEngine(model_path, 2048, 3, THREADS, 0, prefill_chunk=64)
    try:
        engine.add(0, engine.tokenize("Once upon a time"), GREEDY)
        while 0 not in engine.step():                  # slot 0 generates from now on
            pass
        long_prompt = engine.tokenize("def helper(value):\n    return value\n" * 100)
        assert len(long_prompt) > 600
        engine.add(1, long_prompt, GREEDY)
        engine.add(2, engine.tokenize("Short one"), GREEDY)
        steps, first_tokens = 0, {}
        while 1 not in first_tokens:
            before = {s: len(engine.slots[s].pending) for s in (1, 2)}
            produced = engine.step()
            steps += 1
            assert 0 in produced                       # the stream got its token every step
            decoded = sum(before[s] - len(engine.slots[s].pending) for s in (1, 2))
            assert decoded <= 64                       # at most one chunk of prompt a step
            for s in (1, 2):
                if s in produced and s not in first_tokens:
                    first_tokens[s] = steps
        assert first_tokens[2] == 1                    # the short prompt went first
        assert steps >= len(long_prompt) // 64
    finally:
        engine.close()


def test_a_warm_up_prefills_only_with_the_room_a_waited_for_prompt_leaves(model_path):
    """llama.vim's cache warm-ups (nothing to generate; nobody reads their answer) came
    before a longer keystroke's prompt, shortest first: the keystroke now goes first."""
    from workers.engine.llama import LlamaEngine
    engine = LlamaEngine(model_path, 2048, 2, THREADS, 0, prefill_chunk=64, draft_max=0)
    try:
        warm = engine.tokenize("x = 1\n" * 10)
        typed = engine.tokenize("def helper(value):\n    return value\n" * 12)
        assert len(warm) < len(typed) and len(typed) > 64
        engine.add(0, warm, GREEDY, budget=0)
        engine.add(1, typed, GREEDY)
        engine.step()
        assert len(engine.slots[0].pending) == len(warm)      # the warm-up waited
        assert len(engine.slots[1].pending) == len(typed) - 64
    finally:
        engine.close()
    engine = LlamaEngine(model_path, 2048, 2, THREADS, 0, prefill_chunk=64, draft_max=0)
    try:                                       # scoring (echo, logprobs, max_tokens 0):
        engine.add(0, warm, GREEDY, budget=0, prompt_logprobs=True)   # read, not a
        engine.add(1, typed, GREEDY)                                  # warm-up
        engine.step()
        assert len(engine.slots[0].pending) < len(warm)
    finally:
        engine.close()


def test_a_step_that_finishes_a_prompt_takes_no_piece_of_another(model_path):
    """A cold burst: two short prompts and three that each fill half a batch. The step
    that finishes the short ones (together: small ones join) takes no piece of a half,
    nor a whole half (either would delay their tokens by the half's rows); then one half
    a step, whole, each step taking no piece of the next: one first token a step, not
    two every other step. A prompt too long for any one step is still prefilled in full
    batches."""
    from workers.engine.llama import LlamaEngine
    engine = LlamaEngine(model_path, 2048, 5, THREADS, 0)
    try:
        half = engine.tokenize("def helper(value):\n    return value\n" * 30)
        assert engine.n_batch // 2 < len(half) < engine.n_batch
        for slot in range(3):                  # (no shared cache to reuse)
            engine.add(slot, list(half[:-1 - slot]) + [half[slot]] * (slot + 1), GREEDY)
        engine.add(3, engine.tokenize("Short one"), GREEDY)
        engine.add(4, engine.tokenize("Short two"), GREEDY)
        started: list[set] = []
        while len(set().union(*started)) < 5:
            first = set(engine.step()) - set().union(*started)
            started.append(first)
            assert all(len(engine.slots[s].pending) in (0, len(half)) for s in range(3))
        assert started == [{3, 4}, {0}, {1}, {2}]
        for slot in range(5):
            engine.release(slot, keep_cache=False)
        long_prompt = engine.tokenize("def helper(value):\n    return value\n" * 100)
        engine.add(0, long_prompt, GREEDY)
        engine.step()
        assert len(engine.slots[0].pending) == len(long_prompt) - engine.n_batch
    finally:
        engine.close()


def test_a_long_prompt_beside_short_ones_finishing_every_step_is_not_starved(model_path):
    """Keystrokes finishing in every step beside a cold file: the file's piece waits one
    step at most, then goes in beside the next keystroke."""
    from workers.engine.llama import LlamaEngine
    engine = LlamaEngine(model_path, 2048, 4, THREADS, 0)
    try:
        long_prompt = engine.tokenize("def helper(value):\n    return value\n" * 200)
        assert len(long_prompt) > 2 * engine.n_batch
        engine.add(0, long_prompt, GREEDY)
        left = [len(engine.slots[0].pending)]
        for slot in (1, 2, 3):                     # a new short prompt every step
            engine.add(slot, engine.tokenize(f"Short one {slot}"), GREEDY)
            assert slot in engine.step()
            left.append(len(engine.slots[0].pending))
        assert left[1] == left[0]                  # passed over beside the first
        assert left[2] < left[1]                   # its piece beside the second
        assert left[3] == left[2]                  # passed over again
    finally:
        engine.close()


def test_prefill_joins_small_whole_prompts_and_owes_a_piece_to_the_next_in_line():
    """Scheduler.prefill over stand-in slots (no model): keystrokes finishing together
    share a step; a large whole prompt does not ride along a finishing one; of the
    prompts passed over, only the next in priority order is owed its piece."""
    from types import SimpleNamespace
    from workers.engine.scheduling import JOIN_ROWS, Scheduler

    def waiting(seq, left):
        return SimpleNamespace(seq=seq, pending=[1] * left, prompt_logprobs=None,
                               passed_over=False)

    keys = [waiting(i, 4) for i in range(3)]
    assert Scheduler.prefill(keys, 504, 64, rows=8) == {0: 4, 1: 4, 2: 4}
    a, b, c = waiting(0, 5), waiting(1, 263), waiting(2, 263)
    assert Scheduler.prefill([a, b, c], 512, 64) == {0: 5}
    assert b.passed_over and not c.passed_over
    assert Scheduler.prefill([b, c], 511, 64, rows=1) == {1: 263}     # no piece of c
    assert c.passed_over
    small = waiting(3, JOIN_ROWS)
    assert Scheduler.prefill([waiting(4, 3), small, waiting(5, 40)], 512, 64) == \
        {4: 3, 3: JOIN_ROWS}
    # beside keystrokes finishing every step, the owed piece goes in the next step
    long_prompt = waiting(6, 2000)
    assert Scheduler.prefill([waiting(7, 4), long_prompt], 512, 64) == {7: 4}
    assert Scheduler.prefill([waiting(8, 4), long_prompt], 512, 64) == {8: 4, 6: 508}


def test_prompts_keeping_their_logprobs_share_one_piece_a_step():
    """Eight scoring choices (echo with logprobs) each keep every prompt row's logits and
    top candidates: together they get `logprob_chunk` rows a step, not that many each
    (512 rows a step took the step seconds and the logits half a gigabyte)."""
    from types import SimpleNamespace
    from workers.engine.scheduling import Scheduler
    scoring = [SimpleNamespace(seq=i, pending=[1] * 2800, prompt_logprobs=[],
                               passed_over=False) for i in range(8)]
    plain = SimpleNamespace(seq=8, pending=[1] * 100, prompt_logprobs=None,
                            passed_over=False)
    grant = Scheduler.prefill(scoring + [plain], 512, 64)
    assert sum(grant.get(s.seq, 0) for s in scoring) == 64 and grant[8] == 100


REPEATING_CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
                  * 3 + "def add(a, b):\n")


def run_speculated(model_path, draft_max, deterministic=False, n=24):
    """Given step costs (those of a 2-core CPU), so whether a draft pays does not depend
    on how busy this machine was when it measured its own."""
    from workers.engine.llama import LlamaEngine
    from workers.engine.stepcosts import StepCosts
    engine = LlamaEngine(model_path, 1024, 2, THREADS, 0, deterministic=deterministic,
                         draft_max=draft_max, step_costs=StepCosts.assumed())
    try:
        engine.add(0, engine.tokenize(REPEATING_CODE), GREEDY)
        tokens, steps = [], 0
        while len(tokens) < n:
            produced = engine.step()
            steps += 1
            if 0 in produced:
                out = produced[0]
                tokens += [o.token for o in (out if isinstance(out, list) else [out])]
        return tokens[:n], steps, engine.draft_stats(0)
    finally:
        engine.close()


def test_speculation_keeps_a_confident_greedy_copy_and_takes_fewer_steps(model_path):
    """Copying repeated code, every token wins by a wide margin: the speculative run
    emits the same tokens in far fewer decode steps."""
    plain, plain_steps, _ = run_speculated(model_path, 0)
    drafted, steps, (proposed, accepted) = run_speculated(model_path, 16)
    assert drafted == plain and 0 < accepted <= proposed
    assert steps < plain_steps / 2


def first_seen_prompts(count: int, context_chars: int = 600) -> list[str]:
    """Edits and function bodies of real standard-library files, one file each, with
    less of the code before them than the bench gives (600 characters, not 2,000: each
    prompt is prefilled on one core, up to three times)."""
    from functools import partial
    from dispatcher.tools.bench_corpus import Corpus, edit, function_start
    corpus = Corpus(seed=36)
    return corpus.prompts("edit", count // 2, partial(edit, context_chars=context_chars)) + \
        corpus.prompts("fresh", count - count // 2,
                       partial(function_start, context_chars=context_chars))


def greedy_tokens(engine, prompt_tokens, n, draft_max, logprobs=None):
    engine.add(0, prompt_tokens, GREEDY, logprobs=logprobs, draft_max=draft_max)
    outs = []
    while len(outs) < n:
        produced = engine.step().get(0)
        if produced is not None:
            outs += produced if isinstance(produced, list) else [produced]
    drafted = engine.draft_stats(0)
    engine.release(0)
    return outs[:n], drafted


def test_a_dry_sampler_is_made_once_for_its_settings_and_cloned(model_path, monkeypatch):
    """llama.cpp's DRY init scans the whole vocabulary for every sequence breaker (0.9 s
    of a core for sixteen on this model's 262k tokens): the sequences of several
    requests with the same DRY settings get clones of one made once, and draw what a
    sampler made afresh draws, breakers included (here the breakers stop DRY's penalty
    of a repeating count, which without them changes the text); other settings make
    another."""
    import ctypes
    import dataclasses

    import llama_cpp

    from workers.engine.llama import LlamaEngine
    from workers.engine.drysamplers import DryTemplates
    made = []
    init = llama_cpp.llama_sampler_init_dry
    monkeypatch.setattr(llama_cpp, "llama_sampler_init_dry",
                        lambda *args: made.append(args[-1]) or init(*args))
    dry = SamplingParams(temperature=0, dry_multiplier=3.0, dry_allowed_length=1,
                         dry_penalty_last_n=-1, ignore_eos=True,    # (these break the
                         dry_sequence_breakers=(",", " 1", " 2", " 3",         # repeats)
                                                *(f"b{i}" for i in range(12))))
    engine = LlamaEngine(model_path, 512, 2, THREADS, 0, draft_max=0)

    def tokens(sampling, tenant=None):
        engine.add(0, engine.tokenize("1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"), sampling,
                   draft_max=0, history=tenant)
        out = []
        while len(out) < 16:
            produced = engine.step().get(0)
            if produced is not None:
                out += produced if isinstance(produced, list) else [produced]
        engine.release(0, keep_cache=False)
        return [o.token for o in out[:16]]
    try:
        cloned = [tokens(dry) for _ in range(2)]
        assert made == [16]                             # one scan of 16 breakers
        # ... per tenant: another key's scan kept answered sooner (an oracle)
        assert tokens(dry, "other") == cloned[0] and made == [16, 16]
        made.pop()
        unbroken = tokens(dataclasses.replace(
            dry, dry_sequence_breakers=tuple(f"b{i}" for i in range(16))))
        assert made == [16, 16]
        plain = tokens(SamplingParams(temperature=0, ignore_eos=True))

        def afresh_sampler(self, multiplier, base, allowed_length, window, breakers,
                           tenant=None):
            encoded = [b.encode() for b in breakers]         # (each chain its own scan)
            return llama_cpp.llama_sampler_init_dry(
                self.vocab, multiplier, base, allowed_length, window,
                (ctypes.c_char_p * len(encoded))(*encoded), len(encoded))
        monkeypatch.setattr(DryTemplates, "sampler", afresh_sampler)
        afresh = tokens(dry)
        assert made == [16, 16, 16]
    finally:
        engine.close()
    assert cloned == [afresh] * 2, (cloned, afresh)
    assert unbroken != plain and afresh != unbroken, (plain, unbroken, afresh)  # (DRY on,
    # and its breakers count: a clone that lost them would draw what `unbroken` draws)


def test_greedy_text_with_drafts_is_the_text_without_them_over_many_files(model_path):
    """Over real files never seen (edits and fresh function bodies), the greedy tokens
    with drafts are those without them, except where the two runs part at a near-tie:
    a draft's rows are decoded in a batch of several, whose kernels round differently
    from a one-row step's (llama.cpp's too), so two close candidates may swap (up to
    0.35 nats apart, measured here: design.md, Speculation; allowed: 0.5). Any other
    difference is a verification fault: where they part, the drafted run's token must be
    one of the plain run's candidates within 0.5 nats of its top (on a flat distribution
    a third one as well as the runner-up: two 0.12 nats apart at 6%, on an Intel Xeon's
    kernels, and the drafted run drew a third). Both runs start
    from the same cached prompt; the drafts are really tried (and some accepted)."""
    from workers.engine.llama import LlamaEngine
    from workers.engine.stepcosts import StepCosts
    engine = LlamaEngine(model_path, 2048, 1, THREADS, 0, draft_max=16,
                         step_costs=StepCosts.assumed())
    same, drafted, accepted = 0, 0, 0
    prompts = first_seen_prompts(6)
    try:
        for prompt in prompts:
            tokens = engine.tokenize(prompt)
            with_drafts, (proposed, kept) = greedy_tokens(engine, tokens, 40, 16)
            plain, _ = greedy_tokens(engine, tokens, 40, 0, logprobs=5)
            drafted, accepted = drafted + proposed, accepted + kept
            a, b = [o.token for o in with_drafts], [o.token for o in plain]
            if a == b:
                same += 1
                continue
            i = next(k for k in range(len(a)) if a[k] != b[k])
            top = plain[i].top
            near = [t for t, lp in top[1:] if top[0][1] - lp < 0.5]     # (not the top)
            assert a[i] in near, (prompt[:80], i, a[i], top)     # a near-tie's other won
    finally:
        engine.close()
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    assert same >= len(prompts) // 2, same


def test_the_models_own_earlier_tokens_draft_first_seen_code_where_rows_are_cheap(
        model_path):
    """Function bodies of files never seen, one after another for one tenant, on a
    GPU-like cost table (a draft row nearly free): the `recycled` source (what the
    model wrote after the last two tokens in the tenant's earlier answers) drafts, and
    some of its tokens hold; the source counts reach the step profile. Each sequence's
    floor is the device's share (`StepCosts.floor_share`: one in a hundred), not a
    quarter."""
    from dispatcher.tools.bench_corpus import Corpus, function_start
    from workers.engine.llama import LlamaEngine
    from workers.engine.speculation import FLOOR_LEAST
    from workers.engine.stepcosts import SHAPES_EXTRA, StepCosts
    gpu = StepCosts((1, 2), {(s, d): 10.0 + 0.3 * s + 0.05 * d for s in (1, 2)
                             for d in SHAPES_EXTRA})
    engine = LlamaEngine(model_path, 2048, 1, THREADS, 0, draft_max=16, step_costs=gpu)
    try:
        for prompt in Corpus(seed=37).prompts("fresh", 4, function_start):
            engine.add(0, engine.tokenize(prompt), GREEDY, history="tenant", budget=48)
            assert engine.slots[0].policy.floor == gpu.floor_share(16) == FLOOR_LEAST
            made = 0
            while made < 48:
                out = engine.step().get(0)
                made += 0 if out is None else len(out) if isinstance(out, list) else 1
            engine.release(0)
            if engine.totals.sources.get("recycled", [0, 0])[1]:
                break                               # (one of its tokens held)
        drafted, accepted = engine.totals.sources.get("recycled", [0, 0])
        assert drafted > 0 and 0 < accepted <= drafted, engine.totals.sources
        assert sum(a for _, a in engine.totals.sources.values()) == engine.totals.accepted
    finally:
        engine.close()


def test_drafts_are_held_short_while_another_sequence_shares_the_worker(model_path,
                                                                        monkeypatch):
    """Beside another running sequence, a step with drafts may take at most twice the
    plain one: on the CPU's costs (here without the drafts-alike shapes: the other has
    nothing to draft) that is no draft, on a GPU's (cheap rows) the drafts stay; alone
    again, the sequence drafts on the CPU too. (The quiet time after an arrival is
    another rule, off here: the test does not depend on the clock.)"""
    from workers.engine import drafting
    from workers.engine.llama import LlamaEngine
    monkeypatch.setattr(drafting, "ARRIVAL_QUIET", 0.0)
    from workers.engine.stepcosts import SHAPES_EXTRA, StepCosts
    keep_going = SamplingParams(temperature=0.0, ignore_eos=True)
    gpu = StepCosts((1, 2), {(s, d): 10.0 + s + 0.05 * d for s in (1, 2)
                             for d in SHAPES_EXTRA})
    cpu = StepCosts((1, 2, 8), StepCosts.assumed().table)
    for name, costs in (("cpu", cpu), ("gpu", gpu)):
        engine = LlamaEngine(model_path, 1024, 2, THREADS, 0, draft_max=16,
                             step_costs=costs)
        try:
            engine.add(1, engine.tokenize("x = [1, 2, 3]\nprint(len(x))\n"), keep_going)
            while not engine.slots[1].line_done:
                engine.step()
            engine.add(0, engine.tokenize(REPEATING_CODE), GREEDY)
            for _ in range(24):         # (on the GPU's costs, until a draft is accepted)
                engine.step()
                if name == "gpu" and engine.draft_stats(0)[1] > 0:
                    break
            beside = engine.draft_stats(0)
            assert (beside[0] > 0) == (name == "gpu"), (name, beside)    # drafted
            assert (beside[1] > 0) == (name == "gpu"), (name, beside)    # accepted
            engine.release(1)
            for _ in range(24):         # until a draft is accepted alone
                engine.step()
                if engine.draft_stats(0)[1] > beside[1]:
                    break
            assert engine.draft_stats(0)[1] > beside[1], name
        finally:
            engine.close()


def test_sequences_that_repeat_draft_alike_on_the_cpu(model_path, monkeypatch):
    """Two sequences copying their own code, on the CPU's costs: a draft on one alone
    beside the other does not pay, the same number of draft rows on both (one batch)
    does: both draft and have drafts accepted, in steps where their drafts are equally
    long."""
    from workers.engine import drafting
    from workers.engine.llama import LlamaEngine
    from workers.engine.stepcosts import StepCosts
    monkeypatch.setattr(drafting, "ARRIVAL_QUIET", 0.0)
    keep_going = SamplingParams(temperature=0.0, ignore_eos=True)
    engine = LlamaEngine(model_path, 1024, 2, THREADS, 0, draft_max=16,
                         step_costs=StepCosts.assumed())
    lengths = []
    original = drafting.DraftPlanner.draft

    def draft(self, slots, generating, *args):
        original(self, slots, generating, *args)
        lengths.append(tuple(len(s.draft) for s in generating))
    monkeypatch.setattr(drafting.DraftPlanner, "draft", draft)
    try:
        engine.add(0, engine.tokenize(REPEATING_CODE), keep_going)
        engine.add(1, engine.tokenize("# b\n" + REPEATING_CODE), keep_going)
        for _ in range(40):
            engine.step()
        assert all(engine.draft_stats(slot)[1] > 0 for slot in (0, 1)), \
            [engine.draft_stats(slot) for slot in (0, 1)]
        drafted = [shape for shape in lengths if any(shape)]
        assert drafted and all(len(shape) == 2 and len(set(shape)) == 1 and max(shape) <= 2
                               for shape in drafted), drafted        # (EACH: 1 or 2 rows)
    finally:
        engine.close()


@pytest.fixture
def tiny_model(tmp_path):
    """The tests' tiny random-weights model: the start-up probe measures every shape of
    it, in all its rounds, in a tenth of a second (the bundled model's one round takes
    ~10 s of a core); these tests are about what is measured and kept, on this device."""
    from tiny_gguf import write_tiny_fim_model
    return str(write_tiny_fim_model(tmp_path / "tiny.gguf"))


def test_step_costs_measured_on_a_busy_machine_are_used_but_not_kept(tiny_model, tmp_path,
                                                                    monkeypatch):
    from workers.engine import costprobe
    from workers.engine.llama import LlamaEngine
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(costprobe, "UNCONTENDED", 1e9)      # no share of the cores is enough
    engine = LlamaEngine(tiny_model, 256, 2, THREADS, 0, draft_max=16)
    try:
        assert engine.step_costs.table[1, 0] > 0
    finally:
        engine.close()
    assert not list(tmp_path.glob("**/step-costs-*.json"))


def test_steps_keep_measured_costs_current(tiny_model, tmp_path, monkeypatch):
    """Measured costs (not given ones) move toward the steps' real times. A lone
    sequence's row measured 1,000 times too dear makes two rows look cheaper (a filler in
    the free slot beside it): its step is left unpadded to be observed, and again while
    it comes out under its cost, so the error is corrected, not avoided. (Each step
    moves it at most a clamped factor: 24 steps leave room for a few a loaded machine
    slows, where 12 at 50 times left one.)"""
    from workers.engine.llama import LlamaEngine
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    engine = LlamaEngine(tiny_model, 1024, 2, THREADS, 0, draft_max=16)
    try:
        engine.step_costs.table[1, 0] *= 1000          # a start-up taken on a busy machine
        wrong = engine.step_costs.table[1, 0]
        assert engine.step_costs.table[2, 0] < 0.5 * wrong
        engine.add(0, engine.tokenize("Once upon a time"),
                   SamplingParams(temperature=0, ignore_eos=True), draft_max=0)
        for _ in range(24):
            engine.step()
        assert engine.step_costs.observed >= 20
        assert engine.step_costs.table[1, 0] < 0.5 * wrong
        assert engine.totals.filler_rows == 0
    finally:
        engine.close()


def test_step_costs_are_measured_on_this_device_and_kept(tiny_model, tmp_path, monkeypatch):
    """At start-up with drafts on: a decode per batch shape (none cheaper than the plain
    step, more rows dearer overall) and the full batch's step (the watchdog's);
    the next engine of the same shape reads them from the cache directory, and another
    context length keys another table (its steps attend over more cells). (Kept however
    busy this machine is: the busy-machine rule has a test of its own.)"""
    from workers.engine import costprobe, llama
    from workers.engine.llama import LlamaEngine
    from workers.engine.stepcosts import EACH, SHAPES_EXTRA
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(costprobe, "UNCONTENDED", 0.0)
    engine = LlamaEngine(tiny_model, 256, 2, THREADS, 0, draft_max=16)
    try:
        table, full = engine.step_costs.table, engine.step_costs.full_step_s
        assert set(table) == {(s, d) for s in (1, 2) for d in SHAPES_EXTRA}
        assert all(table[s, 0] > 0 for s in (1, 2))
        assert all(table[s, 0] <= table[s, d] for s in (1, 2) for d in SHAPES_EXTRA)
        assert set(engine.step_costs.each) == {(2, k) for k in EACH}
        assert table[1, 0] < table[1, SHAPES_EXTRA[-1]]
        assert full > table[1, 0] / 1000 and engine.full_step_seconds() == full
        assert engine.cached_prefix([1, 2, 3], [0, 1]) == 0     # the slots are empty again
    finally:
        engine.close()
    kept = list((tmp_path / "completions-server").glob("step-costs-*.json"))
    assert len(kept) == 1
    monkeypatch.setattr(llama, "full_step_seconds", lambda engine: pytest.fail("measured"))
    again = LlamaEngine(tiny_model, 256, 2, THREADS, 0, draft_max=16)
    try:
        assert again.step_costs.table == table and again.step_costs.each
        assert again.full_step_seconds() == full
        keys = {costprobe.table_key(again, 2, THREADS, 0, repacked)   # (as this CPU
                for repacked in (True, False)}                       # allows repacking)
        assert kept[0].name in {f"step-costs-{key}.json" for key in keys}
        again.n_ctx = 512
        assert not keys & {costprobe.table_key(again, 2, THREADS, 0, repacked)
                           for repacked in (True, False)}
    finally:
        again.close()


def test_a_worker_without_drafts_still_measures_its_step_costs(tiny_model, tmp_path,
                                                                monkeypatch):
    """The costs decide more than drafts (prompt first, which sequences sit out, filler
    rows, the dispatcher's routing): a worker with `--draft-max 0` measures them too, so
    turning drafts off turns off drafts only. Never in deterministic mode; an engine
    made without asking (a test's, selftest's) measures only for its drafts."""
    from workers.worker import load_engine
    from workers.engine.llama import LlamaEngine
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    worker = load_engine("llama", tiny_model, 256, 2, THREADS, 0, False, draft_max=0)
    try:
        assert worker.draft_max == 0 and worker.step_costs.table[1, 0] > 0
        assert worker.step_costs.rates(2)
    finally:
        worker.close()
    for engine in (load_engine("llama", tiny_model, 256, 2, THREADS, 0, False,
                               deterministic=True),
                   load_engine("llama", tiny_model, 256, 2, THREADS, 0, False,
                               measure_costs=False),              # (selftest's)
                   LlamaEngine(tiny_model, 256, 2, THREADS, 0, draft_max=0)):
        try:
            assert engine.step_costs is None
        finally:
            engine.close()


def test_step_costs_are_measured_after_a_cached_context_in_every_slot(model_path):
    """The measured steps attend over an editor's context (up to CONTEXT tokens, as
    many as fit beside the measured rows), copied into every slot, and cleared after."""
    from workers.engine import costprobe
    from workers.engine.llama import LlamaEngine
    engine = LlamaEngine(model_path, 256, 3, THREADS, 0, draft_max=0)
    try:
        cached = costprobe.cache_context(engine, 3)
        assert costprobe.PREFIX < cached <= 256 - 64 - 2
        memory = engine.memory
        assert [engine.lib.llama_memory_seq_pos_max(memory, s) for s in range(3)] == \
            [cached - 1] * 3
        assert costprobe.timed_shape(engine, 3, 4, cached=cached) > 0
        assert [engine.lib.llama_memory_seq_pos_max(memory, s) for s in range(3)] == \
            [cached - 1] * 3                     # the measured rows gone, the context kept
    finally:
        engine.close()


def test_deterministic_mode_never_speculates(model_path):
    tokens, steps, stats = run_speculated(model_path, 16, deterministic=True, n=8)
    assert stats == (0, 0) and steps >= 8


def test_a_long_text_is_tokenized_once_for_its_copies(model_path, monkeypatch):
    from workers.engine import vocabulary
    engine = make(model_path, slots=1)
    calls = []
    real = engine.vocabulary._tokenize
    monkeypatch.setattr(engine.vocabulary, "_tokenize",
                        lambda t, s, p: calls.append(len(t)) or real(t, s, p))
    text = "word " * 2000
    first = engine.tokenize(text)
    first.append(-1)                          # a caller's list is its own
    again = engine.tokenize("".join(["word "] * 2000))       # an equal, distinct string
    assert again == first[:-1] and calls == [len(text)]
    for i in range(vocabulary.KEPT_TOKENIZATIONS):
        engine.tokenize(f"{i} " + text)
    engine.tokenize(text)                     # pushed out by newer ones: tokenized again
    engine.tokenize("short")                  # short texts are not kept
    engine.tokenize("short")
    assert calls.count(len(text)) == 2 and calls.count(len("short")) == 2
    # a text kept is its tenant's own: another key's /tokenize or refused prompt of the
    # same text took half the time (an oracle of the first key's prompt)
    import msgspec

    from dispatcher.common import protocol as P
    from workers.prompts import fitted_prompt, vocabulary_op
    secret = "secret " * 1000
    calls.clear()

    def job(tenant, **fields):
        return msgspec.convert({"id": "j", "model": "m", "prompt": secret, "tenant": tenant,
                                "generation": fields}, P.WorkerJob)
    fitted_prompt(engine, job("key-a"), None, [])
    fitted_prompt(engine, job("key-a"), None, [])                # (its own: kept)
    assert calls == [len(secret)]
    vocabulary_op(engine, msgspec.structs.replace(job("key-b", content=secret,
                                                      add_special=True), op="tokenize"))
    assert calls == [len(secret)] * 2
    engine.close()


def test_first_line_first_a_deep_sequence_yields_steps(model_path):
    """A sequence past its first line and DEEP_AFTER tokens sits out every other step
    while another is short of its first line (no step costs here: every one that may
    sits out), never two in a row; once that one has its line, both get a row every
    step again."""
    from workers.sampling import SamplingParams
    engine = make(model_path, slots=2)
    try:
        ran = deep_beside_a_first_line(
            engine, "x = [1, 2, 3]\nprint(len(x))  # a comment that goes on",
            SamplingParams(temperature=0.0, ignore_eos=True))
        assert len(ran) >= 3
        assert "FF" not in ran, ran
        assert ran.count("F") >= len(ran) // 2 - 1
        assert all(0 in engine.step() for _ in range(4))          # no one waits: every step
    finally:
        engine.close()


def deep_beside_a_first_line(engine, prompt: str, sampling) -> str:
    """Slot 0 generates past its first line and DEEP_AFTER tokens, then slot 1 starts
    `prompt`: whether slot 0 got a token in each step until slot 1's first line is done
    (a newline, or FIRST_LINE_MAX tokens), as T and F."""
    from workers.engine.scheduling import DEEP_AFTER
    from workers.sampling import SamplingParams
    engine.add(0, engine.tokenize("def f():\n    return 1\n\n\ndef g():\n"),
               SamplingParams(temperature=0.0, ignore_eos=True))
    while not (engine.slots[0].line_done and engine.slots[0].sampled >= DEEP_AFTER):
        engine.step()
    engine.add(1, engine.tokenize(prompt), sampling)
    ran = ""
    while not engine.slots[1].line_done:
        ran += "T" if 0 in engine.step() else "F"
    return ran


def test_first_line_first_with_costs_a_deep_sequence_runs_one_step_in_eight(model_path,
                                                                          monkeypatch):
    """With measured step costs (a CPU's: one row costs half of two), a deep sequence
    sits out up to SIT_OUT_RUN steps in a row while another writes its first line (a
    grammar keeps it from writing a newline: FIRST_LINE_MAX tokens), then gets a step,
    and sits out again; no longer run of sit-outs; every step again once the line is
    done."""
    from workers.engine import scheduling
    from workers.engine.llama import LlamaEngine
    from workers.engine.scheduling import SIT_OUT_RUN
    from workers.engine.stepcosts import StepCosts
    from workers.sampling import SamplingParams
    # (the count alone: on a loaded machine 0.3 s of slow steps would end a run too)
    monkeypatch.setattr(scheduling, "SIT_OUT_SECONDS", 60.0)
    engine = LlamaEngine(model_path, 1024, 2, THREADS, 0, step_costs=StepCosts.assumed())
    try:
        ran = deep_beside_a_first_line(
            engine, "The history of the Roman Empire, part one, is",
            SamplingParams(temperature=0.0, ignore_eos=True, grammar="root ::= [^\\n]*"))
        assert len(ran) > 2 * (SIT_OUT_RUN + 1), ran
        assert "F" * SIT_OUT_RUN in ran and "F" * (SIT_OUT_RUN + 1) not in ran, ran
        assert ran.count("T") <= len(ran) // (SIT_OUT_RUN + 1) + 2, ran
        assert all(0 in engine.step() for _ in range(4))          # no one waits: every step
    finally:
        engine.close()


def test_a_prompt_finishing_beside_generating_sequences_is_decoded_first(model_path):
    """Prompt first, on the CPU's costs with a host of 1 ms a round: the step that
    finishes a new prompt of several rows beside two generating sequences decodes that
    prompt alone (its first token out, theirs not); the next step is theirs and the new
    one's, without the rows of a prompt that arrived meanwhile, which goes alone the
    step after; a prompt passed over beside the one going first gets its piece in their
    step; a one-row piece (a prompt cached but its last token) goes beside them; with a
    host of 50 ms a round (more than their decode) a new prompt goes beside them too."""
    from workers.engine.llama import LlamaEngine
    from workers.engine.stepcosts import HOST_GAPS
    from workers.engine.stepcosts import StepCosts
    engine = LlamaEngine(model_path, 1024, 4, THREADS, 0, step_costs=StepCosts.assumed())
    keep_going = SamplingParams(temperature=0.0, ignore_eos=True)
    texts = ["import json\n\n\nclass Settings:\n    def __init__(self):\n",
             "import os\nimport sys\n\n\ndef main(argv):\n",
             "total = 0\nfor n in x:\n",
             "# Copyright the authors. Licensed under the Apache License, Version 2.0; you may "
             "not use this file except in compliance with the License.\n\nimport re\n"]
    prompts = [engine.tokenize(text) for text in texts]
    assert 2 < len(prompts[2]) < len(prompts[3]) and len(prompts[3]) > 16
    try:
        for slot, text in enumerate(("def f():\n", "x = [")):
            engine.add(slot, engine.tokenize(text), keep_going, draft_max=0)
        while any(engine.slots[i].pending for i in (0, 1)):
            engine.step()
        engine.host.gaps.extend([1.0] * HOST_GAPS)
        engine.add(2, prompts[0], GREEDY, draft_max=0)
        rows = engine.totals.prompt_rows
        assert sorted(engine.step()) == [2]
        assert engine.totals.prompt_rows == rows + len(prompts[0])
        engine.add(3, prompts[1], GREEDY, draft_max=0)
        assert sorted(engine.step()) == [0, 1, 2]
        assert engine.totals.prompt_rows == rows + len(prompts[0])
        assert sorted(engine.step()) == [3]
        assert engine.totals.prompt_rows == rows + len(prompts[0]) + len(prompts[1])
        assert sorted(engine.step()) == [0, 1, 2, 3]
        for slot in (2, 3):
            engine.release(slot)
        engine.add(2, prompts[2], GREEDY, draft_max=0)
        engine.add(3, prompts[3], GREEDY, draft_max=0)
        assert sorted(engine.step()) == [2]
        assert engine.slots[3].passed_over
        assert sorted(engine.step()) == [0, 1, 2, 3]
        engine.release(2)
        engine.add(2, prompts[2], GREEDY, draft_max=0)
        assert len(engine.slots[2].pending) == 1
        assert sorted(engine.step()) == [0, 1, 2, 3]
        engine.release(2)
        engine.host.gaps.extend([50.0] * HOST_GAPS)
        engine.add(2, engine.tokenize("class Point:\n    x: int\n    y: int\n"), GREEDY,
                   draft_max=0)
        assert sorted(engine.step()) == [0, 1, 2, 3]
    finally:
        engine.close()


@pytest.mark.parametrize("seconds", [60.0, 0.0])
def test_prompts_going_first_hold_a_deep_sequence_back_seven_steps_at_most(
        model_path, monkeypatch, seconds):
    """A deep sequence beside a stream of new prompts, a new one as soon as the last is
    decoded (the CPU's costs, a host of 1 ms a round): whether it sits out for them or
    would be held back for their first tokens, it gets a row at least once in
    SIT_OUT_RUN + 1 steps (held back with its count of steps sat out reset, it once got
    none in 60), and once its steps sat out in a row reach SIT_OUT_SECONDS (here 60 s:
    the count alone; 0 s: never two steps in a row, held back or sitting out)."""
    from workers.engine import scheduling
    from workers.engine.llama import LlamaEngine
    from workers.engine.scheduling import DEEP_AFTER, SIT_OUT_RUN
    monkeypatch.setattr(scheduling, "SIT_OUT_SECONDS", seconds)
    from workers.engine.stepcosts import HOST_GAPS
    from workers.engine.stepcosts import StepCosts
    engine = LlamaEngine(model_path, 2048, 4, THREADS, 0, step_costs=StepCosts.assumed())
    try:
        engine.add(0, engine.tokenize("def f():\n    return 1\n\n\ndef g():\n"),
                   SamplingParams(temperature=0.0, ignore_eos=True), draft_max=0)
        while not (engine.slots[0].line_done and engine.slots[0].sampled >= DEEP_AFTER):
            engine.step()
        without, longest = 0, 0
        for n in range(60):
            for slot in (1,):
                if not engine.slots[slot].busy or not engine.slots[slot].pending:
                    if engine.slots[slot].busy:
                        engine.release(slot)
                    engine.add(slot, engine.tokenize(f"# part {n} of {slot}\nvalue_{n} = "),
                               GREEDY, draft_max=0)
            engine.host.gaps.extend([1.0] * HOST_GAPS)
            out = engine.step()
            without = 0 if 0 in out else without + 1
            longest = max(longest, without)
        assert longest <= (SIT_OUT_RUN if seconds else 1), longest
    finally:
        engine.close()


def test_a_first_line_without_a_newline_ends_after_first_line_max_tokens(model_path):
    """A sequence that writes no newline (a grammar forbids it) counts as short of its
    first line for FIRST_LINE_MAX tokens and then as past it: the deep streams beside
    it stop sitting out for it, instead of yielding every other step of its life."""
    from workers.engine.scheduling import FIRST_LINE_MAX
    from workers.sampling import SamplingParams
    engine = make(model_path, slots=1)
    one_line = SamplingParams(temperature=0.0, ignore_eos=True, grammar="root ::= [^\\n]*")
    try:
        engine.add(0, engine.tokenize("The history of the Roman Empire, part one, is"),
                   one_line)
        done = []
        while engine.slots[0].sampled < FIRST_LINE_MAX + 2:
            out = engine.step().get(0)
            if out is not None:
                assert out.error is None, out.error
                assert b"\n" not in engine.piece(out.token)
                done.append(engine.slots[0].line_done)
        assert done[:FIRST_LINE_MAX - 1] == [False] * (FIRST_LINE_MAX - 1)
        assert done[FIRST_LINE_MAX - 1:] == [True] * (len(done) - FIRST_LINE_MAX + 1)
    finally:
        engine.close()


INFILL_UNDER_A_GRAMMAR = """
import glob, os, sys
from workers.sampling import SamplingParams
from workers.engine.llama import LlamaEngine
engine = LlamaEngine(sys.argv[1], 1024, 1, int(sys.argv[2]), 0, draft_max=0)
files = sorted(glob.glob(os.path.dirname(os.__file__) + "/*.py"))[:12]
for seed, path in enumerate(files):
    sampling = SamplingParams(grammar='root ::= [^\\n]* "\\n"', top_k=40, top_p=0.95,
                              samplers=("top_k", "top_p", "infill"), temperature=1.0,
                              seed=seed)
    engine.add(0, engine.tokenize(open(path).read()[:600]), sampling, reuse=False)
    tokens = []
    while len(tokens) < 40:
        out = engine.step().get(0)
        if out is not None:
            assert out.error is None, out.error
            tokens.append(out.token)
            if b"\\n" in engine.piece(out.token):
                break
    engine.release(0, keep_cache=False)
    assert not any(engine.is_eog(t) for t in tokens), tokens
print("ok")
"""


def test_a_grammar_beside_the_infill_sampler_never_aborts_the_worker(model_path):
    """llama.cpp's `infill` sampler answers an end token when no other is likely enough,
    whatever the candidates: taken among the likeliest as the grammar's pick, it was
    accepted by a grammar that refused it, and llama.cpp aborted the process (every
    stream of the worker gone; twelve first-seen files here, one valid request each).
    Run in a process of its own: an abort must fail this test, not end the run."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", INFILL_UNDER_A_GRAMMAR, model_path,
                          str(THREADS)], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.parametrize("params", [
    dict(temperature=0),
    dict(temperature=0.8, top_k=40, seed=7),
])
def test_a_refused_pick_sought_among_the_likeliest_tokens_is_the_whole_vocabularys(
        model_path, monkeypatch, params):
    """A grammar the model fights (prose with no letter e): the pick it refuses is sought
    among the 256 likeliest tokens when the chain would keep no others (greedy, or top-k
    first), and the text is token for token what applying the grammar to the whole
    vocabulary gives."""
    from workers.engine import samplers
    sampling = SamplingParams(grammar="root ::= [^e]*", **params)
    prompt = "The history of the Roman Empire, part one, is"

    from workers.engine.llama import LlamaEngine
    engine = LlamaEngine(model_path, 1024, 1, THREADS, 0, draft_max=0)

    def run():
        tokens = sampled(engine, prompt, sampling, 40)
        return tokens, b"".join(engine.piece(t) for t in tokens)

    try:
        calls = []
        real = samplers.Candidates.top
        monkeypatch.setattr(samplers.Candidates, "top",
                            lambda self, logits, n: calls.append(n) or real(self, logits, n))
        top_tokens, text = run()
        assert calls and b"e" not in text                           # fought, and obeyed
        monkeypatch.setattr(samplers, "TOP_CANDIDATES", 0)           # the whole vocabulary
        whole_tokens, _ = run()
        assert top_tokens == whole_tokens
    finally:
        engine.close()


def check_costs(spents, probes=None):
    """The grammar guard's verdicts on one token's stack work after another, `probes`
    the cost of one more check at each new state (default: what the token cost) (unit)."""
    from types import SimpleNamespace

    from workers.engine import samplers
    from workers.errors import InvalidInput
    chain = SimpleNamespace(check_seconds=0.0)
    probes = probes or spents
    for n, spent in enumerate(spents):
        try:
            samplers.SamplerChain._check_cost(chain, spent, lambda n=n: probes[n])
        except InvalidInput:
            return n
    return None


def test_the_grammar_guard_ends_a_growing_cost_not_one_slow_moment():
    cheap = [5e-5] * 20
    moment = cheap + [0.05] + cheap            # a page fault, a stolen CPU: the next
    assert check_costs(moment, cheap + [5e-5] + cheap) is None       # check is cheap
    assert check_costs(cheap + [0.15] + cheap, [5e-5] * 41) is None
    assert check_costs(cheap + [0.5], [5e-5] * 21) == len(cheap)     # four times over
    # stacks that jumped within one long token ("aaaaaaaa"): the next check is dear too
    assert check_costs(cheap + [0.08], cheap + [0.04]) == len(cheap)
    assert check_costs(cheap + [0.3], cheap + [0.15]) == len(cheap)
    doubling = [5e-5 * 2 ** k for k in range(20)]             # stacks doubling a token
    stopped = check_costs(doubling)
    assert stopped is not None and doubling[stopped] <= 0.11
    assert check_costs([0.09] * 50) is None                   # dear, but not growing


def test_no_text_makes_fewer_tokens_than_its_characters_over_the_longest_piece(model_path):
    """The bound a prompt is refused by before it is tokenized (workers/prompts.py
    `fewest_tokens`) holds on the real vocabulary: real code, runs of the characters its
    longest tokens are made of, whitespace, SPM's own space mark, special-token syntax
    (one followed by whitespace), other scripts."""
    import pathlib
    from workers.engine.llama import LlamaEngine
    engine = LlamaEngine(model_path, 256, 1, THREADS, 0)
    try:
        longest = engine.longest_piece()
        pieces = max(len(engine.piece(t, True)) for t in range(engine.n_vocab))
        assert longest >= pieces > 1                  # (the bundled model has a bound)
        texts = [pathlib.Path(os.__file__).read_text()[:20_000], "\u2014" * 3000,
                 "\u2500" * 3000, "\u2026" * 3000, " " * 5000, "\n" * 5000, "\t" * 5000,
                 "\u2581" * 3000, "\r\n" * 3000, "<start_of_turn>" + " " * 3000,
                 "<start_of_turn>user\n" * 300, "<end_of_turn>" * 300,
                 "\u0935\u093f\u0926\u094d\u092f\u093e\u0930\u094d\u0925" * 500,
                 "=" * 5000, "#" * 5000, "0" * 5000]
        for text in texts:
            tokens = engine.tokenize(text)
            assert len(tokens) * longest >= len(text), (text[:20], len(tokens))
    finally:
        engine.close()


def test_a_released_slot_keeps_no_draft_for_its_next_request(tiny_model, tmp_path,
                                                             monkeypatch):
    """A step whose decode fails leaves the drafts it had planned on their slots; the
    slots' requests fail and are released. The next request in such a slot must start
    from its whole prompt: a draft left behind was taken as this prompt's tail and cut
    that many tokens from its cache."""
    from workers.engine.llama import LlamaEngine
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    engine = LlamaEngine(tiny_model, 256, 1, THREADS, 0, draft_max=16)
    try:
        engine.add(0, engine.tokenize("Once upon a time"), GREEDY, draft_max=0)
        engine.step()
        slot = engine.slots[0]
        slot.draft, slot.draft_rows = [5, 6, 7, 8], [1, 2, 3, 4]   # the failed step's
        engine.release(0, keep_cache=False)
        prompt = engine.tokenize("There was a lighthouse keeper who counted ships")
        engine.add(0, prompt, GREEDY)
        while not engine.step():
            pass
        assert slot.cached[:len(prompt)] == prompt and slot.n_past >= len(prompt)
    finally:
        engine.close()


def test_a_model_whose_memory_cannot_drop_positions_serves_without_drafts(
        tiny_model, tmp_path, monkeypatch):
    """A recurrent or hybrid model (Mamba, RWKV, Granite-H, LFM2): llama.cpp's memory
    for it cannot drop a rejected draft's positions, so drafts are off from the load
    (no step costs are measured: the probe's own rollbacks would fail) and it
    generates as without them."""
    import llama_cpp
    from workers.engine.llama import LlamaEngine
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(llama_cpp, "llama_model_is_hybrid", lambda model: True)
    engine = LlamaEngine(tiny_model, 256, 1, THREADS, 0, draft_max=16)
    try:
        assert engine.draft_max == 0 and engine.step_costs is None
        assert len(generate(engine, [(0, "Once upon a time")], n=8)[0]) == 8
    finally:
        engine.close()


def test_a_recurrent_or_hybrid_draft_model_is_refused(tiny_model, tmp_path, monkeypatch):
    """A draft model's cache drops the drafts the served model refuses: one whose
    memory cannot (recurrent, hybrid) is refused at load with the reason."""
    import llama_cpp
    from workers.engine.draftmodel import DraftModel
    from workers.engine.contextshape import ContextShape
    from workers.engine.llama import LlamaEngine
    from workers.errors import EngineError

    class HybridLib:                     # llama.cpp, the model read as a hybrid one
        def __getattr__(self, name):
            return getattr(llama_cpp, name)

        @staticmethod
        def llama_model_is_hybrid(model):
            return True

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    engine = LlamaEngine(tiny_model, 256, 1, THREADS, 0, draft_max=0)
    try:
        with pytest.raises(EngineError, match="recurrent or hybrid"):
            DraftModel(HybridLib(), tiny_model, engine.vocab, 256, 1, THREADS, 0,
                       ContextShape(), False)
    finally:
        engine.close()


def test_code_in_a_fill_in_the_middle_prompt_is_text_never_control_tokens(model_path):
    """A file that holds `<eos>` or `<start_of_turn>` (tokenizer configs, ML code): in a
    FIM prompt's prefix, suffix and extra chunks those are characters, as llama.cpp's
    /infill reads them, not the model's end or turn token; the template's own literal
    text and /infill's `prompt` are parsed as special-token syntax."""
    from workers.prompts import FimTemplate, infill_tokens
    engine = make(model_path, slots=1)
    try:
        eos = engine.tokenize("<eos>", add_special=False)
        assert len(eos) == 1                              # (the control token, parsed)
        template = FimTemplate.parse("<start_of_turn>{prefix}<end_of_turn>{suffix}<eos>")
        tokens = infill_tokens(engine, "a = '<eos>'", "b = '<start_of_turn>'", template,
                               [{"filename": "<eos>.py", "text": "<end_of_turn>"}], "<eos>")
        specials = [t for t in tokens if engine.tokenize(
            engine.piece(t).decode(errors="replace"), add_special=False,
            parse_special=False) != [t]]
        # BOS, the template's three and the middle's one: nothing from the code
        assert specials == engine.bos() + [105, 106] + eos + eos, specials
        text = b"".join(engine.piece(t) for t in tokens).decode(errors="replace")
        assert "a = '<eos>'" in text and "b = '<start_of_turn>'" in text
        assert "--- snippet ---\n\n<end_of_turn>a = " in text   # (no FIM_SEP: no file name)
    finally:
        engine.close()


def test_a_sibling_copying_a_decoded_prompt_sees_what_its_prefill_would(model_path):
    """copy_prefix: a slot given another's decoded prompt (the whole KV stream copied,
    then cut after the prompt) decodes only the last prompt token, and its first token
    and logprob are exactly those of the slot that holds the prompt decoding that token
    again itself (the prompt cache's own reuse; both differ from a whole prefill in the
    last bits, as a prefix decoded in other pieces does)."""
    import glob
    import json
    engine = make(model_path, slots=3)

    def first(slot):
        out = None
        while out is None:
            out = engine.step().get(slot)
        engine.release(slot)
        return out
    try:
        for path in sorted(glob.glob(os.path.dirname(json.__file__) + "/*.py"))[:3]:
            tokens = engine.tokenize(open(path).read()[:2000])
            for s in range(3):
                engine.release(s, keep_cache=False)
            engine.add(0, tokens, GREEDY, logprobs=2)
            first(0)
            assert engine.add(0, tokens, GREEDY, logprobs=2) == len(tokens) - 1
            own = first(0)
            assert engine.copy_prefix(0, 2, tokens) == len(tokens) - 1
            assert engine.add(2, tokens, GREEDY, logprobs=2) == len(tokens) - 1
            copied = first(2)
            assert copied.token == own.token and abs(copied.logprob - own.logprob) < 1e-4
        assert engine.copy_prefix(0, 1, engine.tokenize("short")) == 0   # (not worth it)
        # a source cached but for its last prompt token (the same prompt again: `n`
        # choices of one asked twice) holds all a copy takes; it was passed over, and
        # each sibling prefilled the whole prompt cold
        for s in range(3):
            engine.release(s, keep_cache=False)
        engine.add(0, tokens, GREEDY)
        first(0)
        assert engine.add(0, tokens, GREEDY) == len(tokens) - 1
        assert engine.prefill_left(0) == 1
        assert engine.copy_prefix(0, 1, tokens) == len(tokens) - 1
        assert engine.add(1, tokens, GREEDY) == len(tokens) - 1
        firsts = {}
        while len(firsts) < 2:
            firsts.update(engine.step())
        assert firsts[0].token == firsts[1].token        # (the same KV, the same row)
    finally:
        engine.close()


TYPICAL = SamplingParams(temperature=1.0, top_k=0, typical_p=0.5, seed=11)


def drawn(engine, jobs, n):
    """jobs: [(slot, prompt, sampling)] started together; {slot: tokens} and, for each
    slot, the decode steps after which it had each token (a call that hands out draws
    made aside decodes nothing)."""
    out = {slot: [] for slot, _, _ in jobs}
    at = {slot: [] for slot, _, _ in jobs}
    for slot, prompt, sampling in jobs:
        engine.add(slot, engine.tokenize(prompt), sampling)
    while any(len(v) < n for v in out.values()):
        for slot, result in engine.step().items():
            if len(out[slot]) < n:
                assert result.error is None, result.error
                out[slot].append(result.token)
                at[slot].append(engine.totals.steps)
    for slot, _, _ in jobs:
        engine.release(slot)
    return out, at


def test_dear_sampling_is_drawn_aside_and_draws_what_it_would_have(model_path, monkeypatch):
    """typical_p over the whole vocabulary (llama.cpp sorts its 262,144 candidates: tens
    of ms a token here, more than a step) was sampled between two steps, where every
    stream of the worker waited for it. Set aside, it is drawn on the side thread from a
    copy of its row, the same tokens as drawn in place (alone, so every step is the
    same batch), and a greedy neighbour takes a token every step meanwhile, while the
    dear one sits out the steps its draws are made beside. Whether a chain goes aside
    is the measured costs' call (`AsideDraws.worth`, tested on both profiles below); here
    it is forced both ways."""
    from workers.engine.aside import AsideDraws
    engine = make(model_path, slots=2)
    try:
        monkeypatch.setattr(AsideDraws, "worth", staticmethod(lambda sample, step: False))
        in_place, _ = drawn(engine, [(0, PROMPTS[1], TYPICAL)], n=12)
        assert engine.aside.draws == 0
        monkeypatch.setattr(AsideDraws, "worth", staticmethod(lambda sample, step: True))
        engine.clear_caches()
        aside, _ = drawn(engine, [(0, PROMPTS[1], TYPICAL)], n=12)
        assert engine.aside.draws >= 11 and aside == in_place
        engine.clear_caches()
        both, at = drawn(engine, [(0, PROMPTS[1], TYPICAL), (1, PROMPTS[0], GREEDY)], n=12)
        assert at[1] == list(range(at[1][0], at[1][0] + 12))      # a token every step
        assert at[0][-1] > at[1][-1]                    # the dear one sat steps out
        assert not engine.aside.pending
    finally:
        engine.close()


def test_a_tokens_logprobs_count_in_its_measured_sampling(model_path, monkeypatch):
    """A token's logprobs (the row's log-sum-exp and top candidates: passes over the
    whole vocabulary) are its sampling's cost too: timed only from the chain's draw, a
    dear one never went aside and every neighbour's step waited for it."""
    import time as clock

    from workers.engine import reading
    real = reading.top_of
    monkeypatch.setattr(reading, "top_of", lambda *a: clock.sleep(0.03) or real(*a))
    engine = make(model_path, slots=1)
    try:
        engine.add(0, engine.tokenize(PROMPTS[0]), SamplingParams(temperature=0), 2)
        for _ in range(6):
            engine.step()
        assert engine.slots[0].sample_ms >= 20, engine.slots[0].sample_ms
    finally:
        engine.close()


def test_a_draft_sources_fault_ends_that_sequences_drafts_not_every_sequence(
        model_path, monkeypatch):
    """A draft source that raises for one sequence leaves it without drafts; its
    neighbour and itself go on sampling, no token an error (the step raising failed
    every sequence of the worker and cleared its caches)."""
    from workers.engine.llama import LlamaEngine
    from workers.engine.speculation import Drafter
    engine = LlamaEngine(model_path, 1024, 2, THREADS, 0, draft_max=8)
    raised = []
    real = Drafter.propose

    def propose(self, *args, **kwargs):
        if self is engine.slots[0].policy:
            raised.append(1)
            raise RuntimeError("a draft source's bug")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(Drafter, "propose", propose)
    try:
        out, _ = drawn(engine, [(0, PROMPTS[0], GREEDY), (1, PROMPTS[1], GREEDY)], n=12)
        assert len(out[0]) == len(out[1]) == 12      # (drawn: none of them an error)
        assert raised == [1] and engine.slots[0].policy is None
        assert engine.slots[1].policy is not None
    finally:
        engine.close()


def test_a_sequence_whose_start_fails_leaves_its_slot_free(model_path, monkeypatch):
    """A start that raised after the slot took its chain left the slot busy with a chain
    its caller then freed: the next step sampled from freed memory."""
    from workers.engine.llama import LlamaEngine
    from workers.engine.speculation import Drafter

    def broken(self, *args, **kwargs):
        raise RuntimeError("a drafter that cannot be made")
    monkeypatch.setattr(Drafter, "__init__", broken)
    engine = LlamaEngine(model_path, 1024, 1, THREADS, 0, draft_max=8)
    try:
        with pytest.raises(RuntimeError):
            engine.add(0, engine.tokenize(PROMPTS[0]), GREEDY)
        assert not engine.slots[0].busy and engine.step() == {}
    finally:
        engine.close()


def test_a_draw_made_aside_that_fails_is_its_sequences_failure_alone(model_path,
                                                                    monkeypatch):
    """Taking up a token drawn on the side thread raised out of the step (it had no
    guard of its own, as the tokens sampled in place have): every sequence failed."""
    from workers.engine.aside import AsideDraws
    monkeypatch.setattr(AsideDraws, "worth", staticmethod(lambda sample, step: True))
    engine = make(model_path, slots=2)
    real = engine._took

    def took(slot, *args):
        if slot is engine.slots[0] and slot.sampled_aside:
            raise RuntimeError("taking up its draw failed")
        return real(slot, *args)
    monkeypatch.setattr(engine, "_took", took)
    try:
        engine.add(0, engine.tokenize(PROMPTS[1]), TYPICAL)
        engine.add(1, engine.tokenize(PROMPTS[0]), GREEDY)
        errors, tokens = [], []
        for _ in range(12):
            for slot, out in engine.step().items():
                (errors if out.error is not None else tokens).append(slot)
            if errors:
                break
        assert errors == [0] and 1 in tokens
    finally:
        engine.close()


def test_a_chain_goes_aside_only_where_its_sampling_is_dear_beside_the_step():
    """On a CPU-like device (a step of 20-80 ms) and a GPU-like one (3 ms): a greedy
    argmax or a host draw (0.2-1 ms) never goes aside; llama.cpp sorting the whole
    vocabulary (35 ms) does beside a short step, and stays beside one twice as long,
    where waiting a step for its draw would cost it more than it saves the others."""
    from workers.engine.aside import AsideDraws
    for sample_ms, step_ms, aside in ((0.2, 3.0, False), (1.0, 3.0, False),
                                      (35.0, 3.0, True), (35.0, 20.0, True),
                                      (35.0, 80.0, False), (1.0, 20.0, False),
                                      (35.0, 0.0, False)):     # (no step measured yet)
        assert AsideDraws.worth(sample_ms, step_ms) is aside, (sample_ms, step_ms)


def test_a_batch_smaller_than_a_step_is_refused_or_turns_drafts_off(model_path, caplog):
    """llama.cpp's batch arrays hold --batch rows and are written unchecked: a batch
    below the slots (a plain step's rows), or below what measuring the drafts' step
    costs takes (the larger of slots + 64 and 3 × slots rows), wrote past them at load."""
    from workers.engine.contextshape import ContextShape
    from workers.engine.llama import LlamaEngine
    from workers.engine.stepcosts import draft_rows
    from workers.errors import EngineError
    with pytest.raises(EngineError, match="--batch 2 is below the slots"):
        LlamaEngine(model_path, 1024, 4, THREADS, 0, draft_max=64,
                    shape=ContextShape(n_batch=2, n_ubatch=2))
    assert draft_rows(4) == 4 + 64 and draft_rows(32) == 96
    engine = LlamaEngine(model_path, 1024, 4, THREADS, 0, draft_max=64,
                         shape=ContextShape(n_batch=32, n_ubatch=32))
    try:
        assert engine.draft_max == 0 and engine.step_costs is None
        assert "drafts off: --batch 32 is below the 68 rows" in caplog.text
        engine.add(0, engine.tokenize("def f(x):\n    return"), GREEDY)
        assert any(engine.step().get(0) is not None for _ in range(3))
    finally:
        engine.close()
    caplog.clear()                      # a worker with drafts off: no costs, and says so
    engine = LlamaEngine(model_path, 1024, 4, THREADS, 0, draft_max=0, measure_costs=True,
                         shape=ContextShape(n_batch=32, n_ubatch=32))
    try:
        assert engine.step_costs is None and "routing by cost off" in caplog.text
    finally:
        engine.close()


def test_biases_beside_a_grammar_the_model_fights_go_over_the_vocabulary_in_order(
        model_path):
    """A refused pick drawn over the grammar's alphabet (a subset, its ids not their
    indices) sent llama.cpp's logit bias to search the array for each bias: 8,000
    biases beside `[^e]*` took 148 ms a token here, on the generation thread. The chain
    now goes over the whole vocabulary in order, the grammar's verdict kept: the same
    tokens (18 ms a token)."""
    import random
    from workers.engine.llama import LlamaEngine
    engine = LlamaEngine(model_path, 1024, 1, THREADS, 0, draft_max=0)
    rng = random.Random(3)
    bias = {t: -0.01 for t in rng.sample(range(1000, 200000), 1024)}

    def run(whole):
        sampling = SamplingParams(grammar="root ::= [^e]*", temperature=0.8, top_k=40,
                                  seed=7, logit_bias=bias)
        return sampled(engine, "The history of the Roman Empire, part one, is",
                       sampling, 16, lambda slot: setattr(slot.chain, "biased", whole))
    try:
        whole = run(True)
        assert whole == run(False)
        assert b"e" not in b"".join(engine.piece(t) for t in whole)
    finally:
        engine.close()


def test_the_infill_sampler_never_ends_a_request_that_may_not_end_yet(model_path):
    """llama.cpp's `infill` sampler answers an end token when no other is likely enough,
    the end tokens banned or not: with `ignore_eos` (or before `min_tokens`) it ended
    such requests anyway (6 end tokens in 10 first-seen files of 32 tokens here)."""
    import glob
    from workers.engine.llama import LlamaEngine
    engine = LlamaEngine(model_path, 1024, 1, THREADS, 0, draft_max=0)
    files = sorted(glob.glob(os.path.dirname(os.__file__) + "/*.py"))[:10]
    try:
        for seed, path in enumerate(files):
            sampling = SamplingParams(samplers=("top_k", "top_p", "infill"), top_k=40,
                                      top_p=0.95, temperature=1.0, seed=seed,
                                      ignore_eos=True)
            tokens = sampled(engine, open(path).read()[:600], sampling, 32)
            assert not any(engine.is_eog(t) for t in tokens), (path, tokens)
    finally:
        engine.close()


def test_the_infill_samplers_way_out_of_an_end_is_never_a_banned_token():
    """Where the infill sampler answers an end a request may not take yet, the likeliest
    other token stands in: over the raw row, which the chain's logit bias never saw, so a
    token banned with -100 or `false` was that stand-in."""
    from types import SimpleNamespace

    import numpy as np

    from workers.engine.samplers import SamplerChain
    chain = SimpleNamespace(infill=True, grammar=None, banned=np.array([1]))
    row = np.array([0.0, 5.0, 3.0, -1e30], dtype=np.float32)       # 3: the end token
    assert SamplerChain.ends_ok(chain, 3, row, lambda t: t == 3) == 2
    assert row[1] == 5.0                                # (the row itself is left alone)
    chain.banned = np.array([], dtype=np.int64)
    assert SamplerChain.ends_ok(chain, 3, row, lambda t: t == 3) == 1
    assert SamplerChain.ends_ok(chain, 2, row, lambda t: t == 3) == 2


def test_a_grammar_that_can_only_end_still_ends_with_ignore_eos(model_path):
    """With the end tokens banned (ignore_eos, min_tokens) a complete grammar still
    ends there (docs/api.md): the infill sampler's fallback must not turn that end into
    the likeliest other token, which the grammar refuses."""
    from workers.engine.llama import LlamaEngine
    engine = LlamaEngine(model_path, 1024, 1, THREADS, 0, draft_max=0)
    try:
        for params in (dict(temperature=0), dict(temperature=0.8, top_k=40, seed=3),
                       dict(temperature=0.8, top_k=40, seed=3,
                            samplers=("top_k", "temperature", "infill"))):
            sampling = SamplingParams(grammar='root ::= "yes" | "no"', ignore_eos=True,
                                      **params)
            engine.add(0, engine.tokenize("Answer:"), sampling, reuse=False)
            tokens = []
            while not tokens or not engine.is_eog(tokens[-1]):
                out = engine.step().get(0)
                if out is not None:
                    assert out.error is None, out.error
                    tokens.append(out.token)
                assert len(tokens) <= 4, tokens
            engine.release(0, keep_cache=False)
            assert b"".join(engine.piece(t) for t in tokens[:-1]) in (b"yes", b"no")
    finally:
        engine.close()


def test_a_grammar_that_may_end_but_need_not_goes_on_with_ignore_eos(model_path):
    """The infill sampler's end token where the grammar may end (any of `[a-z ]*`) was
    allowed by the grammar and ended the request, `ignore_eos` or not."""
    import glob
    from workers.engine.llama import LlamaEngine
    engine = LlamaEngine(model_path, 1024, 1, THREADS, 0, draft_max=0)
    files = sorted(glob.glob(os.path.dirname(os.__file__) + "/*.py"))[:6]
    try:
        for seed, path in enumerate(files):
            sampling = SamplingParams(grammar="root ::= [a-z ]*", ignore_eos=True,
                                      samplers=("top_k", "temperature", "infill"),
                                      top_k=40, temperature=1.0, seed=seed)
            tokens = sampled(engine, open(path).read()[:400], sampling, 24)
            assert not any(engine.is_eog(t) for t in tokens), (path, tokens)
    finally:
        engine.close()


def test_a_draw_made_aside_never_ends_a_request_that_may_not_end_yet():
    """The infill sampler's end token drawn on the side thread (a costly chain, sampled
    beside the next step) gives way as in the step's own sampling."""
    from types import SimpleNamespace

    import numpy as np
    from workers.engine.aside import AsideDraws
    from workers.engine.samplers import SamplerChain
    draws = AsideDraws(None, 8, [7], -1e30)
    row = np.array([0.5, 3.0, 1.0, 0, 0, 0, 0, 9.0], dtype=np.float32)
    for infill, expected in ((True, 1), (False, 7)):
        chain = SimpleNamespace(infill=infill, grammar=None, banned=np.array([], dtype=int),
                                sample_row=lambda view, candidates: 7)   # (infill's EOT)
        chain.ends_ok = lambda token, view, is_eog, c=chain: SamplerChain.ends_ok(
            c, token, view, is_eog)
        assert draws._draw(chain, row, True, None).token == expected
    draws.close()


def test_set_budget_moves_the_ban_on_ending_to_the_new_owner(model_path):
    """An adoption hands a running sequence to a new request: its max_tokens and its
    min_tokens count from there (the ban on ending ran on from the old request's
    count, so the new one could end short of its own min_tokens)."""
    from workers.engine.llama import LlamaEngine
    engine = LlamaEngine(model_path, 1024, 1, THREADS, 0, draft_max=0)
    try:
        engine.add(0, engine.tokenize("def f(x):\n"), SamplingParams(temperature=0,
                                                                    min_tokens=2))
        for _ in range(4):
            engine.step()
        slot = engine.slots[0]
        assert slot.sampled >= 2
        engine.set_budget(0, 10, least=3)
        assert (slot.budget, slot.min_tokens) == (slot.sampled + 10, slot.sampled + 3)
        engine.set_budget(0, None, least=-4)              # (its min_tokens already met)
        assert (slot.budget, slot.min_tokens) == (None, slot.sampled)
    finally:
        engine.close()


def test_dry_reads_the_prompt_and_native_penalties_count_it(model_path):
    """llama-server takes the whole prompt into a slot's samplers before its first
    token: DRY then penalizes continuing a sequence the prompt already holds, and the
    penalties count what the prompt says (its last `repeat_last_n` tokens). Here DRY
    saw the output alone, and the penalties too; OpenAI's penalties still count the
    output alone (`penalties=False`), as OpenAI's do."""
    import numpy as np
    from workers.engine.llama import LlamaEngine
    engine = LlamaEngine(model_path, 1024, 1, THREADS, 0, draft_max=0)
    try:
        apple, banana, cherry, date = (engine.tokenize(w, add_special=False)[0]
                                       for w in ("apple", " banana", " cherry", " date"))

        def pick(sampling, prompt, penalties):
            chain = engine.sampler_chain(sampling)
            try:
                chain.accept_prompt(prompt, penalties=penalties)
                logits = np.full(engine.n_vocab, -20.0, dtype=np.float32)
                logits[cherry], logits[date] = 1.0, 0.5       # cherry, unless penalized
                return chain.sample_row(logits, engine.candidates)
            finally:
                chain.free()

        presence = SamplingParams(temperature=0, presence_penalty=2.0, repeat_last_n=64)
        assert pick(presence, [cherry, apple], penalties=True) == date
        assert pick(presence, [cherry, apple], penalties=False) == cherry   # (OpenAI's)
        assert pick(presence, [cherry] + [apple] * 64, penalties=True) == cherry  # (window)
        dry = SamplingParams(temperature=0, dry_multiplier=0.8, dry_allowed_length=2)
        repeat = [apple, banana, cherry, apple, banana]         # "apple banana" → cherry
        assert pick(dry, repeat, penalties=False) == date
        assert pick(dry, [apple, date, cherry, apple, banana], penalties=False) == cherry
    finally:
        engine.close()


def test_a_prompt_parsed_as_text_keeps_control_token_syntax_as_characters(model_path):
    """Mistral's FIM route sends its prompt as text (`parse_special` false): `<eos>` in
    code stays characters there; elsewhere a prompt's special-token syntax is parsed."""
    import msgspec

    from dispatcher.common import protocol as P
    from workers.prompts import fitted_prompt
    engine = make(model_path, slots=1)
    try:
        eos = engine.tokenize("<eos>", add_special=False)
        assert len(eos) == 1 and engine.is_eog(eos[0])

        def tokens(**generation):
            return fitted_prompt(engine, msgspec.convert(
                {"id": "j", "model": "m", "prompt": "s = '<eos>'", "generation": generation},
                P.WorkerJob), None, []).tokens
        assert eos[0] in tokens() and eos[0] not in tokens(parse_special=False)
        assert engine.piece(tokens(parse_special=False)[-2]) != b""     # (characters)
    finally:
        engine.close()


def test_a_token_logit_bias_bans_is_never_the_grammars_only_way_out(model_path):
    """`logit_bias` false (or -inf) bans a token: where the grammar allows nothing but
    banned tokens, the request ends with an error; the chain's pick among them, all at
    -inf, was a banned token, emitted."""
    from workers.errors import InvalidInput
    engine = make(model_path, slots=1)
    try:
        a = engine.tokenize("a", add_special=False)
        byte_a = next(t for t in range(engine.n_vocab) if t not in a and
                      engine.piece(t) == b"a")
        banned = SamplingParams.from_job({"temperature": 0, "grammar": 'root ::= "a"',
                                          "logit_bias": {str(a[0]): float("-inf"),
                                                         str(byte_a): float("-inf")}})
        engine.add(0, engine.tokenize("Answer:"), banned, reuse=False)
        out = None
        while out is None:
            out = engine.step().get(0)
        assert isinstance(out.error, InvalidInput) and out.error.param == "logit_bias", out
        engine.release(0, keep_cache=False)
        one_left = SamplingParams.from_job({"temperature": 0, "grammar": 'root ::= "a"',
                                            "logit_bias": {str(a[0]): float("-inf")}})
        assert sampled(engine, "Answer:", one_left, 1) == [byte_a]    # (the other "a")
    finally:
        engine.close()


def test_mirostat_at_a_tiny_temperature_is_near_greedy(model_path):
    """Temperature 1e-9 with Mirostat drew nonsense in llama.cpp's sampler (random tokens,
    "option overloading promoc"); a temperature that small means the greedy text."""
    engine = make(model_path, slots=1)
    try:
        greedy = sampled(engine, "def fib(n):", SamplingParams(temperature=0.0), 6)
        for mirostat in (1, 2):
            tiny = SamplingParams.from_job({"temperature": 1e-9, "mirostat": mirostat,
                                            "seed": 1})
            assert sampled(engine, "def fib(n):", tiny, 6) == greedy, mirostat
        # (llama.cpp's routes take a negative temperature as greedy too)
        assert sampled(engine, "def fib(n):", SamplingParams.from_job(
            {"temperature": -1.0, "top_k": 40}), 6) == greedy
    finally:
        engine.close()


def test_a_free_slot_between_two_streams_joins_their_batch_and_keeps_its_cache(model_path):
    """Streams in slots 0 and 2, slot 1 free holding a finished prompt: on costs where one
    batch of three rows is cheaper than two batches of one (a GPU's), slot 1 takes a
    filler row at the end of its cache every step (llama.cpp would decode the two
    streams as two batches), counted in the step profile and removed after each step:
    its cache keeps exactly its tokens, its prompt is reused whole and goes on as
    before, as on the CPU's costs (three rows 35 ms, one 13), where no filler goes in."""
    from workers.engine.llama import LlamaEngine, llama_cpp
    from workers.engine.stepcosts import SHAPES_EXTRA, StepCosts
    keep_going = SamplingParams(temperature=0.0, ignore_eos=True)
    gpu = StepCosts((1, 2, 3), {(s, d): 10.0 + 0.05 * s + 0.02 * d for s in (1, 2, 3)
                                for d in SHAPES_EXTRA})
    cpu = StepCosts((1, 2, 3), {k: v for k, v in StepCosts.assumed().table.items()
                                if k[0] <= 3 and (k[0] in (1, 2) or k[1] == 0)} |
                    {(3, d): StepCosts.assumed().table[2, d] * 1.4 for d in SHAPES_EXTRA})
    again: dict[str, list[int]] = {}
    for name, costs in (("gpu", gpu), ("cpu", cpu)):
        engine = LlamaEngine(model_path, 1024, 3, THREADS, 0, draft_max=16, step_costs=costs)
        try:
            prompt = engine.tokenize("import os\n\n\ndef list_files(path):\n")

            def run_alone() -> list[int]:
                engine.add(1, prompt, keep_going, draft_max=0)
                made: list[int] = []
                while len(made) < 8:
                    out = engine.step().get(1)
                    made += [] if out is None else [t.token for t in (
                        out if isinstance(out, list) else [out])]
                engine.release(1)
                return made[:8]
            run_alone()
            cached = list(engine.slots[1].cached)
            engine.add(0, engine.tokenize("class Stack:\n    def push(self, item):\n"),
                       keep_going, draft_max=0)
            engine.add(2, engine.tokenize("SELECT name FROM users WHERE"), keep_going,
                       draft_max=0)
            for _ in range(12):
                engine.step()
                assert llama_cpp.llama_memory_seq_pos_max(engine.memory, 1) == len(cached) - 1
            assert (engine.totals.filler_rows >= 8) == (name == "gpu"), \
                (name, engine.totals.filler_rows)
            engine.release(0)
            engine.release(2)
            reused = engine.add(1, prompt, keep_going, draft_max=0)
            assert reused == len(prompt) - 1
            engine.release(1)
            again[name] = run_alone()
        finally:
            engine.close()
    # the same decodes for slot 1 on both: its cache after the fillers decodes as the
    # one that never had any
    assert again["gpu"] == again["cpu"]


def test_a_lone_run_of_seven_is_padded_to_eight_and_now_and_then_not(model_path):
    """On the CPU's costs seven rows cost more than eight: seven streams in slots 0-6 and
    a free slot 7 holding a finished prompt, slot 7 takes a filler row every step but
    one in PAD_PROBE_EVERY (whose unpadded step keeps seven rows' cost observed); its
    cache keeps exactly its tokens. With four streams, no filler (four rows cost least)."""
    from workers.engine.llama import LlamaEngine, llama_cpp
    from workers.engine.spans import PAD_PROBE_EVERY
    from workers.engine.stepcosts import StepCosts
    engine = LlamaEngine(model_path, 1024, 8, THREADS, 0, draft_max=16,
                         step_costs=StepCosts.assumed())
    keep_going = SamplingParams(temperature=0.0, ignore_eos=True)
    try:
        engine.add(7, engine.tokenize("import os\n\n\ndef list_files(path):\n"), GREEDY)
        while engine.slots[7].pending or engine.slots[7].sampled < 2:
            engine.step()
        engine.release(7)
        cached = list(engine.slots[7].cached)
        for count in (7, 4):
            for slot in range(count):
                engine.add(slot, engine.tokenize(f"# stream {slot}\nx = {slot}"), keep_going,
                           draft_max=0)
            while any(engine.slots[i].pending for i in range(count)):
                engine.step()
            before = engine.totals.filler_rows
            steps = 2 * PAD_PROBE_EVERY
            for _ in range(steps):
                engine.step()
                assert llama_cpp.llama_memory_seq_pos_max(engine.memory, 7) == len(cached) - 1
            padded = engine.totals.filler_rows - before
            assert padded == (steps - 2 if count == 7 else 0), (count, padded)
            for slot in range(count):
                engine.release(slot)
        assert engine.slots[7].cached == cached
    finally:
        engine.close()


def test_with_filler_rows_a_new_sequence_keeps_the_cached_slots(model_path):
    """Where free slots' filler rows join runs of busy slots (measured costs), a gap
    costs a row, not a pass over the weights: a new prompt takes the slot with the least
    cached, not the one beside the busy slots that holds another prompt (under load a
    repeated prompt found its cache 4 times in 39). Without costs, beside comes first."""
    from workers.engine.llama import LlamaEngine
    from workers.engine.stepcosts import SHAPES_EXTRA, StepCosts
    gpu = StepCosts((1, 2, 6), {(s, d): 10.0 + 0.05 * s + 0.02 * d for s in (1, 2, 6)
                                for d in SHAPES_EXTRA} |
                    {(s, 0): 10.0 + 0.05 * s for s in range(1, 7)})
    engine = LlamaEngine(model_path, 1024, 6, THREADS, 0, draft_max=16, step_costs=gpu)
    try:
        prompt = engine.tokenize("def handler(event):\n    return event\n")
        for slot in (1, 2):
            engine.add(slot, engine.tokenize(f"# busy {slot}"), GREEDY)
        engine.slots[3].cached = engine.tokenize("an idle editor's file " * 8)
        assert engine.best_slot(prompt, [3, 4, 5]) in (4, 5)      # not the cached one
        engine.slots[5].cached = list(prompt)
        assert engine.best_slot(prompt, [0, 3, 4, 5]) == 5        # its own cache
    finally:
        for slot in range(6):
            engine.release(slot, keep_cache=False)
        engine.close()


def test_on_the_cpus_costs_a_new_sequence_still_joins_the_busy_run(model_path):
    """On the CPU's measured costs a filler in a gap seldom pays (four rows 37 ms, three
    and a lone one 48): beside 0-2 busy, slot 3 is taken though it holds another prompt,
    rather than an empty slot whose gap no filler closes."""
    from workers.engine.llama import LlamaEngine
    from workers.engine.stepcosts import StepCosts
    engine = LlamaEngine(model_path, 1024, 8, THREADS, 0, draft_max=16,
                         step_costs=StepCosts.assumed())
    try:
        prompt = engine.tokenize("def handler(event):\n    return event\n")
        for slot in (0, 1, 2):
            engine.add(slot, engine.tokenize(f"# busy {slot}"), GREEDY)
        engine.slots[3].cached = engine.tokenize("an idle editor's file " * 8)
        assert engine.best_slot(prompt, [3, 4, 5, 6, 7]) == 3
    finally:
        for slot in range(8):
            engine.release(slot, keep_cache=False)
        engine.close()
