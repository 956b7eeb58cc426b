"""memory_plan.py: budgets, slot counts, layer streaming and clear errors."""

from __future__ import annotations

import pytest

from moeprefetch.errors import RequestError
from moeprefetch.memory_plan import GiB, parse_bytes, plan_memory

MiB = 1024**2


def plan(**kwargs):
    defaults = dict(resident_bytes=2 * GiB, layer_bytes={i: 64 * MiB for i in range(32)}, kv_bytes=GiB // 4,
                    workspace_bytes=GiB // 2, expert_record_bytes=17 * MiB, total_experts=1664, top_k=6,
                    budget_bytes=None, expert_cache_slots=None)
    return plan_memory(**{**defaults, **kwargs})


def test_parse_bytes():
    assert parse_bytes("12GiB") == 12 * GiB
    assert parse_bytes("12 GB") == 12 * 10**9
    assert parse_bytes("512MiB") == 512 * MiB
    assert parse_bytes(1.5e9) == 1_500_000_000
    for bad in ("lots", "-1GiB", "0", True, float("nan")):
        with pytest.raises(RequestError):
            parse_bytes(bad)


def test_budget_fills_the_rest_with_slots_and_never_exceeds_it():
    p = plan(budget_bytes=12 * GiB)
    assert p.expert_slots == (12 * GiB - 2 * GiB - GiB // 4 - GiB // 2) // (17 * MiB)
    assert p.planned_vram_bytes <= 12 * GiB
    assert not p.all_resident and not p.streamed_layers


def test_no_budget_means_all_resident_and_slots_are_clamped():
    assert plan().all_resident and plan().expert_slots == 1664
    assert plan(expert_cache_slots=5000).expert_slots == 1664
    assert "expert_cache_slots=5000 is more than the model's 1664" in plan(expert_cache_slots=5000).warnings[0]
    assert not plan(expert_cache_slots=1664).warnings
    assert plan(budget_bytes=200 * GiB).all_resident


def test_too_small_is_a_clear_error():
    with pytest.raises(RequestError, match="cannot hold one layer's working set"):
        plan(expert_cache_slots=5)
    with pytest.raises(RequestError, match="cannot hold one layer's working set"):
        plan(budget_bytes=GiB // 2)


def test_streaming_kicks_in_when_resident_weights_do_not_fit():
    # 3.4 GiB of resident weights in a 3.5 GiB budget: not even 6 expert slots would be left without streaming
    p = plan(resident_bytes=int(3.4 * GiB), budget_bytes=int(3.5 * GiB), workspace_bytes=GiB // 8, kv_bytes=GiB // 8)
    assert p.streamed_layers and p.stream_ahead == 2
    assert p.planned_vram_bytes <= int(3.5 * GiB)
    assert p.expert_slots >= 6
    assert "stream from host RAM" in p.notes[0] and "streamed from host RAM" in p.describe()


def test_requested_streaming():
    p = plan(stream_layers=4, stream_ahead=1)
    assert len(p.streamed_layers) == 4 and p.stream_ahead == 1


def test_the_default_prefill_chunk_follows_the_device_and_context_never_the_budget(checkpoint_factory):
    """Prefill's bits depend on how a prompt is cut, and a cache size must never change tokens: the default chunk
    depends on the device and the context only."""
    import torch

    from moeprefetch import MoEPrefetchEngine
    from moeprefetch.build import PREFILL_CHUNK_CPU, PREFILL_CHUNK_CUDA, auto_prefill_chunk

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert auto_prefill_chunk(9000, cuda) == PREFILL_CHUNK_CUDA and auto_prefill_chunk(9000, cpu) == PREFILL_CHUNK_CPU
    assert auto_prefill_chunk(300, cuda) == 300 and auto_prefill_chunk(300, cpu) == 300  # never past the context
    path = checkpoint_factory("v3")
    chunks = {MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=512, **budget).options.prefill_chunk
              for budget in ({}, {"vram_budget": "300MiB"}, {"vram_budget": "8GiB"}, {"expert_cache_slots": 4})}
    assert chunks == {min(512, PREFILL_CHUNK_CPU)}
    assert MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64).options.prefill_chunk == 64
    assert MoEPrefetchEngine.from_pretrained(path, progress=False, prefill_chunk=5).options.prefill_chunk == 5


def test_the_default_prefill_window_is_whole_chunks_within_the_context(checkpoint_factory):
    import torch

    from moeprefetch import MoEPrefetchEngine
    from moeprefetch.build import PREFILL_WINDOW_CPU, PREFILL_WINDOW_CUDA, auto_prefill_window

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert auto_prefill_window(10**5, 2048, cuda) == PREFILL_WINDOW_CUDA
    assert auto_prefill_window(10**5, 512, cpu) == PREFILL_WINDOW_CPU
    assert auto_prefill_window(10**5, 3000, cuda) == 6000  # whole chunks
    assert auto_prefill_window(1000, 300, cuda) == 900  # within the context
    assert auto_prefill_window(1000, 2048, cuda) == 2048  # at least one chunk
    assert auto_prefill_window(10**5, 4, cpu, given=10) == 8
    path = checkpoint_factory("v3")
    windows = {MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=512, prefill_chunk=64,
                                                 **budget).options.prefill_window
               for budget in ({}, {"vram_budget": "300MiB"}, {"expert_cache_slots": 4})}
    assert windows == {512}
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, prefill_chunk=4, prefill_window=9)
    assert engine.options.prefill_window == 8


def test_a_tight_budget_moves_the_embedding_to_host_memory_before_streaming_any_layer():
    # 0.3 GiB short of a minimal expert cache; the embedding table (0.5 GiB) covers it alone
    p = plan(resident_bytes=int(3.4 * GiB), budget_bytes=int(3.5 * GiB), workspace_bytes=GiB // 8, kv_bytes=GiB // 8,
             embed_bytes=GiB // 2)
    assert p.host_embedding and not p.streamed_layers and p.expert_slots >= 6
    assert p.resident_bytes == int(3.4 * GiB) - GiB // 2 and p.planned_vram_bytes <= int(3.5 * GiB)
    assert "embedding table" in p.notes[0] and "embedding table in host RAM" in p.describe()
    # without that option (a table tied to the LM head) the same budget streams layers instead
    q = plan(resident_bytes=int(3.4 * GiB), budget_bytes=int(3.5 * GiB), workspace_bytes=GiB // 8, kv_bytes=GiB // 8)
    assert not q.host_embedding and q.streamed_layers
    # a roomy budget keeps the table in VRAM
    assert not plan(budget_bytes=12 * GiB, embed_bytes=GiB // 2).host_embedding


def test_the_ring_is_not_sized_by_one_outsized_layer():
    """A dense first layer 2.5x the others: streaming it would make each of the ring's buffers that large, so the
    plan streams only the small layers when they are enough, and the ring holds three of those."""
    layer_bytes = {0: 160 * MiB, **{i: 64 * MiB for i in range(1, 27)}}
    resident = sum(layer_bytes.values()) + 800 * MiB
    budget = resident + GiB // 4 + GiB // 2 + 6 * 17 * MiB - 400 * MiB  # 400 MiB short
    p = plan(resident_bytes=resident, layer_bytes=layer_bytes, budget_bytes=budget)
    assert p.streamed_layers and 0 not in p.streamed_layers
    ring = 3 * 64 * MiB
    assert p.resident_bytes == resident - 64 * MiB * len(p.streamed_layers) + ring
    assert p.planned_vram_bytes <= budget and p.expert_slots >= 6
    assert len(p.streamed_layers) == -(-(400 * MiB + ring) // (64 * MiB))  # the fewest that cover the shortfall
    # a shortfall that no choice covers is the clear error
    with pytest.raises(RequestError, match="cannot hold one layer's working set"):
        plan(resident_bytes=resident, layer_bytes=layer_bytes, budget_bytes=budget - 1200 * MiB)


def test_requested_streaming_frees_the_most_vram():
    """stream_layers=N with one outsized layer: the N same-size layers free more than any set with the big one
    (whose size every ring buffer would take)."""
    layer_bytes = {0: 160 * MiB, **{i: 64 * MiB for i in range(1, 27)}}
    p = plan(resident_bytes=3 * GiB, layer_bytes=layer_bytes, stream_layers=8)
    assert len(p.streamed_layers) == 8 and 0 not in p.streamed_layers
    assert p.resident_bytes == 3 * GiB - 8 * 64 * MiB + 3 * 64 * MiB
    # when every layer is asked for, the big one is among them
    assert len(plan(resident_bytes=3 * GiB, layer_bytes=layer_bytes, stream_layers=27).streamed_layers) == 27


def test_requested_streaming_never_plans_past_the_budget():
    """Three unequal layers, two of them streamed through a ring of two buffers of the larger: the ring holds more
    than the layers it replaces, so the plan gives up expert slots instead of exceeding the budget; with a host
    embedding the plan starts from the resident bytes that remain."""
    layer_bytes = {0: 100 * MiB, 1: 90 * MiB, 2: 80 * MiB}
    budget = 3 * GiB
    p = plan(resident_bytes=2 * GiB, layer_bytes=layer_bytes, budget_bytes=budget, stream_layers=2, stream_ahead=1)
    assert len(p.streamed_layers) == 2 and p.planned_vram_bytes <= budget and p.expert_slots >= 6
    q = plan(resident_bytes=2 * GiB + 400 * MiB, layer_bytes=layer_bytes, budget_bytes=budget, stream_layers=2,
             embed_bytes=500 * MiB, workspace_bytes=GiB // 4 + 60 * MiB)
    assert q.host_embedding and q.planned_vram_bytes <= budget


def test_the_prefill_window_shrinks_to_the_largest_that_streams_least(monkeypatch):
    """fit_prefill_window: windows halve from the default down to one chunk; the first that needs no streaming wins;
    if all stream, the largest of those that stream the fewest bytes; a window the user gave is kept."""
    import dataclasses

    import torch

    from moeprefetch import build
    from moeprefetch.memory_plan import MemoryPlan

    def fake_plan(streamed_by_window):
        def plan_engine_memory(args, reader, options, *rest):
            streamed = streamed_by_window[options.prefill_window]
            if streamed is None:
                raise RequestError("cannot hold one layer's working set")
            p = MemoryPlan(GiB, GiB, 0, 0, MiB, 10, 6, False, streamed_layers=[1] if streamed else [],
                           streamed_bytes=streamed)
            return p, 0
        return plan_engine_memory

    options = build.ResolvedConfig(
        device=torch.device("cpu"), dtype=torch.float32, policy="lru", lrfu_halflife=8.0, predictor="none", lookahead=1,
        prefetch_budget=1.0, max_inflight_experts=None, max_seq_len=8192, max_batch_size=1, prefill_chunk=1024,
        prefill_window=8192, expert_dtype="model", min_confidence=0.0, fill_confidence=0.0, fill_link="shared",
        reuse_weight=0.9, bypass=False,
        routing_trace=None, spare_recent=1, prefetch_lead=4, draft_experts="cached", verify_confidence=0.0,
        draft_tokens=1, extra_rows=1, verify_rows="separate",
        late_prefetch="wait", cuda_graphs=False, fused_kernels=False, progress=False)
    cases = [({8192: 5, 4096: 5, 2048: 0, 1024: 0}, False, 2048),
             ({8192: 9, 4096: 5, 2048: 5, 1024: 7}, False, 4096),
             ({8192: None, 4096: None, 2048: 3, 1024: 3}, False, 2048),
             ({8192: 5, 4096: 0, 2048: 0, 1024: 0}, True, 8192)]
    for streamed_by_window, given, expected in cases:
        monkeypatch.setattr(build, "plan_engine_memory", fake_plan(streamed_by_window))
        chosen, plan_, _ = build.fit_prefill_window(None, None, options, None, 10, False, GiB, None, None, 2, given)
        assert chosen.prefill_window == expected, (streamed_by_window, given)
        assert chosen == dataclasses.replace(options, prefill_window=expected)
