"""options.EngineConfig: one name, one default and one check per option; every mistake is one sentence naming the
option, and a valid configuration passes."""

from __future__ import annotations

import pytest

from moeprefetch.errors import RequestError
from moeprefetch.options import EngineConfig, check_fraction, check_one_cache_size, check_positive_int
from moeprefetch.residency.state import ResidencyConfig

BAD = [
    ("draft_experts", "some"), ("late_prefetch", "never"), ("fill_link", "fast"), ("policy", "mru"),
    ("lrfu_halflife", 0), ("lrfu_halflife", True), ("lrfu_halflife", 1e7), ("expert_dtype", "int3"),
    ("int4_group_size", 63), ("int4_group_size", 0), ("int4_group_size", True), ("int4_symmetric", "yes"),
    ("max_batch_size", 0), ("max_batch_size", 2.0), ("stream_ahead", -1), ("lookahead", False),
    ("spare_recent", 65), ("prefetch_lead", -1), ("max_inflight_experts", 0), ("expert_cache_slots", 1.5),
    ("max_seq_len", -8), ("prefill_chunk", 0), ("prefill_window", "big"), ("min_confidence", 1.5),
    ("fill_confidence", float("nan")), ("reuse_weight", -0.1), ("bypass", 1), ("prefetch_budget", -1),
    ("prefetch_budget", float("inf")), ("expert_cache_fraction", 0), ("expert_cache_fraction", 1.2),
    ("predictor_path", 3), ("routing_trace", ["a"]), ("distributed", "no"), ("pin_memory", "no"),
    ("cuda_graphs", 0), ("fused_kernels", None), ("progress", "yes"), ("bypass", True), ("reuse_weight", 0.5),
]


@pytest.mark.parametrize("name,value", BAD)
def test_a_bad_option_is_one_sentence_naming_it(name, value):
    config = EngineConfig.from_mapping({name: value})
    with pytest.raises(RequestError) as info:
        config.check()
    message = str(info.value)
    assert name in message and "\n" not in message, message


def test_valid_options_pass_and_unknown_ones_are_named():
    EngineConfig().check()
    EngineConfig.from_mapping(dict(expert_cache_fraction=1.0, min_confidence=1.0, int4_group_size=128,
                                   policy="lru", prefetch_lead=0, spare_recent=0, bypass=True,
                                   reuse_weight=0.5, predictor_path="head.safetensors")).check()
    with pytest.raises(RequestError, match=r"unknown engine options 'cache', 'slots'; the options are: device, "):
        EngineConfig.from_mapping({"slots": 3, "cache": 1})


def test_one_rule_sizes_the_cache():
    with pytest.raises(RequestError, match="give one of expert_cache_slots or vram_budget, not both"):
        EngineConfig(expert_cache_slots=4, vram_budget="1GiB").check()
    check_one_cache_size(["vram_budget"])  # one is fine
    with pytest.raises(RequestError, match="placement_profile places experts over ranks"):
        EngineConfig(placement_profile={(0, 0): 1.0}).check()


def test_defaults_agree_between_layers_and_every_option_explains_itself():
    """The engine's LRFU default is the residency's (one place sets it); every option has help text."""
    assert EngineConfig().lrfu_halflife == ResidencyConfig.frequency_halflife
    assert EngineConfig().policy == "lrfu"
    for name in EngineConfig.names():
        assert len(EngineConfig.help(name)) > 10, name


def test_the_shared_checks_accept_their_edges():
    check_positive_int("n", 1)
    check_fraction("f", 0.0)
    check_fraction("f", 1.0, upper_open=False)
    with pytest.raises(RequestError, match=r"f must be a number in \[0, 1\), got 1.0"):
        check_fraction("f", 1.0)
    with pytest.raises(RequestError, match="n must be a positive integer, got True"):
        check_positive_int("n", True)
