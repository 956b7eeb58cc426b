"""`speculative="auto"` and `draft_experts="auto"` (speculation.py): each mode measured on the engine's own calls,
then the faster one."""

from __future__ import annotations

import pytest

from moeprefetch import MoEPrefetchEngine
from moeprefetch.accounting import LayerCounters, Stats
from moeprefetch.batching import ContinuousBatch
from moeprefetch.errors import RequestError
from moeprefetch.speculation import (MIN_DECODE_TOKENS, REMEASURE_EVERY, AutoDraftExperts, AutoSpeculation,
                                     DraftDecision)

KEY = (1, "none", True)


def stats(decode_seconds: float, tokens: int, steps: int, proposed: int = 0, accepted: int = 0,
          offered: int | None = None) -> Stats:
    """A call's statistics; `offered` (rows that could check a draft) defaults to every draft checked."""
    return Stats(generated_tokens=tokens + 1, sequences=1, decode_steps=steps, decode_seconds=decode_seconds,
                 draft_offered=proposed if offered is None else offered, draft_proposed=proposed,
                 draft_accepted=accepted)


def measure_both(auto: AutoSpeculation, plain_ms: float, verify_ms: float, acceptance: float) -> None:
    """One plain and one speculative call of 100 tokens with these costs."""
    first = auto.choose(KEY)
    assert (first.mode, first.reason) == ("none", "measuring plain decode (no estimate yet)")
    assert auto.record(first, stats(plain_ms * 100 / 1000, 100, 100), warm=True)
    second = auto.choose(KEY)
    assert (second.mode, second.reason) == ("mtp", "measuring speculation (no estimate yet)")
    steps = round(100 / (1 + acceptance))
    proposed = steps
    assert auto.record(second, stats(verify_ms * steps / 1000, 100, steps, proposed, round(acceptance * proposed)),
                       warm=True)


@pytest.mark.parametrize("plain_ms,verify_ms,acceptance,expected", [
    (10.0, 12.0, 0.75, "mtp"),  # 12 / 1.75 = 6.9 ms a token
    (10.0, 19.0, 0.5, "none"),  # 19 / 1.5 = 12.7
    (3.44, 6.53, 0.0, "none"),  # V2-Lite's shape with a random MTP head (issue 39): a verify step for nothing
    (7.78, 10.0, 0.75, "mtp"),
])
def test_the_faster_mode_by_measured_step_cost_and_acceptance(plain_ms, verify_ms, acceptance, expected):
    auto = AutoSpeculation()
    measure_both(auto, plain_ms, verify_ms, acceptance)
    decision = auto.choose(KEY)
    assert decision.mode == expected
    assert decision.plain_ms_per_token == pytest.approx(plain_ms)
    steps = round(100 / (1 + acceptance))
    assert decision.acceptance == pytest.approx(round(acceptance * steps) / steps)
    assert decision.speculative_ms_per_token == pytest.approx(verify_ms / (1 + decision.acceptance))



def test_drafts_left_unchecked_count_as_steps_that_gained_nothing():
    """With verify_confidence, 100 verify steps checked 40 drafts and kept 30: a step gains 0.3 tokens, not the 0.75
    of the checked drafts alone, so speculation at 12 ms a step (9.2 ms a token) loses to plain decode at 8."""
    auto = AutoSpeculation()
    first = auto.choose(KEY)
    auto.record(first, stats(8.0 * 100 / 1000, 100, 100), warm=True)
    second = auto.choose(KEY)
    assert second.mode == "mtp"
    assert auto.record(second, stats(12.0 * 100 / 1000, 130, 100, proposed=40, accepted=30, offered=100), warm=True)
    decision = auto.choose(KEY)
    assert decision.acceptance == pytest.approx(0.3)
    assert decision.speculative_ms_per_token == pytest.approx(12.0 / 1.3)
    assert decision.mode == "none"

def test_each_chain_length_is_measured_then_the_cheapest_per_token_runs():
    """An engine loaded for chains of up to 3 drafts: plain decode, then 1, 2 and 3 drafts a step are each measured
    once; then the lowest ms per token runs (3 ms a step keeping 1.2 drafts: 1.36 ms a token), and re-measurements
    visit the least measured other mode."""
    auto = AutoSpeculation()
    costs = {1: (2.6, 0.7), 2: (3.0, 1.2), 3: (3.6, 1.4)}  # drafts a step: (ms a verify step, drafts kept a step)
    first = auto.choose(KEY, chains=3)
    assert (first.mode, first.draft_tokens) == ("none", None)
    assert auto.record(first, stats(2.0 * 100 / 1000, 100, 100), warm=True)
    for d in (1, 2, 3):
        decision = auto.choose(KEY, chains=3)
        assert (decision.mode, decision.draft_tokens) == ("mtp", d)
        assert decision.reason == f"measuring speculation with {d} draft{'s' if d > 1 else ''} a step (no estimate yet)"
        ms, kept = costs[d]
        steps = 100
        assert auto.record(decision, stats(ms * steps / 1000, round(steps * (1 + kept)), steps, proposed=steps,
                                           accepted=round(steps * kept)), warm=True)
    decision = auto.choose(KEY, chains=3)
    assert (decision.mode, decision.draft_tokens) == ("mtp", 2)
    assert decision.reason == "speculation with 2 drafts a step is faster here"
    assert decision.by_chain == pytest.approx({1: 2.6 / 1.7, 2: 3.0 / 2.2, 3: 3.6 / 2.4})
    assert decision.speculative_ms_per_token == pytest.approx(3.0 / 2.2)
    assert decision.as_dict()["draft_tokens"] == 2
    chosen = [auto.choose(KEY, chains=3) for _ in range(REMEASURE_EVERY - 1)]
    remeasured = [d for d in chosen if "re-measuring" in d.reason]
    assert len(remeasured) == 1 and remeasured[0].draft_tokens in (None, 1, 3)
    assert all(d.draft_tokens == 2 for d in chosen if d not in remeasured)


def test_the_other_mode_is_re_measured_and_an_estimate_that_changed_flips_the_choice():
    auto = AutoSpeculation()
    measure_both(auto, 10.0, 12.0, 0.75)
    modes = [auto.choose(KEY).mode for _ in range(REMEASURE_EVERY)]
    assert modes[:-1] == ["mtp"] * (REMEASURE_EVERY - 1) and modes[-1] == "none"  # the re-measurement
    # speculation got slow (another text: acceptance 0): two measurements pull its estimate past plain decode
    for _ in range(2):
        decision = auto.choose(KEY)
        assert decision.mode == "mtp"
        auto.record(decision, stats(12.0 * 100 / 1000, 100, 100, 100, 0), warm=True)
    assert auto.choose(KEY).mode == "none"


def test_calls_that_measure_nothing_leave_the_estimates_alone():
    auto = AutoSpeculation()
    first = auto.choose(KEY)
    assert not auto.record(first, stats(1.0, 100, 100), warm=False)  # it captured a graph: a one-off cost
    assert not auto.record(first, stats(1.0, MIN_DECODE_TOKENS - 1, MIN_DECODE_TOKENS - 1), warm=True)
    assert auto.choose(KEY).reason == "measuring plain decode (no estimate yet)"
    other = (4, "none", True)  # another batch size is another configuration
    measure_both(auto, 10.0, 12.0, 0.75)
    assert auto.choose(other).mode == "none" and auto.choose(KEY).mode == "mtp"
    unavailable = auto.choose(KEY, "no MTP layer in this checkpoint")
    assert (unavailable.mode, unavailable.measures) == ("none", False)
    assert not auto.record(unavailable, stats(1.0, 100, 100), warm=True)


def auto_calls(engine: MoEPrefetchEngine, calls: int) -> list:
    """`calls` speculative="auto" calls of one prompt, each checked against plain decode's tokens -> their results."""
    prompt = [[3, 4, 5, 6, 7]]
    expected = engine.generate(prompt, max_new_tokens=12, stop_at_eos=False).sequences
    results = []
    for _ in range(calls):
        result = engine.generate(prompt, max_new_tokens=12, stop_at_eos=False, speculative="auto")
        assert result.sequences == expected
        stats_ = result.stats.to_dict()
        assert stats_["speculative"] == (stats_["speculative_auto"]["mode"] == "mtp")
        results.append(result)
    return results


def test_auto_keeps_the_tokens_and_reports_each_calls_decision(checkpoint_factory):
    path = checkpoint_factory("v3_groups_qlora_yarn")
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=7)
    reports = [r.stats.to_dict()["speculative_auto"] for r in auto_calls(engine, 6)]
    modes = [r["mode"] for r in reports]
    # plain decode's step exists (the call above built it): measured at once; speculation's first call builds its
    # step, which is no measurement, so it runs again
    assert modes[:3] == ["none", "mtp", "mtp"]
    assert [r["measured"] for r in reports[:3]] == [True, False, True]
    for report in reports[3:]:
        assert report["plain_ms_per_token"] > 0 and report["speculative_ms_per_token"] > 0
        faster = "mtp" if report["speculative_ms_per_token"] < report["plain_ms_per_token"] else "none"
        assert report["mode"] == faster and report["measured"]
    engine.close()


def test_auto_chooses_among_chain_lengths_and_keeps_the_tokens(checkpoint_factory):
    """An engine loaded with draft_tokens=2: speculative="auto" measures plain decode, one draft and two drafts a
    step on its own calls, and every call's tokens are plain decode's."""
    path = checkpoint_factory("v3_groups_qlora_yarn")
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, draft_tokens=2)
    results = auto_calls(engine, 6)
    chains = []
    for result in results:
        report = result.stats.to_dict()["speculative_auto"]
        chains.append(report["draft_tokens"])
        if report["mode"] == "mtp":
            assert len(result.stats.draft_proposed_by_position) == report["draft_tokens"]
    # plain decode's step exists: measured at once; each chain's first call captures its step and runs again
    assert chains[:5] == [None, 1, 1, 2, 2]
    assert set(results[-1].stats.to_dict()["speculative_auto"]["ms_per_token_by_draft_tokens"]) == {1, 2}
    engine.close()


def test_auto_without_an_mtp_layer_runs_plain_decode_and_says_why(checkpoint_factory):
    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3", with_mtp=False), progress=False)
    result = engine.generate([[1, 2]], max_new_tokens=4, stop_at_eos=False, speculative="auto")
    report = result.stats.to_dict()["speculative_auto"]
    assert report["mode"] == "none" and report["reason"] == "no MTP layer in this checkpoint"
    assert not report["measured"] and not result.stats.speculative
    with pytest.raises(RequestError, match="'mtp' or 'auto'"):
        engine.generate([[1, 2]], max_new_tokens=4, speculative="fast")
    assert engine.generate([[1, 2]], max_new_tokens=4, stop_at_eos=False).sequences == result.sequences
    engine.close()


# ---- draft_experts="auto" ----------------------------------------------------------------------------------------

DRAFT_KEY = (1, "mtp", True, None)


def draft_stats(ms_per_token: float, tokens: int, checked: int, correct: int, mb_per_token: float) -> Stats:
    """A call of the mtp predictor: `tokens` decode tokens at `ms_per_token`, its drafts' tally, and its link bytes
    (one layer's counters: experts of 1 MB read in place)."""
    decode = {1: LayerCounters(zero_copy=round(mb_per_token * tokens), record_bytes=1_000_000)}
    return Stats(generated_tokens=tokens + 1, sequences=1, decode_steps=tokens,
                 decode_seconds=ms_per_token * tokens / 1000, mtp_drafts_checked=checked, mtp_drafts_correct=correct,
                 per_layer=decode, decode_per_layer=decode)


def test_draft_modes_are_each_measured_then_the_faster_per_token_runs_with_its_acceptance_and_bytes():
    auto = AutoDraftExperts()
    first = auto.choose(DRAFT_KEY)
    assert (first.mode, first.reason) == ("cached", "measuring draft_experts=cached (no estimate yet)")
    assert auto.record(first, draft_stats(9.0, 100, 100, 50, 40.0), warm=True)
    second = auto.choose(DRAFT_KEY)
    assert (second.mode, second.reason) == ("all", "measuring draft_experts=all (no estimate yet)")
    # reading the head's experts: drafts right 75 % of the time instead of 50 %, but 12 MB more a token, slower here
    assert auto.record(second, draft_stats(10.5, 100, 100, 75, 52.0), warm=True)
    decision = auto.choose(DRAFT_KEY)
    assert (decision.mode, decision.reason) == ("cached", "draft_experts=cached is faster here")
    assert decision.estimates["all"]["draft_acceptance"] == pytest.approx(0.75)
    assert decision.estimates["all"]["mb_per_token"] == pytest.approx(52.0)
    assert decision.estimates["cached"]["ms_per_token"] == pytest.approx(9.0)
    # every REMEASURE_EVERY calls the other mode runs once; a faster measurement of it flips the choice
    modes = [decision.mode] + [auto.choose(DRAFT_KEY).mode for _ in range(REMEASURE_EVERY - 1)]
    assert modes[-1] == "all" and set(modes[:-1]) == {"cached"}
    for _ in range(3):
        auto.record(DraftDecision(DRAFT_KEY, "all", "re-measuring"), draft_stats(6.0, 100, 100, 80, 30.0), warm=True)
    assert auto.choose(DRAFT_KEY).mode == "all"


def test_draft_modes_that_cannot_matter_or_calls_that_measure_nothing_leave_the_estimates_alone():
    auto = AutoDraftExperts()
    resident = auto.choose(DRAFT_KEY, "every expert is in VRAM")
    assert (resident.mode, resident.measures) == ("cached", False)
    assert not auto.record(resident, draft_stats(9.0, 100, 100, 50, 0.0), warm=True)
    first = auto.choose(DRAFT_KEY)
    assert not auto.record(first, draft_stats(9.0, 100, 100, 50, 40.0), warm=False)  # it captured a graph
    assert not auto.record(first, draft_stats(9.0, MIN_DECODE_TOKENS - 1, 3, 1, 40.0), warm=True)
    assert auto.choose(DRAFT_KEY).reason == "measuring draft_experts=cached (no estimate yet)"
    # speculation's acceptance is the drafts kept over the rows that could check one
    spec = Stats(generated_tokens=101, sequences=1, decode_steps=70, decode_seconds=0.7, draft_offered=70,
                 draft_proposed=70, draft_accepted=30)
    assert auto.record(first, spec, warm=True)
    assert auto.costs[DRAFT_KEY]["cached"].acceptance == pytest.approx(30 / 70)


def test_draft_experts_auto_keeps_the_tokens_and_reports_each_calls_choice(checkpoint_factory):
    path = checkpoint_factory("v3_groups_qlora_yarn")
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=5, draft_experts="auto")
    prompt = [[3, 4, 5, 6, 7]]
    expected = engine.generate(prompt, max_new_tokens=12, stop_at_eos=False).sequences
    plain = engine.generate(prompt, max_new_tokens=12, stop_at_eos=False).stats.to_dict()
    assert plain["draft_experts_auto"]["reason"] == "no MTP head runs in this call"
    reports = []
    for speculative in [None] * 6 + ["mtp"]:
        result = engine.generate(prompt, max_new_tokens=12, stop_at_eos=False, predictor="mtp",
                                 speculative=speculative)
        assert result.sequences == expected
        reports.append(result.stats.to_dict()["draft_experts_auto"])
    modes = [r["mode"] for r in reports[:6]]
    # each mode's first call builds its own decode step (no measurement), so it runs again
    assert modes[:4] == ["cached", "cached", "all", "all"]
    assert [r["measured"] for r in reports[:4]] == [False, True, False, True]
    for report in reports[4:6]:
        costs = {mode: e["ms_per_token"] for mode, e in report["estimates"].items()}
        assert set(costs) == {"cached", "all"} and report["mode"] == min(costs, key=costs.get)
        assert all(e["draft_acceptance"] is not None and e["mb_per_token"] >= 0 for e in report["estimates"].values())
    assert reports[6]["reason"] == "measuring draft_experts=cached (no estimate yet)"  # speculation: its own key
    calls = dict(engine._draft_modes.calls)
    ContinuousBatch(engine, predictor="mtp").check([3, 4, 5], 4)  # checks a request it runs its own way
    assert engine._draft_modes.calls == calls
    engine.close()
    resident = MoEPrefetchEngine.from_pretrained(path, progress=False, draft_experts="auto")
    report = resident.generate(prompt, max_new_tokens=4, stop_at_eos=False, predictor="mtp").stats.to_dict()
    assert report["draft_experts_auto"]["reason"] == "every expert is in VRAM"
    assert not report["draft_experts_auto"]["measured"]
    resident.close()

