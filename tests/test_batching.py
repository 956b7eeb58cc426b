"""batching.ContinuousBatch: requests that join a running batch at token boundaries get the tokens they get alone,
for greedy and seeded sampling, with and without offload and the MTP predictor's shadow rows; sampling.RowSampler
draws what DeviceSampler draws for the same request."""

from __future__ import annotations

import pytest
import torch

from conftest import full_only, serve_in_turn
from moeprefetch import MoEPrefetchEngine
from moeprefetch.batching import ContinuousBatch, step_rows
from moeprefetch.errors import RequestError
from moeprefetch.residency.state import C
from moeprefetch.sampling import DeviceSampler, RowSampler, SamplingParams, row_paths


def test_row_sampler_draws_what_each_request_draws_alone():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=generator) * 3
    params = [SamplingParams(), SamplingParams(temperature=0.7, seed=5), SamplingParams(temperature=1.3, top_k=20,
                                                                                       seed=9),
              SamplingParams(temperature=0.9, top_p=0.6, top_k=50, seed=-3)]
    rows = RowSampler(300, torch.device("cpu"), 4)
    for row, p in enumerate(params):
        rows.set_row(row, p)
    positions = torch.tensor([5, 17, 40, 2])
    got = rows(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5), torch.arange(4), positions)
    for row, p in enumerate(params):
        alone = DeviceSampler(300, torch.device("cpu"))
        alone.set_params(p)
        expected = alone(logits[row : row + 1], p, torch.zeros(1, dtype=torch.long), positions[row : row + 1])
        assert int(got[row]) == int(expected[0]), (row, p)


@pytest.mark.parametrize("policy", ["lru", "lfu", "lrfu"])
def test_a_batch_that_goes_idle_leaves_a_settled_table(checkpoint_factory, policy):
    """When the last row leaves, admissions and fills still pending are settled as at a call's end (a batch never
    ends a call: before the fix, LFU and LRFU left the last step's admission pending here)."""
    path = checkpoint_factory("v3")
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=128, max_batch_size=2,
                                               expert_cache_slots=6, policy=policy)
    requests = [([3, 4, 5, 6], 9, SamplingParams()), ([7, 8], 12, SamplingParams(temperature=0.8, seed=11)),
                ([9, 10, 11], 7, SamplingParams(temperature=1.1, top_k=5, seed=4))]
    for predictor in ("none", "mtp+next_layer_gate"):
        batch = ContinuousBatch(engine, predictor)
        serve_in_turn(batch, requests, range(len(requests)))
        assert not engine.residency.problems(), (policy, predictor)
        counters = batch.counters()
        issued, wasted = (int(counters[:, C[name]].sum()) for name in ("prefetch_issued", "prefetch_wasted"))
        assert wasted <= issued and (predictor != "none" or issued == 0)


@pytest.mark.parametrize("variant,slots,predictor,lookahead", [
    ("v3", None, "none", 1), ("v3", 6, "none", 1), ("v3", 6, "mtp+next_layer_gate", 1), ("v3", 6, "mtp", 3),
    ("qwen3", 5, "next_layer_gate", 1), ("glm4", 6, "mtp+next_layer_gate", 2)])
def test_requests_joining_a_running_batch_get_their_tokens_alone(checkpoint_factory, variant, slots, predictor,
                                                                 lookahead):
    path = checkpoint_factory(variant)
    kwargs = dict(progress=False, max_seq_len=128, expert_cache_slots=slots, lookahead=lookahead)
    alone = MoEPrefetchEngine.from_pretrained(path, max_batch_size=1, **kwargs)
    requests = [([3, 4, 5, 6], 9, SamplingParams()), ([7, 8], 12, SamplingParams(temperature=0.8, seed=11)),
                ([9, 10, 11], 7, SamplingParams(temperature=1.1, top_k=5, seed=4)),
                ([12], 10, SamplingParams(temperature=0.9, top_p=0.7, seed=2))]
    expected = [alone.generate([p], max_new_tokens=n, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                               seed=s.seed, stop_at_eos=False, predictor=predictor).sequences[0]
                for p, n, s in requests]
    engine = MoEPrefetchEngine.from_pretrained(path, max_batch_size=2, **kwargs)
    batch = ContinuousBatch(engine, predictor)
    got = serve_in_turn(batch, requests, range(len(requests)))  # each joins at a token boundary
    assert [got[i] for i in range(len(requests))] == expected
    assert batch.steps > 0 and not engine.residency.problems()


@pytest.mark.parametrize("variant,slots,predictor", [("v3", 6, "mtp+next_layer_gate"),
                                                     full_only("qwen3", 5, "next_layer_gate"), full_only("v3", None, "none")])
def test_requests_admitted_together_get_their_tokens_alone(checkpoint_factory, variant, slots, predictor):
    """`admit_together`: three requests prefilled at once into free rows, their prompts sharing windows (one prompt
    across two), then decoded with a fourth admitted after them: each gets the tokens it gets alone (seeded sampling
    too, the MTP layer's first drafts included); a request that does not fit is refused before any row is taken."""
    path = checkpoint_factory(variant)
    kwargs = dict(progress=False, max_seq_len=128, expert_cache_slots=slots, prefill_chunk=4, prefill_window=8)
    alone = MoEPrefetchEngine.from_pretrained(path, max_batch_size=1, **kwargs)
    requests = [([3, 4, 5, 6, 7, 8, 9], 6, SamplingParams()), ([7, 8], 9, SamplingParams(temperature=0.8, seed=11)),
                (list(range(9, 19)), 5, SamplingParams(temperature=1.1, top_k=5, seed=4)), ([12, 13], 4, SamplingParams())]
    expected = [alone.generate([p], max_new_tokens=n, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                               seed=s.seed, stop_at_eos=False, predictor=predictor).sequences[0]
                for p, n, s in requests]
    engine = MoEPrefetchEngine.from_pretrained(path, max_batch_size=4, **kwargs)
    batch = ContinuousBatch(engine, predictor)
    with pytest.raises(RequestError, match="more than max_seq_len=128"):
        batch.admit_together([requests[0][:2] + (SamplingParams(), frozenset()), (list(range(200)), 4,
                                                                                 SamplingParams(), frozenset())])
    assert batch.free_rows == [0, 1, 2, 3]
    started = batch.admit_together([r + (frozenset(),) for r in requests[:3]])
    assert [row for row, _ in started] == [0, 1, 2]
    assert [first for _, first in started] == [e[0] for e in expected[:3]]
    fourth, _ = batch.admit(*requests[3])
    rows, got = (0, 1, 2, fourth), {}
    while len(got) < len(rows):
        batch.step()
        for row in rows:
            if row not in got and batch.finished(row):
                got[row] = batch.state[row].generated
                batch.release(row)
    assert [got[row] for row in rows] == expected
    assert not engine.residency.problems()


@pytest.mark.parametrize("variant,predictor", [  # the fast lane keeps the MTP pass; the full suite every family
    ("v3", "mtp"), pytest.param("v3", "none", marks=pytest.mark.slow),
    pytest.param("qwen3", "next_layer_gate", marks=pytest.mark.slow),
    pytest.param("glm4", "mtp+next_layer_gate", marks=pytest.mark.slow)])
def test_a_prefill_run_a_window_between_steps_keeps_every_requests_tokens(checkpoint_factory, variant, predictor):
    """Chunked prefill: a long prompt admitted one window (one chunk of 4 tokens) between the running rows' steps,
    into a row below a running one (so every step computes it, masked, at the position its prefill has reached),
    and the MTP layer's windows after it: every request gets its tokens alone; a request dropped mid-prefill frees
    its row for the next."""
    path = checkpoint_factory(variant)
    kwargs = dict(progress=False, max_seq_len=128, expert_cache_slots=6, prefill_chunk=4, prefill_window=16)
    alone = MoEPrefetchEngine.from_pretrained(path, max_batch_size=1, **kwargs)
    requests = [([3, 4, 5, 6], 6, SamplingParams()), ([7, 8], 24, SamplingParams(temperature=0.8, seed=11)),
                (list(range(9, 22)), 8, SamplingParams(temperature=1.1, top_k=5, seed=4)),
                (list(range(30, 40)), 5, SamplingParams())]
    expected = [alone.generate([p], max_new_tokens=n, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                               seed=s.seed, stop_at_eos=False, predictor=predictor).sequences[0]
                for p, n, s in requests]
    engine = MoEPrefetchEngine.from_pretrained(path, max_batch_size=2, **kwargs)
    batch = ContinuousBatch(engine, predictor)
    first, _ = batch.admit(*requests[0])
    second, _ = batch.admit(*requests[1])
    while not batch.finished(first):
        batch.step()
    batch.release(first)
    # a request that leaves during its prefill frees its row, and the row serves the next one
    dropped = batch.begin(*requests[3], per_window=4)
    assert batch.advance(dropped) == (4, None) and batch.free_rows == []
    batch.step()
    batch.release(dropped)
    assert batch.free_rows == [first] and not batch.admissions
    row = batch.begin(*requests[2], per_window=4)
    assert (row, second) == (0, 1)
    ran, windows, token = [], 0, None
    while token is None:
        tokens, token = batch.advance(row)
        ran.append(tokens)
        windows += 1
        if token is None:  # the running row 1 makes the step compute row 0, masked
            assert batch.step() and batch.state[row] is None
    assert batch.uses_mtp == ("mtp" in predictor)
    passes = 2 if batch.uses_mtp else 1  # the MTP layer's pass after the main layers
    assert ran == [4, 4, 4, 1] * passes and windows == 4 * passes
    while not batch.finished(row):
        batch.step()
    assert batch.state[row].generated == expected[2]
    while not batch.finished(second):
        batch.step()
    assert batch.state[second].generated == expected[1]
    batch.release(row)
    batch.release(second)
    assert not engine.residency.problems()


def test_step_rows_rounds_the_highest_active_row_up_to_a_power_of_two():
    got = {top: step_rows(top, 16) for top in (1, 2, 3, 4, 5, 8, 9, 15, 16)}
    assert got == {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 15: 16, 16: 16}
    assert [step_rows(top, 6) for top in range(1, 7)] == [1, 2, 4, 4, 6, 6]  # never more than the batch holds
    assert {step_rows(top, 16, batch_invariant=True) for top in (1, 5, 16)} == {16}


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_step_computes_only_the_rows_in_use_and_keeps_the_tokens(checkpoint_factory, batch_invariant):
    """A batch of 4 rows whose requests end at different steps runs 4-, 2- and 1-row steps (row 0 outlives the
    others, and the request joining late takes the lowest free row); every request still gets its tokens alone.
    `batch_invariant` keeps every step at 4 rows."""
    path = checkpoint_factory("v3")
    kwargs = dict(progress=False, max_seq_len=128, expert_cache_slots=6)
    requests = [([3, 4, 5, 6], 20, SamplingParams()), ([7, 8], 10, SamplingParams(temperature=0.8, seed=11)),
                ([9, 10, 11], 3, SamplingParams(temperature=1.1, top_k=5, seed=4)),
                ([12], 4, SamplingParams(temperature=0.9, top_p=0.7, seed=2)), ([13, 14], 2, SamplingParams())]
    alone = MoEPrefetchEngine.from_pretrained(path, max_batch_size=1, **kwargs)
    expected = [alone.generate([p], max_new_tokens=n, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                               seed=s.seed, stop_at_eos=False, predictor="next_layer_gate").sequences[0]
                for p, n, s in requests]
    engine = MoEPrefetchEngine.from_pretrained(path, max_batch_size=4, **kwargs)
    batch = ContinuousBatch(engine, "next_layer_gate", batch_invariant=batch_invariant)
    got = serve_in_turn(batch, requests, range(len(requests)))
    assert [got[i] for i in range(len(requests))] == expected
    assert batch.step_sizes == ([4] if batch_invariant else [1, 2, 4])
    # a step samples, filters or only takes the argmax as its rows need: the last row left alone is greedy
    assert {kind[1] for kind in batch.step_kinds} >= {"greedy", "filtered"}
    assert not engine.residency.problems()


def test_a_batch_refuses_what_does_not_fit_and_stays_usable(checkpoint_factory):
    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False, max_seq_len=32,
                                               max_batch_size=1)
    batch = ContinuousBatch(engine)
    with pytest.raises(RequestError, match="more than max_seq_len=32"):
        batch.admit(list(range(3, 30)), 10, SamplingParams())
    with pytest.raises(RequestError):
        batch.admit([3, 10**6], 4, SamplingParams())
    row, _ = batch.admit([3, 4], 4, SamplingParams())
    with pytest.raises(RequestError, match="no free row"):
        batch.admit([5, 6], 4, SamplingParams())
    batch.release(row)
    with pytest.raises(RequestError, match="oracle"):
        ContinuousBatch(engine, "oracle")


def test_row_sampler_matches_device_sampler_on_random_parameters():
    """Property check over random parameter mixes: every row of a mixed batch draws the request's own token."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    params = st.builds(SamplingParams, temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
                       top_k=st.sampled_from([0, 1, 5, 64]), top_p=st.sampled_from([1.0, 0.9, 0.4]),
                       seed=st.integers(min_value=-2**40, max_value=2**40))

    @hypothesis.settings(max_examples=40, deadline=None)
    @hypothesis.given(st.lists(params, min_size=1, max_size=5), st.integers(0, 1000))
    def check(rows, seed):
        generator = torch.Generator().manual_seed(seed)
        logits = torch.randn(len(rows), 64, generator=generator) * 2
        positions = torch.randint(0, 500, (len(rows),), generator=generator)
        sampler = RowSampler(64, torch.device("cpu"), len(rows))
        for row, p in enumerate(rows):
            sampler.set_row(row, p)
        got = sampler(logits, row_paths(rows, 64), torch.arange(len(rows)), positions)  # the paths a step takes
        for row, p in enumerate(rows):
            alone = DeviceSampler(64, torch.device("cpu"))
            alone.set_params(p)
            expected = alone(logits[row : row + 1], p, torch.zeros(1, dtype=torch.long), positions[row : row + 1])
            assert int(got[row]) == int(expected[0])

    check()


@pytest.mark.parametrize("defer", [True, False])
def test_a_joining_prefill_keeps_the_running_rows_pending_fill(checkpoint_factory, monkeypatch, defer):
    """A fill reserved for the running rows' next step, still in flight (the link is slow: here the fill launch does
    nothing), survives a joining request's prefill of several table steps (2 windows and the MTP layer's 2): it is
    deferred by those steps and not released as wasted. Without the deferral it is (the test's control)."""
    from moeprefetch.residency.fill import Filler
    from moeprefetch.residency import Residency
    from moeprefetch.residency.state import C, E_ACTIVE, E_FREE, FILLING

    monkeypatch.setattr(Filler, "__call__", lambda self, position: None)
    if not defer:
        monkeypatch.setattr(Residency, "defer_pending", lambda self, steps: None)
    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False, max_seq_len=128,
                                               expert_cache_slots=12, max_batch_size=2, prefill_chunk=4,
                                               prefill_window=4)
    batch = ContinuousBatch(engine, "mtp")
    batch.admit([3, 4, 5, 6, 7, 8, 9, 10], 20, SamplingParams())
    batch.step()
    res = engine.residency
    st, positions, n = res.st, res.cfg.positions, res.n_experts
    step = int(st.step)
    j = int(torch.nonzero(st.e_state == E_FREE)[0])
    key = next(n + e for e in range(n) if int(st.slot_of[n + e]) < 0 and int(st.inflight_of[n + e]) < 0)
    slot = next(v for v in range(res.n_slots) if int(st.key_of[v]) // n != 1)  # its expert (not layer 1's) leaves
    if int(st.key_of[slot]) >= 0:
        st.slot_of[int(st.key_of[slot])] = -1
    deadline = 2 * ((step + 1) * positions + 1)  # what a reservation in this step for layer 1 of the next writes
    st.e_state[j], st.e_key[j], st.e_slot[j], st.e_deadline[j], st.e_made[j] = E_ACTIVE, key, slot, deadline, 0
    st.e_next[j] = st.e_done[j] = st.e_ready[j] = 0
    st.slot_state[slot], st.key_of[slot], st.inflight_of[key], st.protect[slot] = FILLING, key, j, deadline
    wasted = int(st.counters[:, C["prefetch_wasted"]].sum())
    batch.admit([11, 12, 13, 14, 15, 16, 17], 20, SamplingParams())  # 2 windows + 2 MTP windows
    if defer:
        assert int(st.e_state[j]) == E_ACTIVE and int(st.e_deadline[j]) == deadline + 4 * res.cfg.steps_clock
        assert int(st.counters[:, C["prefetch_wasted"]].sum()) == wasted
    else:
        assert int(st.e_state[j]) == E_FREE and int(st.counters[:, C["prefetch_wasted"]].sum()) == wasted + 1


def test_bias_penalties_and_logprobs_in_a_running_batch_are_each_requests_own(checkpoint_factory):
    """Rows with and without logit bias, penalties and log-probabilities share steps (each step's shape turns the
    adjustments and log-probabilities on while any row asks): every request gets its tokens and log-probabilities
    alone, and a row that reuses a biased row's place is not biased."""
    path = checkpoint_factory("v3")
    kwargs = dict(progress=False, max_seq_len=128, expert_cache_slots=6)
    requests = [([3, 4, 5, 6], 9, SamplingParams(logit_bias=((4, 2.5), (6, -100.0)), presence_penalty=0.9,
                                                 logprobs=2)),
                ([7, 8], 12, SamplingParams(temperature=0.8, seed=11, frequency_penalty=1.1)),
                ([9, 10, 11], 7, SamplingParams(temperature=1.1, top_k=5, seed=4, logprobs=0)),
                ([12], 10, SamplingParams())]
    alone = MoEPrefetchEngine.from_pretrained(path, max_batch_size=1, **kwargs)
    expected = [alone.generate([p], max_new_tokens=n, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                               seed=s.seed, stop_at_eos=False, logit_bias=dict(s.logit_bias),
                               presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                               logprobs=s.logprobs) for p, n, s in requests]
    batch = ContinuousBatch(MoEPrefetchEngine.from_pretrained(path, max_batch_size=2, **kwargs), "next_layer_gate")
    waiting, rows, tokens, logprobs = list(range(len(requests))), {}, {}, {}
    while waiting or rows:
        while waiting and batch.free_rows:
            i = waiting.pop(0)
            row, first = batch.admit(*requests[i])
            rows[row], tokens[i], logprobs[i] = i, [first], [batch.logprobs.get(row)]
        for row in [r for r in rows if batch.finished(r)]:
            rows.pop(row)
            batch.release(row)
        if rows:
            for row, token in batch.step().items():
                tokens[rows[row]].append(token)
                logprobs[rows[row]].append(batch.logprobs.get(row))
    for i, result in enumerate(expected):
        assert tokens[i] == result.sequences[0], i
        want = result.logprobs[0] if result.logprobs is not None else [None] * len(tokens[i])
        assert len(logprobs[i]) == len(want)
        for got, ref in zip(logprobs[i], want):
            assert (got is None) == (ref is None)
            if ref is not None:
                assert got.token == ref.token and len(got.top) == len(ref.top) == requests[i][2].logprobs
                assert abs(got.logprob - ref.logprob) < 1e-5
    assert 6 not in tokens[0]
    assert {kind[2:] for kind in batch.step_kinds} >= {(True, True), (False, False)}


def test_a_step_without_a_path_draws_what_a_step_with_every_path_draws():
    """`row_paths`: a step's shape turns sampling, top-k and top-p off when no row takes them; every row's token is
    the one the step with every path on draws (the skipped work changes no row)."""
    generator = torch.Generator().manual_seed(4)
    mixes = [[SamplingParams(), SamplingParams(seed=3)],
             [SamplingParams(temperature=0.7, seed=5), SamplingParams()],
             [SamplingParams(temperature=1.2, top_k=7, seed=1), SamplingParams(temperature=0.5, seed=2)],
             [SamplingParams(temperature=0.9, top_p=0.6, seed=8), SamplingParams(temperature=1.0, seed=9)]]
    every = SamplingParams(temperature=1.0, top_k=1, top_p=0.5)
    for mix in mixes:
        sampler = RowSampler(100, torch.device("cpu"), len(mix))
        for row, p in enumerate(mix):
            sampler.set_row(row, p)
        paths = row_paths(mix, 100)
        for position in range(20):
            logits = torch.randn(len(mix), 100, generator=generator) * 2
            positions = torch.full((len(mix),), position)
            rows = torch.arange(len(mix))
            assert torch.equal(sampler(logits, paths, rows, positions), sampler(logits, every, rows, positions))
    assert row_paths(mixes[0], 100).greedy and not row_paths(mixes[1], 100).greedy
    assert row_paths(mixes[2], 100).top_k and row_paths(mixes[2], 100).top_p == 1.0
    assert row_paths(mixes[3], 100).top_p < 1.0 and not row_paths(mixes[3], 100).top_k
