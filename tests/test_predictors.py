"""predictors.py: parsing and what lookahead means, confidences, and the ring writes the decode step makes."""

from __future__ import annotations

import pytest
import torch

from moeprefetch.predictors import PredictionRing, PredictorSpec, parse_predictor, routing_confidence


def test_parsing_and_combinations():
    assert parse_predictor("mtp+next_layer_gate") == ["mtp", "next_layer_gate"]
    for bad, message in (("magic", "unknown predictor"), ("mtp+mtp", "twice"), ("none+mtp", "cannot be combined"),
                         ("", "non-empty")):
        with pytest.raises(ValueError, match=message):
            parse_predictor(bad)
    spec = PredictorSpec.parse("mtp+next_layer_gate", lookahead=2)
    # each component reads lookahead its own way: drafts chained twice, gates two MoE layers ahead
    assert spec.shadow and spec.needs_mtp and spec.gate_depth == 2 and spec.chain == 2 and not spec.oracle
    assert spec.ring == 3 and spec.max_lead == 2
    assert PredictorSpec.parse("oracle", lookahead=3).ring == 4 and PredictorSpec.parse("oracle", 3).max_lead == 3
    assert PredictorSpec.parse("mtp_router", lookahead=3).chain == 3 and PredictorSpec.parse("mtp_router", 3).ring == 4
    assert PredictorSpec.parse("next_layer_gate", lookahead=3).chain == 1
    assert PredictorSpec.parse("next_layer_gate", lookahead=3).max_lead == 0  # same-step guesses only
    assert not PredictorSpec.parse("none").active and PredictorSpec.parse("previous").previous
    nxt = PredictorSpec.parse("oracle_next")
    assert nxt.oracle and not nxt.belady and nxt.oracle_steps == 2 and nxt.ring == 2 and nxt.max_lead == 1
    assert PredictorSpec.parse("oracle", 2).belady and PredictorSpec.parse("oracle", 2).oracle_steps == 3
    gated = PredictorSpec.parse("oracle_next+next_layer_gate", lookahead=2)  # the gate's depth, the next token
    assert gated.gate_depth == 2 and gated.oracle_steps == 2 and gated.ring == 2
    with pytest.raises(ValueError, match="cannot be combined"):
        parse_predictor("oracle+oracle_next")


@pytest.mark.parametrize("name", ["previous", "none", "oracle_next"])
def test_a_lookahead_a_predictor_cannot_use_is_an_error(name):
    with pytest.raises(ValueError, match="lookahead=2 means nothing"):
        PredictorSpec.parse(name, lookahead=2)


def test_lead_tracker_counts_each_leads_guesses_against_the_step_that_uses_them():
    from moeprefetch.predictors import LeadTracker

    tracker = LeadTracker(leads=3, ring=4, positions=2, experts=6, device=torch.device("cpu"))
    step = torch.tensor([5])
    ring = PredictionRing(torch.zeros(4, 2, 6), step, ring=4, leads=tracker, min_confidence=0.2)
    ring.write(1, 1, torch.tensor([[0, 1]]), torch.tensor([[0.9, 0.5]]))  # lead 1, for step 6
    ring.write(2, 1, torch.tensor([[2, 3]]), torch.tensor([[0.9, 0.1]]))  # lead 2 (expert 3 under the cut)
    ring.write(0, 1, torch.tensor([[4, 5]]), torch.tensor([[0.9, 0.9]]))  # same step: no lead
    step.fill_(6)  # step 6 uses experts 1 and 2 (one row active, the other not)
    tracker.note(1, torch.tensor([[1, 2], [0, 3]]), torch.tensor([True, False]))
    tracker.close_step(step)
    assert tracker.read(3) == [(2, 1, 2), (0, 0, 2), (0, 0, 2)]  # (predicted, correct, truth) per lead
    step.fill_(7)  # lead 2's guess for step 7: expert 2 (3 was cut); step 7 uses 2 and 5
    tracker.note(1, torch.tensor([[2, 5]]), torch.tensor([True]))
    tracker.close_step(step)
    assert tracker.read(3) == [(2, 1, 4), (1, 1, 4), (0, 0, 4)]
    step.fill_(10)  # the ring came round to row 6 mod 4 = 2 again: step 6's guesses were cleared when counted
    tracker.note(1, torch.tensor([[0, 1]]), torch.tensor([True]))
    tracker.close_step(step)
    assert tracker.read(1) == [(2, 1, 6)]
    tracker.reset()
    assert tracker.read(3) == [(0, 0, 0)] * 3 and not tracker.pred.any()


@pytest.mark.slow
@pytest.mark.parametrize("predictor", ["mtp", "mtp_router", "mtp+next_layer_gate"])
def test_chained_mtp_drafts_change_no_token_and_report_recall_by_lead(checkpoint_factory, predictor):
    """lookahead 1, 2, 3 at two cache sizes and batches of one and two: the tokens of `none`; the by-lead lists have
    one entry per lead, and lead 1 is the main-layer recall when nothing else predicts that step."""
    from moeprefetch import MoEPrefetchEngine

    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False, max_seq_len=128,
                                               expert_cache_slots=6)
    small = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False, max_seq_len=128,
                                              expert_cache_slots=3)
    for prompts in ([[3, 4, 5, 6]], [[3, 4, 5, 6], [7, 8]]):
        expected = engine.generate(prompts, max_new_tokens=12, stop_at_eos=False, predictor="none").sequences
        for lookahead in (1, 2, 3):
            for e in (engine, small):
                result = e.generate(prompts, max_new_tokens=12, stop_at_eos=False, predictor=predictor,
                                    lookahead=lookahead)
                assert result.sequences == expected, (predictor, lookahead)
                stats = result.stats.to_dict()
                recall, precision = stats["prediction_recall_by_lead"], stats["prediction_precision_by_lead"]
                assert len(recall) == len(precision) == lookahead
                assert all(r is None or 0.0 <= r <= 1.0 for r in recall + precision)
                assert recall[-1] is not None and recall[-1] > 0.0  # the farthest lead predicted something right
                if lookahead == 1 and "next_layer_gate" not in predictor:
                    assert recall[0] == pytest.approx(stats["prediction_recall_main_layers"])
                assert not e.residency.problems()


def test_the_oracle_is_right_at_every_lead_and_speculation_takes_no_chain(checkpoint_factory):
    from moeprefetch import MoEPrefetchEngine
    from moeprefetch.errors import RequestError

    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3"), progress=False, max_seq_len=128,
                                               expert_cache_slots=6)
    stats = engine.generate([[3, 4, 5]], max_new_tokens=10, stop_at_eos=False, predictor="oracle",
                            lookahead=3).stats.to_dict()
    assert stats["prediction_precision_by_lead"] == [1.0, 1.0, 1.0]
    assert stats["prediction_recall_by_lead"][0] > stats["prediction_recall_by_lead"][2] > 0.5
    with pytest.raises(RequestError, match="verifies one draft per step"):
        engine.generate([[3, 4]], max_new_tokens=4, predictor="mtp", lookahead=2, speculative="mtp")
    assert engine.generate([[3, 4]], max_new_tokens=4, predictor="none").stats.to_dict()[
        "prediction_recall_by_lead"] == []


def test_oracle_next_knows_the_next_token_only_and_changes_no_token(checkpoint_factory):
    """The one-token ceiling: every guess right (at lead 1 and for the current step), victims by the policy, and the
    tokens of every expert resident."""
    from moeprefetch import MoEPrefetchEngine

    path = checkpoint_factory("v3")
    resident = MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64)
    expected = resident.generate([[3, 4, 5]], max_new_tokens=8, stop_at_eos=False).sequences
    for slots, spare in ((4, 0), (9, 1)):  # 9 slots hold every expert decode needs: nothing left to fetch
        engine = MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64, expert_cache_slots=slots,
                                                   spare_recent=spare)
        result = engine.generate([[3, 4, 5]], max_new_tokens=8, stop_at_eos=False, predictor="oracle_next")
        stats = result.stats.to_dict()
        assert result.sequences == expected
        assert stats["prediction_precision_main_layers"] == 1.0 and stats["prediction_recall_main_layers"] == 1.0
        assert stats["prediction_precision_by_lead"] == [1.0]
        assert (stats["prefetch_issued"] > 0) == (slots == 4) and not engine.residency.problems()
        assert engine.residency.next_use is None  # no Belady: it never learns the future beyond the next token


def test_routing_confidence_is_each_experts_share():
    conf = routing_confidence(torch.tensor([[3.0, 1.0, 0.0], [0.2, 0.2, 0.6]]))
    assert torch.allclose(conf, torch.tensor([[0.75, 0.25, 0.0], [0.2, 0.2, 0.6]]))


def test_ring_writes_merge_by_the_more_confident_guess():
    pred = torch.zeros(3, 4, 8)  # R=3 steps, P=4 positions, E=8 experts
    step = torch.tensor([4])
    ring = PredictionRing(pred, step, ring=3)
    ring.write(1, 2, torch.tensor([[5, 1]]), torch.tensor([[0.7, 0.3]]))  # step 5 -> row 2
    ring.write(1, 2, torch.tensor([[1, 6]]), torch.tensor([[0.9, 0.0]]))  # a zero confidence writes nothing
    expected = torch.zeros(8)
    expected[5], expected[1] = 0.7, 0.9
    assert torch.equal(pred[2, 2], expected)
    assert pred.sum() == expected.sum()
    ring.write(0, 3, torch.tensor([[2]]), torch.tensor([[0.5]]))  # step 4 -> row 1
    assert pred[1, 3, 2] == 0.5


def test_oracle_writes_the_recorded_routing_of_its_horizon():
    trace = torch.zeros(6, 2, 4, dtype=torch.uint8)
    trace[3, 0, 1] = trace[4, 1, 2] = trace[5, 0, 3] = 1
    pred = torch.zeros(2, 2, 4)
    ring = PredictionRing(pred, torch.tensor([3]), ring=2)
    ring.write_trace(trace, steps=2)  # steps 3 and 4
    assert pred[1, 0, 1] == 1 and pred[0, 1, 2] == 1 and pred.sum() == 2
    ring = PredictionRing(pred.zero_(), torch.tensor([5]), ring=2)
    ring.write_trace(trace, steps=2)  # step 6 is past the trace: nothing for it
    assert pred[1, 0, 3] == 1 and pred.sum() == 1
