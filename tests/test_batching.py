"""batching.ContinuousBatch: requests that join a running batch at token boundaries get the tokens they get alone,
for greedy and seeded sampling, with and without offload and the MTP predictor's shadow rows; sampling.RowSampler
draws what DeviceSampler draws for the same request."""

from __future__ import annotations

import pytest
import torch

from conftest import serve_in_turn
from moeprefetch import MoEPrefetchEngine
from moeprefetch.batching import ContinuousBatch
from moeprefetch.errors import RequestError
from moeprefetch.sampling import DeviceSampler, RowSampler, SamplingParams


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


@pytest.mark.parametrize("variant,slots,predictor,lookahead", [
    ("v3", None, "none", 1), ("v3", 6, "none", 1), ("v3", 6, "mtp+next_layer_gate", 1), ("v3", 6, "mtp", 3),
    ("qwen3", 5, "next_layer_gate", 2), ("glm4", 6, "mtp+next_layer_gate", 2)])
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
        got = sampler(logits, SamplingParams(), torch.arange(len(rows)), positions)
        for row, p in enumerate(rows):
            alone = DeviceSampler(64, torch.device("cpu"))
            alone.set_params(p)
            expected = alone(logits[row : row + 1], p, torch.zeros(1, dtype=torch.long), positions[row : row + 1])
            assert int(got[row]) == int(expected[0])

    check()


def test_defer_pending_moves_only_future_needs():
    """A request's prefill joining a running batch adds table steps: fills in flight and protections for later needs
    move by those steps (so the next decode step does not release them as passed); past ones stay."""
    from moeprefetch.residency.state import E_ACTIVE, E_FREE, ResidencyConfig, TableState
    from moeprefetch.residency import Residency

    cfg = ResidencyConfig(positions=3, main_positions=2, n_experts=4, n_slots=4, record_bytes=64)
    res = Residency.__new__(Residency)  # the table alone: defer_pending touches nothing else
    res.cfg, res.st = cfg, TableState.allocate(cfg, 8, torch.device("cpu"))
    clock = cfg.steps_clock
    since = 5 * clock + clock - 1  # the end of step 5
    res.st.progress.fill_(7 * clock + 3)  # two prefill steps later
    res.st.e_state[:3] = torch.tensor([E_ACTIVE, E_ACTIVE, E_FREE])
    res.st.e_deadline[:3] = torch.tensor([6 * clock + 2, 4 * clock, 6 * clock + 4])
    res.st.protect[:3] = torch.tensor([6 * clock + 1, since - 3, -1])
    res.defer_pending(since)
    assert res.st.e_deadline[:3].tolist() == [8 * clock + 2, 4 * clock, 6 * clock + 4]
    assert res.st.protect[:3].tolist() == [8 * clock + 1, since - 3, -1]
