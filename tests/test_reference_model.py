"""The shipped reference model: it loads, its config is what the card says, it is exact against transformers,
greedy generation is deterministic, and its routing and MTP head are learned (not random)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import hf_model
from moeprefetch import MoEPrefetchEngine
from moeprefetch.cli import REFERENCE_MODEL

CARD = (REFERENCE_MODEL / "README.md").read_text()


@pytest.fixture(scope="module")
def engine():
    return MoEPrefetchEngine.from_pretrained(REFERENCE_MODEL, progress=False)


def _card_value(field: str) -> str:
    match = re.search(rf"^\| {field} \| ([^|]+) \|$", CARD, re.MULTILINE)
    assert match, field
    return match.group(1).strip().replace(",", "")


def test_config_is_what_the_card_says(engine):
    config = json.loads((REFERENCE_MODEL / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["num_nextn_predict_layers"] == 1
    for field in ("hidden_size", "num_hidden_layers", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                  "moe_intermediate_size", "kv_lora_rank", "vocab_size", "first_k_dense_replace"):
        assert int(_card_value(field)) == config[field], field
    # the shape issue 5 asks for
    assert config["n_routed_experts"] >= 32 and config["num_experts_per_tok"] >= 4
    assert len(engine.args.moe_layers) >= 4 and config["n_shared_experts"] >= 1 and engine.has_mtp
    files = list(REFERENCE_MODEL.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in files) <= 25e6 and max(f.stat().st_size for f in files) <= 15e6
    training = json.loads((REFERENCE_MODEL / "training_log.json").read_text())
    assert training["tokens_seen"] >= 20e6
    assert f"{training['tokens_seen']:,}" in CARD  # the card reports the training log's figure


def test_logits_match_transformers(engine):
    reference = hf_model(REFERENCE_MODEL)
    ids = torch.tensor([engine.tokenizer("In the beginning God created the heaven and the earth.")["input_ids"]])
    with torch.no_grad():
        expected = reference(ids).logits
    assert (engine.forward(ids) - expected).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_greedy_generation_is_deterministic_and_fluent_enough(engine):
    prompt = "The kernel's memory manager"
    first = engine.generate(prompt, max_new_tokens=24)
    second = engine.generate(prompt, max_new_tokens=24)
    assert first.sequences == second.sequences and first.texts == second.texts
    words = re.findall(r"[a-z]+", first.texts[0].lower())
    assert len(words) >= 8 and "kernel" in words + re.findall(r"[a-z]+", prompt.lower())


@pytest.mark.slow
def test_routing_and_mtp_are_learned(engine):
    """Random weights route and draft at random; the trained model's MTP head agrees with greedy decoding far more
    often than chance (1/8192), and held-out text routes over every expert (no dead experts)."""
    prompts = [json.loads(line)["text"] for line in open(REFERENCE_MODEL.parent.parent / "experiments/prompts/heldout.jsonl")]
    cached = MoEPrefetchEngine.from_pretrained(REFERENCE_MODEL, progress=False, expert_cache_slots=40)
    stats = cached.generate(prompts[:4], max_new_tokens=24, stop_at_eos=False, predictor="mtp").stats.to_dict()
    assert stats["mtp_draft_accuracy"] > 0.4
    assert stats["prediction_recall"] > 0.5  # random routing would give ~4/32
    evaluation = json.loads((REFERENCE_MODEL / "eval.json").read_text())
    assert f"Greedy MTP draft acceptance: {evaluation['greedy_mtp']['acceptance']:.4f}" in CARD  # as measured
