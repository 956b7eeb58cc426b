"""predictors.py: what each predictor predicts, for which (step, layer), from which observation."""

from __future__ import annotations

import pytest
import torch

from moeprefetch.predictors import (
    LayerObservation,
    PredictorContext,
    _ranked,
    make_predictor,
    parse_predictor,
)

LAYERS = [1, 2, 3, 4]


def ctx(width=2, lookahead=1, trace=None):
    return PredictorContext(LAYERS, top_k=2, width=width, lookahead=lookahead, trace=trace or {})


def obs(**kwargs):
    base = dict(step=5, layer=2, phase="decode", real_experts=[7, 3], real_scores=None, shadow_scores=None,
                hidden=None)
    return LayerObservation(**{**base, **kwargs})


def test_ranked_merges_rows_by_rank():
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.0], [0.8, 0.0, 0.1, 0.7]])
    assert _ranked(scores, 2) == (1, 0, 2, 3)


def test_previous_predicts_the_same_experts_next_step():
    p = make_predictor("previous")
    p.reset(ctx())
    (prediction,) = p.on_layer(obs())
    assert (prediction.step, prediction.layer, prediction.experts) == (6, 2, (7, 3))


def test_next_layer_gate_scores_the_next_layers():
    p = make_predictor("next_layer_gate")
    p.reset(ctx(width=2, lookahead=2))
    seen = []

    def score(layer, hidden):
        seen.append(layer)
        return torch.tensor([[0.0, float(layer), 1.0, 0.5]])

    out = p.on_layer(obs(layer=2, hidden=torch.zeros(1, 4), score_layer=score))
    assert seen == [3, 4]
    assert [(q.step, q.layer, q.experts) for q in out] == [(5, 3, (1, 2)), (5, 4, (1, 2))]
    assert p.on_layer(obs(layer=4, hidden=torch.zeros(1, 4), score_layer=score)) == []  # no layer after the last
    # scores computed on the device arrive precomputed in the observation
    out = p.on_layer(obs(layer=2, gate_ranked={3: (9, 8)}))
    assert [(q.layer, q.experts) for q in out] == [(3, (9, 8))]


def test_mtp_predicts_the_shadow_rows_routing_for_the_next_step():
    p = make_predictor("mtp")
    p.reset(ctx(width=3))
    assert p.uses_shadow
    (prediction,) = p.on_layer(obs(shadow_scores=torch.tensor([[0.2, 0.9, 0.1, 0.5]])))
    assert (prediction.step, prediction.layer, prediction.experts) == (6, 2, (1, 3, 0))
    assert p.on_layer(obs(phase="prefill", shadow_scores=torch.ones(1, 4))) == []


def test_mtp_router_predicts_every_layer_from_the_mtp_output():
    p = make_predictor("mtp_router")
    p.reset(ctx())
    out = p.on_mtp_output(5, {1: (4, 5), 3: (6,)})
    assert [(q.step, q.layer, q.experts) for q in out] == [(6, 1, (4, 5)), (6, 3, (6,))]


def test_oracle_replays_the_trace_within_its_horizon():
    trace = {(0, 1): [1, 2], (1, 1): [3], (2, 1): [4], (3, 1): [5]}
    p = make_predictor("oracle")
    p.reset(ctx(lookahead=1, trace=trace))
    first = p.on_step_start(0, "prefill")
    assert sorted((q.step, q.experts) for q in first) == [(0, (1, 2)), (1, (3,))]
    assert [(q.step, q.experts) for q in p.on_step_start(1, "decode")] == [(2, (4,))]  # nothing twice


def test_combinations_and_parsing():
    p = make_predictor("mtp+next_layer_gate")
    assert p.name == "mtp+next_layer_gate" and p.uses_shadow
    assert parse_predictor("mtp+oracle") == ["mtp", "oracle"]
    for bad, message in [("", "non-empty"), ("x", "unknown predictor"), ("mtp+mtp", "twice"), ("none+mtp", "none")]:
        with pytest.raises(ValueError, match=message):
            parse_predictor(bad)
