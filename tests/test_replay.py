"""replay.py and `moeprefetch replay`: a trace through the residency's own plans, checked against plain references."""

from __future__ import annotations

import json

import pytest
import torch

from moeprefetch.analysis import ahead_misses, belady_bypass_misses
from moeprefetch.cli import main
from moeprefetch.errors import RequestError
from moeprefetch.replay import ReplaySetup, floors, replay
from moeprefetch.traces import DecodeTrace, write_trace


def skewed_trace(tokens: int, layers: int, experts: int, k: int, seed: int) -> DecodeTrace:
    """Routing with popular experts and some repetition from token to token, like real traces."""
    g = torch.Generator().manual_seed(seed)
    popularity = torch.rand(layers, experts, generator=g) ** 3 + 0.02
    rows, previous = [], None
    for _ in range(tokens):
        chosen = torch.stack([torch.multinomial(popularity[p], k, generator=g) for p in range(layers)])
        if previous is not None:
            keep = torch.rand(layers, generator=g) < 0.3
            chosen = torch.where(keep[:, None], previous, chosen)
        rows.append(chosen)
        previous = chosen
    return DecodeTrace(tuple(range(1, layers + 1)), torch.stack(rows), experts)


@pytest.mark.parametrize("seed,slots", [(0, 5), (1, 9), (2, 14)])
def test_the_residencys_lru_and_protection_equal_the_plain_references(seed, slots):
    """One expert per layer (no ties in recency): the residency's LRU replay misses exactly what plain LRU misses,
    and protection by a perfect predictor of K tokens exactly what LRU that never evicts those needs misses."""
    trace = skewed_trace(40, 4, 8, 1, seed)
    steps = trace.steps()
    assert replay(trace, ReplaySetup(slots=slots, policy="lru")).misses == ahead_misses(steps, slots, 0)
    for name, k in (("oracle_next", 1), ("ahead:2", 2), ("ahead:4", 4)):
        assert replay(trace, ReplaySetup(slots=slots, policy="lru", predictor=name)).misses == \
            ahead_misses(steps, slots, k), name


def test_replays_count_every_use_and_no_policy_beats_the_floor():
    trace = skewed_trace(30, 5, 12, 3, 3)
    uses = sum(len(s) for s in trace.steps())
    floor = belady_bypass_misses(trace.steps(), 16)
    bound = floors(trace, 16, aheads=(1,))
    assert bound.belady_bypass_misses == floor <= bound.belady_misses <= bound.lru_misses
    for policy in ("lru", "lfu", "lrfu"):
        for predictor in ("none", "previous", "oracle_next", "oracle"):
            r = replay(trace, ReplaySetup(slots=16, policy=policy, predictor=predictor))
            assert r.uses == uses and r.hits + r.misses == uses
            assert r.misses >= floor
            assert r.prefetch_issued == 0 and r.fill_bytes == 0  # protection only
            assert r.zero_copy_bytes == r.misses * r.setup.expert_bytes


def test_fills_turn_predicted_misses_into_prefetches_and_count_their_bytes():
    trace = skewed_trace(30, 5, 12, 3, 4)
    protect = replay(trace, ReplaySetup(slots=20, predictor="oracle_next", expert_bytes=1000))
    fetch = replay(trace, ReplaySetup(slots=20, predictor="oracle_next", fills=True, expert_bytes=1000))
    assert fetch.prefetch_issued > 0 and fetch.prefetch_useful > 0
    assert fetch.misses < protect.misses  # what was predicted arrives before it is needed
    assert fetch.fill_bytes == fetch.prefetch_issued * 1000  # every fill lands whole here
    assert fetch.zero_copy_bytes == fetch.misses * 1000
    assert fetch.prefetch_useful + fetch.prefetch_wasted <= fetch.prefetch_issued


def test_a_perfect_predictors_fills_spare_nothing():
    """Fills landing at once, a cache that holds two tokens' experts and perfect next-token fills that may evict
    anything unprotected: not one miss. Sparing the last steps' experts (asked for here, ignored for an oracle)
    would leave the fills without victims and the needs to demand reads."""
    layers, k = 5, 3
    trace = skewed_trace(40, layers, 12, k, 5)
    fetch = replay(trace, ReplaySetup(slots=2 * layers * k, predictor="oracle_next", fills=True, spare_recent=3))
    assert fetch.prefetch_issued > layers * k and fetch.misses == 0


def test_previous_spares_as_the_engine_would_under_every_policy():
    """`previous` guesses, so under LRU and LRFU its fills spare the last steps' experts (the counts change with
    spare_recent); LFU's queue is not in recency order, so the engine spares nothing there and neither does replay
    (the counts are the same whatever spare_recent says)."""
    trace = skewed_trace(80, 3, 32, 4, 6)

    def counts(policy: str, spare: int) -> tuple:
        result = replay(trace, ReplaySetup(slots=8, policy=policy, predictor="previous", fills=True,
                                           spare_recent=spare))
        return result.misses, result.prefetch_issued, result.fill_bytes

    assert counts("lfu", 0) == counts("lfu", 3)
    assert counts("lru", 0) != counts("lru", 3)


def test_bad_replay_settings_are_one_sentence():
    trace = skewed_trace(3, 2, 4, 1, 5)
    with pytest.raises(RequestError, match=r"from the trace's top-k \(2: a token's experts of one layer at once\)"):
        replay(skewed_trace(3, 2, 4, 2, 5), ReplaySetup(slots=1))  # the engine refuses fewer slots than top-k too
    for setup, message in ((ReplaySetup(slots=0), "slots must be an integer from the trace's top-k"),
                           (ReplaySetup(slots=4, policy="fifo"), "unknown cache policy"),
                           (ReplaySetup(slots=4, predictor="mtp"), "unknown replay predictor"),
                           (ReplaySetup(slots=4, predictor="ahead:0"), "K from 1 to 8"),
                           (ReplaySetup(slots=4, policy="static"), "a replay has none"),
                           (ReplaySetup(slots=4, policy="lrfu", halflife=0.0), "above 0 and at most 1e6"),
                           (ReplaySetup(slots=4, halflife=float("nan")), "above 0 and at most 1e6"),
                           (ReplaySetup(slots=4, halflife=-2.0), "above 0 and at most 1e6")):
        with pytest.raises(RequestError, match=message):
            replay(trace, setup)


def test_the_replay_command_prints_rows_and_bounds_and_refuses_bad_input(tmp_path, capsys):
    trace = skewed_trace(12, 3, 8, 2, 6)
    write_trace(tmp_path / "t.jsonl", trace.layers, trace.experts)
    out = tmp_path / "rows.json"
    assert main(["replay", str(tmp_path / "t.jsonl"), "--slots", "6", "--policy", "lru", "--predictor",
                 "none,oracle_next", "--json", str(out), "--ahead", "1"]) == 0
    printed = capsys.readouterr().out
    assert "lru / oracle_next" in printed and "Belady with bypass (floor)" in printed
    rows = json.loads(out.read_text())["rows"]
    lines = {r["row"]: r for r in rows}
    assert lines["lru / none"]["misses_per_token"] * 12 == replay(trace, ReplaySetup(slots=6, policy="lru")).misses
    assert lines["Belady with bypass (floor)"]["misses_per_token"] * 12 == belady_bypass_misses(trace.steps(), 6)
    assert main(["replay", str(tmp_path / "t.jsonl"), "--slots", "0"]) == 2
    assert main(["replay", str(tmp_path / "missing.jsonl"), "--slots", "3"]) == 2
    assert main(["replay", str(tmp_path / "t.jsonl"), "--slots", "3", "--predictor", "magic"]) == 2
    assert main(["replay", str(tmp_path / "t.jsonl"), "--slots", "3", "--ahead", "0"]) == 2
    assert main(["replay", str(tmp_path / "t.jsonl"), "--slots", "3", "--lrfu-halflife", "0"]) == 2
    for bad in (["--expert-mb", "nan"], ["--expert-mb", "inf"], ["--experts", "0"], ["--experts", "1000000"]):
        assert main(["replay", str(tmp_path / "t.jsonl"), "--slots", "3", *bad]) == 2, bad
    (tmp_path / "huge.jsonl").write_text("[[0, 99999999999]]\n")  # an id no layer has: not a table of that size
    assert main(["replay", str(tmp_path / "huge.jsonl"), "--slots", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 10 and "Traceback" not in err
    assert "--expert-mb must be a size in MB" in err and "the experts per layer must be from 1 to 65536" in err
