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
    assert spec.shadow and spec.needs_mtp and spec.gate_depth == 2 and not spec.oracle and spec.ring == 2
    assert PredictorSpec.parse("oracle", lookahead=3).ring == 4
    assert not PredictorSpec.parse("none").active and PredictorSpec.parse("previous").previous


@pytest.mark.parametrize("name", ["mtp", "mtp_router", "previous", "none", "mtp+mtp_router"])
def test_a_lookahead_a_predictor_cannot_use_is_an_error(name):
    with pytest.raises(ValueError, match="lookahead=2 means nothing"):
        PredictorSpec.parse(name, lookahead=2)


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
