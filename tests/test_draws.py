"""The sampled draw made over the logits row (workers/engine/draws.py) against llama.cpp's
own samplers: the same tokens kept by top-p, min-p and top-k in any order with a
temperature, the same weights, and draws that follow them. llama.cpp's samplers work on a
candidate array without a model, so these run in-process on synthetic logits."""
import ctypes
import math

import llama_cpp
import numpy as np
import pytest

from workers.engine.draws import HostDraw, host_drawable
from workers.engine.samplers import Candidates
from workers.sampling import SamplingParams


def params(**given) -> SamplingParams:
    return SamplingParams.from_job({"seed": 7, **given})


def llama_kept(logits: np.ndarray, p: SamplingParams) -> dict[int, float]:
    """What llama.cpp's chain (without its draw) leaves of `logits`: token -> logit."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    for name in p.order:
        if name == "top_k" and p.top_k > 0:
            sampler = llama_cpp.llama_sampler_init_top_k(p.top_k)
        elif name == "top_p" and p.top_p < 1.0:
            sampler = llama_cpp.llama_sampler_init_top_p(p.top_p, 1)
        elif name == "min_p" and p.min_p > 0.0:
            sampler = llama_cpp.llama_sampler_init_min_p(p.min_p, 1)
        elif name == "temperature":
            sampler = llama_cpp.llama_sampler_init_temp(p.temperature)
        else:
            continue
        llama_cpp.llama_sampler_chain_add(chain, sampler)
    candidates = Candidates(llama_cpp, len(logits))
    array = candidates.whole(logits)
    llama_cpp.llama_sampler_apply(chain, array)
    got = array._obj
    kept = {int(got.data[i].id): float(got.data[i].logit) for i in range(got.size)}
    llama_cpp.llama_sampler_free(chain)
    return {t: v for t, v in kept.items() if v != -math.inf}


def rows(vocab: int):
    rng = np.random.default_rng(11)
    yield (rng.standard_normal(vocab) * 3).astype(np.float32)            # a broad spread
    peaked = (rng.standard_normal(vocab) * 2).astype(np.float32)
    peaked[rng.integers(vocab, size=5)] += 14                             # a few sure ones
    yield peaked
    yield (rng.gumbel(size=vocab) * 4).astype(np.float32)                 # a long tail
    flat = np.zeros(vocab, dtype=np.float32)
    flat[:3] = [9.0, 8.5, 8.5]                                            # ties
    yield flat


SETTINGS = [
    dict(temperature=0.8, top_p=0.95),
    dict(temperature=0.2, top_p=0.5),
    dict(temperature=1.5, top_p=0.9, min_p=0.05),
    dict(temperature=0.7, min_p=0.1),
    dict(temperature=1.0),
    dict(temperature=0.6, top_p=0.9, top_k=40, samplers=["top_p", "top_k", "temperature"]),
    dict(temperature=0.5, top_p=0.8, samplers=["temperature", "top_p"]),
]


@pytest.mark.parametrize("vocab", [64, 32000, 262144])
@pytest.mark.parametrize("given", SETTINGS)
def test_the_cuts_keep_what_llama_cpps_samplers_keep(given, vocab):
    p = params(**given)
    assert host_drawable(p)
    draw = HostDraw(p)
    for logits in rows(vocab):
        ids, scale = draw.kept(logits)
        theirs = llama_kept(logits, p)
        ours = {int(t) for t in ids}
        # The same cut: what one keeps and the other not is tokens tied at the cut's edge,
        # or tokens whose mass is within llama.cpp's float32 rounding (it sums thousands
        # of probabilities in float32; top-p's edge moves by tokens of ~1e-6 each)
        edge = min(float(logits[t]) for t in theirs)
        weights = np.exp((logits.astype(np.float64) - logits.max()) * scale)
        apart = [t for t in ours ^ set(theirs) if abs(float(logits[t]) - edge) > 1e-6]
        assert weights[apart].sum() < 1e-4 * weights[list(ours & set(theirs))].sum()
        for t in list(ours & set(theirs))[:50]:        # the temperature scale is theirs
            assert logits[t] * scale == pytest.approx(theirs[t], rel=1e-5, abs=1e-5)


def test_draws_follow_the_kept_weights_and_a_seed_repeats_them():
    logits = (np.random.default_rng(3).standard_normal(40)).astype(np.float32)
    p = params(temperature=1.2, top_p=0.98)
    ids, scale = HostDraw(p).kept(logits)
    weights = np.exp((logits[ids] - logits[ids].max()) * scale)
    expected = dict(zip(ids.tolist(), weights / weights.sum()))
    draw = HostDraw(p)
    n = 20000
    counts: dict[int, int] = {}
    for _ in range(n):
        token = draw.draw(logits)
        counts[token] = counts.get(token, 0) + 1
    assert set(counts) <= set(expected)
    chi2 = sum((counts.get(t, 0) - n * q) ** 2 / (n * q) for t, q in expected.items())
    df = len(expected) - 1          # chi-squared: p < 1e-5 at df + 6 sqrt(2 df); seeded, so
    assert len(expected) >= 20 and chi2 < df + 6 * math.sqrt(2 * df)   # never a flake
    first, second = HostDraw(p), HostDraw(p)
    assert [first.draw(logits) for _ in range(50)] == [second.draw(logits) for _ in range(50)]


def test_which_chains_are_drawn_here():
    assert host_drawable(params())                          # OpenAI's defaults
    assert host_drawable(params(temperature=0.2, top_p=0.95))
    assert host_drawable(params(top_p=0.9, top_k=40, samplers=["top_p", "top_k"]))
    assert not host_drawable(params(top_k=40, top_p=0.9))   # top-k first: llama.cpp's
    assert not host_drawable(params(temperature=0))         # greedy
    assert not host_drawable(params(presence_penalty=0.5))  # history-dependent
    assert not host_drawable(params(logit_bias={"5": 2.0}))
    assert not host_drawable(params(typical_p=0.9))
    assert not host_drawable(params(grammar='root ::= "a"'))
    assert not host_drawable(params(samplers=["top_p", "infill"], top_p=0.9))
    assert not host_drawable(params(mirostat=2))


def test_a_request_without_a_seed_draws_its_own_and_odd_chains_and_rows_hold():
    """No seed: each request its own random stream (llama.cpp's 'random' seed value is not
    a fixed numpy seed), so n choices differ; a temperature named twice applies twice, as
    llama.cpp's chain does; a NaN logit is a token never drawn, not a failure."""
    logits = np.zeros(5000, dtype=np.float32)             # flat: every draw a coin
    unseeded = SamplingParams.from_job({"temperature": 1.0})
    first = [HostDraw(unseeded).draw(logits) for _ in range(20)]
    second = [HostDraw(unseeded).draw(logits) for _ in range(20)]
    assert first != second
    twice = params(temperature=0.5, samplers=["temperature", "temperature"])
    assert HostDraw(twice).kept(logits)[1] == pytest.approx(4.0)
    odd = np.arange(10, dtype=np.float32)
    odd[3] = np.nan
    draw = HostDraw(params(temperature=0.7, top_p=0.9))
    assert all(draw.draw(odd) != 3 for _ in range(50))
