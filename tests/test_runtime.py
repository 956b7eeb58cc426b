"""runtime.py + accounting.py on real runs: bit-identical tokens for every cache size, policy and predictor, and
the accounting invariants."""

from __future__ import annotations

import json

import pytest
import torch

from moeprefetch import MoEPrefetchEngine

PREDICTORS = ["none", "previous", "next_layer_gate", "mtp", "mtp_router", "oracle", "mtp+next_layer_gate",
              "mtp_router+next_layer_gate", "previous+next_layer_gate"]


@pytest.fixture(scope="module")
def reference(checkpoint_factory):
    path = checkpoint_factory("v3_groups_qlora_yarn")
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False)
    prompts = [[3, 4, 5, 6, 7], [9, 10]]
    result = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False)
    logits = engine.forward([[3, 4, 5, 6, 7]])
    return path, prompts, result.sequences, logits, engine.plan.total_experts


def check_invariants(stats: dict, expert_bytes: int) -> None:
    assert stats["hits"] + stats["misses"] == stats["expert_uses"]
    assert stats["bytes_h2d"] == (stats["misses"] + stats["prefetch_issued"]) * expert_bytes
    assert stats["prefetch_issued"] == stats["prefetch_useful"] + stats["prefetch_late"] + stats["prefetch_wasted"]
    assert 0 <= stats["prediction_recall"] <= 1 and 0 <= stats["prediction_precision"] <= 1
    layers = stats["per_layer"].values()
    for key in ("expert_uses", "hits", "misses", "bytes_h2d", "evictions", "prefetch_issued", "prefetch_wasted"):
        assert sum(layer[key] for layer in layers) == stats[key], key


@pytest.mark.parametrize("policy", ["lru", "lfu", "static"])
def test_every_cache_size_policy_and_predictor_gives_identical_tokens(reference, policy):
    path, prompts, expected, logits, total = reference
    hot = [(1, e) for e in range(2)] if policy == "static" else None
    for slots in ((6, 7, 11, total // 2, total) if policy != "static" else (8, 11, total // 2)):
        engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=slots, policy=policy,
                                                   hot_set=hot)
        assert torch.equal(engine.forward([[3, 4, 5, 6, 7]]), logits)  # prefill path: bit-identical too
        for predictor in PREDICTORS:
            engine.reset_expert_cache()
            result = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor=predictor)
            assert result.sequences == expected, (slots, policy, predictor)
            check_invariants(result.stats.to_dict(), engine.runtime.expert_bytes)
        if slots >= 2 * len(prompts) * engine.args.num_experts_per_tok:
            spec = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, speculative="mtp")
            assert spec.sequences == expected
            assert 0 <= spec.stats.to_dict()["draft_acceptance"] <= 1


def test_prefill_waves_when_the_cache_is_smaller_than_a_chunk(reference):
    """A prefill chunk needs most experts of a layer; with 6 slots it runs in waves and still matches."""
    path, prompts, expected, logits, _ = reference
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=6, prefill_chunk=3)
    stats = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False).stats.to_dict()
    assert stats["misses"] > stats["expert_uses"] / 4
    assert engine.generate(prompts, max_new_tokens=10, stop_at_eos=False).sequences == expected


def test_all_resident_has_no_transfers_and_oracle_recall_is_perfect(reference):
    path, prompts, expected, _, total = reference
    resident = MoEPrefetchEngine.from_pretrained(path, progress=False)
    stats = resident.generate(prompts, max_new_tokens=10, stop_at_eos=False).stats.to_dict()
    assert stats["misses"] == stats["bytes_h2d"] == 0 and stats["hit_rate"] == 1.0
    offloaded = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=12)
    oracle = offloaded.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor="oracle").stats.to_dict()
    none = offloaded.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor="none").stats.to_dict()
    assert oracle["prediction_recall"] == 1.0 and oracle["prediction_precision"] == 1.0
    assert oracle["misses"] < none["misses"]


def test_cold_cache_compulsory_misses_and_warm_hits(reference):
    path, prompts, _, _, total = reference
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=total)
    cold = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor="none").stats.to_dict()
    warm = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False, predictor="none").stats.to_dict()
    # a cache that holds everything misses each expert at most once, then never again
    assert cold["misses"] <= total and cold["evictions"] == 0
    assert warm["misses"] == 0 and warm["expert_uses"] == cold["expert_uses"]


def test_event_log_jsonl(reference, tmp_path):
    path, prompts, _, _, _ = reference
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=8)
    log = tmp_path / "events.jsonl"
    stats = engine.generate(prompts, max_new_tokens=6, stop_at_eos=False, predictor="mtp+next_layer_gate",
                            event_log=log).stats.to_dict()
    events = [json.loads(line) for line in log.read_text().splitlines()]
    kinds = {}
    for event in events:
        kinds[event["kind"]] = kinds.get(event["kind"], 0) + 1
    assert kinds["use"] == stats["expert_uses"]
    assert kinds.get("fetch", 0) == stats["misses"] and kinds.get("prefetch", 0) == stats["prefetch_issued"]
    assert kinds.get("evict", 0) == stats["evictions"]
    assert {e["outcome"] for e in events if e["kind"] == "use"} <= {"hit", "prefetched", "late", "miss"}


def test_memory_stats(reference):
    path, _, _, _, total = reference
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=10)
    stats = engine.memory_stats()
    assert stats["expert_cache_slots"] == 10
    assert stats["vram_expert_cache_bytes"] == 10 * engine.runtime.expert_bytes
    assert stats["host_expert_bytes"] == total * engine.runtime.expert_bytes
    assert stats["host_pinned_bytes"] == 0  # CPU: nothing to page-lock
    assert stats["vram_resident_bytes"] > 0


def test_static_hot_set_from_a_routing_profile(reference):
    path, prompts, expected, _, total = reference
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=16, policy="static",
                                               max_batch_size=2)
    engine.generate(prompts, max_new_tokens=10, stop_at_eos=False)  # builds the routing profile
    profile = engine.routing_profile
    hot = engine.set_hot_set_from_profile(share=0.4)  # 6 wanted; 16 slots - 2 x 2 x top-3 working set leaves 4
    assert len(hot) == 4 and all(profile[k] >= max(v for key, v in profile.items() if key not in hot) for k in hot)
    result = engine.generate(prompts, max_new_tokens=10, stop_at_eos=False)
    assert result.sequences == expected
    assert set(hot) <= set(engine.runtime.cache.slot_of)  # pinned experts stay resident
    with pytest.raises(Exception, match="only used by policy='static'"):
        MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=16).set_hot_set_from_profile()
