"""The on-device sampler against numpy references (penalties, filters, logprobs, seeds)."""

import os
from functools import partial

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.sample import sampler
from jaxllm.sample.metadata import MAX_MIN_TOKENS_STOP_IDS, build_sampling_metadata
from jaxllm.sample.penalties import apply_penalties, init_penalty_state, record_tokens
from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams

V = 64  # vocab
MAX_SEQS = 8
GARBAGE = MAX_SEQS

sample_jit = jax.jit(sampler.sample)
record_jit = jax.jit(record_tokens)


def logits_of(seed, rows, scale=3.0):
    return np.random.default_rng(seed).normal(0, scale, (rows, V)).astype(np.float32)


def run(params, logits, output_indices=None, seeds=None, state=None, seq_rows=None):
    """Samples one step; rows past len(params) are padding."""
    S = logits.shape[0]
    n = len(params)
    output_indices = [0] * n if output_indices is None else output_indices
    seeds = list(range(n)) if seeds is None else seeds
    md = build_sampling_metadata(params, output_indices, seeds, S)
    state = init_penalty_state(MAX_SEQS, V) if state is None else state
    seq_rows = np.full(S, GARBAGE, np.int32) if seq_rows is None else seq_rows
    return sample_jit(jnp.asarray(logits), md, state, jnp.asarray(seq_rows))


# -- numpy references -----------------------------------------------------------------------------

def np_softmax(x):
    x = x.astype(np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_penalties(logits, prompt_mask, counts, presence, frequency, repetition):
    seen = prompt_mask | (counts > 0)
    pen = np.where(seen, repetition[:, None], np.float32(1)).astype(np.float32)
    out = np.where(logits > 0, logits / pen, logits * pen)
    out = out - frequency[:, None] * counts.astype(np.float32)
    return out - presence[:, None] * (counts > 0).astype(np.float32)


def np_allowed(row, temperature, top_k, top_p, min_p):
    """vLLM V1 semantics in float64: min-p, then top-k, then top-p on the renormalised rest."""
    x = row.astype(np.float64) / temperature
    probs = np_softmax(x)
    x = np.where(probs >= min_p * probs.max(), x, -np.inf)
    if top_k:
        x = np.where(x >= np.sort(x)[::-1][top_k - 1], x, -np.inf)
    if top_p < 1:
        order = np.argsort(-x)
        p = np_softmax(x)[order]
        mass_before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
        x = np.where(x >= x[order][(mass_before < top_p).sum() - 1], x, -np.inf)
    return set(np.flatnonzero(np.isfinite(x)).tolist())


def random_penalty_state(rng):
    """A state filled through record_tokens from random token streams, with the numpy truth."""
    state = init_penalty_state(MAX_SEQS, V)
    counts = np.zeros((MAX_SEQS + 1, V), np.int32)
    prompt = np.zeros((MAX_SEQS + 1, V), bool)
    for _ in range(4):
        T = 32
        toks = rng.integers(0, V, T)
        rows = rng.integers(0, MAX_SEQS + 1, T)
        is_out = rng.random(T) < 0.5
        state = record_jit(state, toks, rows, is_out, np.full(4, GARBAGE, np.int32))
        np.add.at(counts, (rows[is_out], toks[is_out]), 1)
        prompt[rows[~is_out], toks[~is_out]] = True
    return state, counts, prompt


# -- penalties ------------------------------------------------------------------------------------

def test_record_tokens_counts_exact_with_resets():
    rng = np.random.default_rng(0)
    state, counts, prompt = random_penalty_state(rng)
    reset = np.array([2, GARBAGE, 5, GARBAGE], np.int32)
    toks, rows = rng.integers(0, V, 16), rng.integers(0, MAX_SEQS, 16)
    is_out = rng.random(16) < 0.5
    state = record_jit(state, toks, rows, is_out, reset)
    counts[[2, 5]], prompt[[2, 5]] = 0, False
    np.add.at(counts, (rows[is_out], toks[is_out]), 1)
    prompt[rows[~is_out], toks[~is_out]] = True
    assert counts[:MAX_SEQS].sum() > 0 and prompt[:MAX_SEQS].sum() > 0
    # The garbage row (last) holds padding writes and is not compared.
    np.testing.assert_array_equal(np.asarray(state.output_counts)[:MAX_SEQS], counts[:MAX_SEQS])
    np.testing.assert_array_equal(np.asarray(state.prompt_mask)[:MAX_SEQS], prompt[:MAX_SEQS])


def test_penalties_equal_numpy_reference():
    rng = np.random.default_rng(1)
    state, counts, prompt = random_penalty_state(rng)
    S = 6
    seq_rows = rng.permutation(MAX_SEQS)[:S].astype(np.int32)
    logits = logits_of(2, S)
    presence = rng.uniform(-2, 2, S).astype(np.float32)
    frequency = rng.uniform(-2, 2, S).astype(np.float32)
    repetition = rng.uniform(0.5, 2, S).astype(np.float32)
    got = jax.jit(apply_penalties)(logits, state, seq_rows, presence, frequency, repetition)
    want = np_penalties(logits, prompt[seq_rows], counts[seq_rows], presence, frequency,
                        repetition)
    assert not np.array_equal(want, logits)
    np.testing.assert_array_equal(np.asarray(got), want)

    # Through sample(): greedy rows pick the argmax of the penalised logits.
    params = [SamplingParams(temperature=0, presence_penalty=float(presence[i]),
                             frequency_penalty=float(frequency[i]),
                             repetition_penalty=float(repetition[i])) for i in range(S)]
    out = run(params, logits, state=state, seq_rows=seq_rows)
    np.testing.assert_array_equal(np.asarray(out.token_ids), want.argmax(-1))


# -- metadata builder -----------------------------------------------------------------------------

def test_builder_pads_greedy_rows_and_sets_flags():
    params = [SamplingParams(temperature=0.5, top_k=3, seed=2**40 + 5, logprobs=2), None,
              SamplingParams(temperature=0, top_p=0.5, repetition_penalty=1.1)]
    md = build_sampling_metadata(params, [4, 0, 1], [2**40 + 5, None, 9], 5)
    assert md.temperature.tolist() == [0.5, 0, 0, 0, 0]
    assert md.top_k.tolist() == [3, 0, 0, 0, 0] and md.top_k.dtype == np.int32
    assert md.top_p.tolist() == [1, 1, 0.5, 1, 1]
    assert md.repetition_penalty.tolist() == pytest.approx([1, 1, 1.1, 1, 1])
    assert md.seeds.tolist() == [5, 0, 9, 0, 0] and md.output_index.tolist() == [4, 0, 1, 0, 0]
    assert md.any_top_k_top_p and md.any_penalties and md.any_logprobs
    # top-k/top-p on a greedy row needs no sort.
    md = build_sampling_metadata([SamplingParams(temperature=0, top_k=3)], [0], [0], 2)
    assert not (md.any_top_k_top_p or md.any_penalties or md.any_logprobs)
    with pytest.raises(ValueError, match="exceed the padded batch of 1"):
        build_sampling_metadata([None, None], [0, 0], [0, 0], 1)


# -- greedy, min_tokens ---------------------------------------------------------------------------

def test_greedy_is_argmax_and_padding_rows_are_greedy():
    logits = logits_of(3, 8)
    out = run([SamplingParams(temperature=0)] * 5, logits)
    np.testing.assert_array_equal(np.asarray(out.token_ids), logits.argmax(-1))


def test_min_tokens_masks_stop_ids_until_reached():
    logits = logits_of(4, 4)
    eos = int(logits[0].argmax())
    stop = int(np.argsort(logits[0])[-2])
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop],
                       all_stop_token_ids={eos})
    out = run([p, p], logits[[0, 0]], output_indices=[2, 3])
    assert int(out.token_ids[0]) == int(np.argsort(logits[0])[-3])  # both stop ids banned
    assert int(out.token_ids[1]) == eos  # min_tokens reached: nothing banned
    too_many = SamplingParams(min_tokens=1, stop_token_ids=list(range(MAX_MIN_TOKENS_STOP_IDS + 1)))
    with pytest.raises(ValueError, match=str(MAX_MIN_TOKENS_STOP_IDS)):
        build_sampling_metadata([too_many], [0], [0], 2)


# -- filters never emit a disallowed token --------------------------------------------------------

FILTERS = [dict(top_k=3), dict(top_k=10, temperature=2.0), dict(top_p=0.5), dict(top_p=0.9),
           dict(min_p=0.1), dict(min_p=0.3, temperature=0.5), dict(top_k=8, top_p=0.6),
           dict(top_k=20, top_p=0.8, min_p=0.05), dict(top_p=0.05), dict(top_k=1)]


def chi_square(counts, probs):
    """Pearson's statistic; cells expected below 5 are pooled. Returns (statistic, cells)."""
    expected = probs * counts.sum()
    big = expected >= 5
    stat = ((counts[big] - expected[big]) ** 2 / expected[big]).sum()
    if expected[~big].sum() > 0:
        stat += (counts[~big].sum() - expected[~big].sum()) ** 2 / expected[~big].sum()
    return stat, big.sum() + 1


@pytest.mark.parametrize("kwargs", FILTERS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_filters_never_emit_disallowed_tokens(kwargs):
    """Each of 4 logits rows is drawn 512 times (one seed per batch row): every token is in the
    numpy allowed set, and the counts fit the allowed set's renormalised distribution."""
    params = SamplingParams(**{"temperature": 1.0, **kwargs})
    rows, draws = 4, 512
    logits = logits_of(hash(str(kwargs)) % 1000, rows, scale=2.0)
    out = run([params] * rows * draws, np.repeat(logits, draws, axis=0),
              seeds=list(range(rows * draws)))
    tokens = np.asarray(out.token_ids).reshape(rows, draws)
    for i in range(rows):
        allowed = np_allowed(logits[i], params.temperature, params.top_k, params.top_p,
                             params.min_p)
        assert set(tokens[i].tolist()) <= allowed, set(tokens[i].tolist()) - allowed
        mask = np.isin(np.arange(V), list(allowed))
        probs = np_softmax(np.where(mask, logits[i] / params.temperature, -np.inf))
        stat, cells = chi_square(np.bincount(tokens[i], minlength=V), probs)
        assert stat < 3 * cells + 10, (i, stat, cells)


def test_min_p_keeps_the_softmax_threshold_set():
    """apply_min_p's logit threshold keeps exactly the tokens whose float64 softmax probability
    is at least min_p times the row's top one (rows with masked -inf tokens, min_p 0 and 1),
    away from the boundary's rounding."""
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 4.0, (7, V)).astype(np.float32)
    logits[1, rng.choice(V, 20, replace=False)] = -np.inf
    min_p = np.array([0.0, 0.0, 0.05, 0.1, 0.3, 0.9, 1.0], np.float32)
    kept = np.isfinite(np.asarray(sampler.apply_min_p(jnp.asarray(logits), jnp.asarray(min_p))))
    probs = np_softmax(logits)
    ratio = probs / probs.max(-1, keepdims=True)
    clear = np.abs(np.log(ratio) - np.log(np.maximum(min_p, 1e-30))[:, None]) > 1e-4
    want = (ratio >= min_p[:, None]) & np.isfinite(logits)
    assert np.array_equal(kept[clear], want[clear])
    assert kept[0].sum() == V and kept[1].sum() == V - 20  # min_p 0 drops only -inf
    assert kept[6].sum() == 1 and kept[6, logits[6].argmax()]
    assert 1 < kept[3].sum() < V  # the threshold cuts inside the row


def test_top_k_keeps_ties_at_the_boundary_and_nothing_below():
    row = np.array([5.0, 4.0, 4.0, 4.0, 1.0] + [0.0] * (V - 5), np.float32)
    params = SamplingParams(top_k=2)
    out = run([params] * 64, np.tile(row, (64, 1)), seeds=list(range(64)))
    assert set(np.asarray(out.token_ids).tolist()) == {0, 1, 2, 3}


# -- seeds and distribution -----------------------------------------------------------------------

def test_seeded_request_reproduces_regardless_of_batch():
    rng = np.random.default_rng(5)
    target = SamplingParams(temperature=0.9, seed=1234)
    others = [SamplingParams(temperature=0), SamplingParams(top_k=3, repetition_penalty=1.5),
              SamplingParams(top_p=0.3, presence_penalty=1.0, logprobs=5),
              SamplingParams(temperature=1.7, min_p=0.2)]
    row = logits_of(6, 1, scale=1.0)[0]
    state, _, _ = random_penalty_state(rng)
    for step in range(6):
        alone = run([target], row[None].copy(), output_indices=[step], seeds=[1234])
        tokens = {int(alone.token_ids[0])}
        for position in (0, 2, 4):
            batch = others[:position] + [target] + others[position:]
            logits = logits_of(10 + step * 10 + position, 8)
            logits[position] = row
            seeds = [int(s) for s in rng.integers(0, 2**31, len(batch))]
            seeds[position] = 1234
            seq_rows = np.arange(8, dtype=np.int32)
            seq_rows[position] = GARBAGE  # the target's row holds no history
            out = run(batch, logits, output_indices=[step] * len(batch), seeds=seeds,
                      state=state, seq_rows=seq_rows)
            tokens.add(int(out.token_ids[position]))
        assert len(tokens) == 1, (step, tokens)
    draws = {int(run([target], row[None], output_indices=[i], seeds=[1234]).token_ids[0])
             for i in range(20)}
    assert len(draws) > 3  # the output index advances the key


def test_stage_modes_draw_the_same_tokens():
    """The runner's cond-free programs must give a batch what the cond program gives it:
    "plain" (no penalties, no top-k/top-p, no logprobs) for batches that need none, "all" for
    any batch. "plain" leaves penalties unapplied, as if no row had any."""
    rng = np.random.default_rng(9)
    state, _, _ = random_penalty_state(rng)
    modes = {m: jax.jit(partial(sampler.sample, stages=m)) for m in ("cond", "all", "plain")}
    greedy_mode = jax.jit(partial(sampler.sample, stages="greedy"))
    plain = [
        [SamplingParams(temperature=0)] * 3,  # all greedy
        [SamplingParams(temperature=0, min_tokens=4), SamplingParams(temperature=0)],
        [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=3),
         SamplingParams(temperature=1.3, min_p=0.1)],
        [SamplingParams(temperature=1.0, min_tokens=4)],
    ]
    penalised = [
        [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=3),
         SamplingParams(temperature=1.3, min_p=0.1, repetition_penalty=1.4),
         SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=2.0)],
    ]
    filtered = [
        [SamplingParams(temperature=0.9, top_k=5), SamplingParams(temperature=0, logprobs=3),
         SamplingParams(temperature=1.2, top_p=0.6, presence_penalty=1.5)],
        [SamplingParams(temperature=0.7, top_p=0.9, top_k=20, logprobs=2, min_p=0.05)],
    ]
    neutral = dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
    for i, params in enumerate(plain + penalised + filtered):
        params = [SamplingParams(**{**vars(p), "all_stop_token_ids": {5, 9}}) for p in params]
        logits = logits_of(40 + i, 8, scale=1.0)
        if i == 1:  # a stop id is the argmax: min_tokens must mask it
            logits[0, 5] = logits.max() + 1
        seq_rows = rng.permutation(MAX_SEQS)[:8].astype(np.int32)
        # each row has generated its argmax token: a penalty must move the greedy choice
        state = record_jit(state, logits.argmax(-1), seq_rows, np.ones(8, bool),
                           np.full(4, GARBAGE, np.int32))
        md = build_sampling_metadata(params, [1] * len(params), [11 + i] * len(params), 8)
        unpenalised = build_sampling_metadata([SamplingParams(**{**vars(p), **neutral})
                                               for p in params], [1] * len(params),
                                              [11 + i] * len(params), 8)
        assert bool(md.any_top_k_top_p or md.any_logprobs) == (i >= len(plain + penalised))
        for step in range(5):
            md.output_index[:len(params)] = unpenalised.output_index[:len(params)] = step
            out = {m: fn(jnp.asarray(logits), md, state, jnp.asarray(seq_rows))
                   for m, fn in modes.items()}
            np.testing.assert_array_equal(out["all"].token_ids, out["cond"].token_ids)
            for field in ("top_ids", "top_logprobs", "sampled_logprob", "sampled_rank"):
                if md.any_logprobs:
                    np.testing.assert_array_equal(getattr(out["all"].logprobs, field),
                                                  getattr(out["cond"].logprobs, field))
            if i >= len(plain + penalised):
                continue
            want = modes["cond"](jnp.asarray(logits), unpenalised, state, jnp.asarray(seq_rows))
            np.testing.assert_array_equal(out["plain"].token_ids, want.token_ids)
            assert sampler.all_greedy(md) == (i < 2)  # padding rows are greedy
            if sampler.all_greedy(md):  # the runner's GREEDY: the argmax alone
                got = greedy_mode(jnp.asarray(logits), md, state, jnp.asarray(seq_rows))
                np.testing.assert_array_equal(got.token_ids, want.token_ids)
                assert i != 1 or got.token_ids[0] != 5
            if i >= len(plain):  # a greedy row's penalties move its token, unless "plain"
                assert out["plain"].token_ids[3] != out["cond"].token_ids[3]


def test_temperature_sampling_matches_softmax():
    S = 4096
    row = np.random.default_rng(7).normal(0, 1.0, V).astype(np.float32)
    row[8:] -= 6.0  # most mass on 8 tokens, so the chi-square cells are well filled
    params = SamplingParams(temperature=0.7)
    out = run([params] * S, np.tile(row, (S, 1)), seeds=list(range(S)))
    stat, cells = chi_square(np.bincount(np.asarray(out.token_ids), minlength=V),
                             np_softmax(row / 0.7))
    assert stat < 3 * cells, stat  # loose: a wrong temperature scores in the 100s


# -- logprobs and compilation ---------------------------------------------------------------------

def test_logprobs_equal_numpy_log_softmax_of_raw_logits():
    logits = logits_of(8, 4)
    params = [SamplingParams(temperature=1.0, logprobs=5, repetition_penalty=1.8, seed=3),
              SamplingParams(temperature=0, logprobs=0)]
    state, _, _ = random_penalty_state(np.random.default_rng(9))
    out = run(params, logits, state=state, seq_rows=np.arange(4, dtype=np.int32))
    want = np.log(np_softmax(logits))
    order = np.argsort(-want, axis=-1)[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(np.asarray(out.logprobs.top_ids), order)
    np.testing.assert_allclose(np.asarray(out.logprobs.top_logprobs),
                               np.take_along_axis(want, order, -1), rtol=1e-5, atol=1e-5)
    tokens = np.asarray(out.token_ids)
    chosen = want[np.arange(4), tokens]
    np.testing.assert_allclose(np.asarray(out.logprobs.sampled_logprob), chosen, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.logprobs.sampled_rank),
                                  (want >= chosen[:, None]).sum(-1))
    no_logprobs = run([SamplingParams(temperature=0)], logits)
    assert not np.asarray(no_logprobs.logprobs.top_logprobs).any()


def test_no_recompilation_across_parameters():
    step = jax.jit(lambda *args: sampler.sample(*args))  # its own compilation cache
    state = init_penalty_state(MAX_SEQS, V)
    mixes = [[SamplingParams(temperature=0)],
             [SamplingParams(temperature=0.3, top_k=4, seed=1), SamplingParams(top_p=0.2)],
             [SamplingParams(repetition_penalty=1.2, logprobs=3, min_tokens=2,
                             all_stop_token_ids={1})] * 4]
    for params in mixes:
        md = build_sampling_metadata(params, [1] * len(params), [7] * len(params), 4)
        step(jnp.asarray(logits_of(11, 4)), md, state, jnp.full(4, GARBAGE, jnp.int32))
    assert step._cache_size() == 1
