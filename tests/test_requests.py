"""requests.py: the conditions under which a call cannot verify MTP drafts, one list for both speculative modes."""

from __future__ import annotations

import pytest

from moeprefetch.predictors import PredictorSpec
from moeprefetch.requests import speculation_unavailable


@pytest.mark.parametrize("has_mtp,trace,lookahead,reason", [
    (True, None, 1, None),
    (False, None, 1, "no MTP layer in this checkpoint"),
    (False, "trace.json", 2, "no MTP layer in this checkpoint"),  # the first condition that fails is named
    (True, "trace.json", 1, "routing_trace routes one token per step"),
    (True, None, 3, "lookahead=3 chains MTP drafts for prefetching"),
])
def test_speculation_unavailable_names_the_first_condition_that_fails(has_mtp, trace, lookahead, reason):
    why = speculation_unavailable(has_mtp, trace, PredictorSpec.parse("mtp", lookahead))
    if reason is None:
        assert why is None
    else:
        assert why.reason == reason
        assert why.error.endswith(("has none", "use one or the other", "use lookahead=1"))  # a way out, in one sentence


def test_a_predictor_without_chained_drafts_leaves_speculation_available():
    assert speculation_unavailable(True, None, PredictorSpec.parse("next_layer_gate", 2)) is None
