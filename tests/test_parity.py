"""The engine's logits against transformers' DeepseekV3/V2ForCausalLM and MtpModel (fp32 and a float64 oracle)."""

from __future__ import annotations

import pytest
import torch

from conftest import VARIANTS, hf_model, hf_mtp_logits, hf_mtp_model
from moeprefetch import MoEPrefetchEngine


def _random_ids(vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(checkpoint_factory, variant):
    path = checkpoint_factory(variant)
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False)
    reference = hf_model(path)
    for seed, (batch, length) in enumerate([(2, 17), (1, 40), (3, 5)]):
        ids = _random_ids(engine.args.vocab_size, batch, length, seed)
        with torch.no_grad():
            expected = reference(ids).logits
        got = engine.forward(ids)
        assert got.shape == expected.shape == (batch, length, engine.args.vocab_size)
        assert (got - expected).abs().max().item() <= 1e-4
        assert expected.abs().max().item() > 0.1  # the comparison is not between near-zero tensors


@pytest.mark.parametrize("variant", ["v3", "v3_groups_qlora_yarn", "v2_group_limited"])
def test_fp32_close_to_float64_reference(checkpoint_factory, variant):
    """transformers in float64 is the oracle: the engine's fp32 result is within fp32 rounding of it."""
    path = checkpoint_factory(variant)
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False)
    reference = hf_model(path, torch.float64)
    ids = _random_ids(engine.args.vocab_size, 2, 24, 7)
    with torch.no_grad():
        expected = reference(ids).logits
    got = engine.forward(ids).double()
    rel = (got - expected).norm() / expected.norm()
    assert rel.item() < 1e-5


@pytest.mark.parametrize("variant", ["v3", "v3_groups_qlora_yarn", "v3_nogroup_plainrope", "glm4"])
def test_mtp_logits_match_transformers_mtp_model(checkpoint_factory, variant):
    path = checkpoint_factory(variant)
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False)
    assert engine.has_mtp
    main = hf_model(path)
    mtp = hf_mtp_model(path, main)
    ids = _random_ids(engine.args.vocab_size, 2, 19, 3)
    logits, mtp_logits = engine.forward(ids, return_mtp=True)
    expected = hf_mtp_logits(mtp, main, ids)
    assert mtp_logits.shape == (2, 18, engine.args.vocab_size)
    assert (mtp_logits - expected).abs().max().item() <= 1e-4
    assert expected.abs().max().item() > 0.1


def test_router_selection_matches_transformers_on_biased_scores(checkpoint_factory):
    """Group-limited V3 routing with a large correction bias: the bias decides the set, the unbiased scores the
    weights (compare expert sets, since transformers' top-k is unsorted)."""
    from moeprefetch.config import load_model_args
    from moeprefetch.model import route
    from moeprefetch.weights import RouterWeights

    path = checkpoint_factory("v3_groups_qlora_yarn")
    args = load_model_args(path)
    main = hf_model(path)
    gate = main.model.layers[1].mlp.gate
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        gate.e_score_correction_bias.copy_(torch.randn(args.n_routed_experts, generator=generator) * 3)
        x = torch.randn(64, args.hidden_size, generator=generator)
        _, ref_weights, ref_ids = gate(x)
    routing = route(args, RouterWeights(gate.weight.detach().float(), gate.e_score_correction_bias.float()), x)
    for row in range(64):
        ours = dict(zip(routing.ids[row].tolist(), routing.weights[row].tolist()))
        theirs = dict(zip(ref_ids[row].tolist(), ref_weights[row].tolist()))
        assert ours.keys() == theirs.keys()
        for expert, weight in theirs.items():
            assert abs(ours[expert] - weight) < 1e-6
