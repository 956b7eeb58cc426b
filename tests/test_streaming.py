"""streaming.py: layers streamed from host RAM compute exactly what resident layers compute."""

from __future__ import annotations

import pytest
import torch

from conftest import full_only, gpu
from moeprefetch import MoEPrefetchEngine


# the fast lane: both branches (a ring smaller than the streamed layers, and one that holds them all), with and
# without expert offload, look-ahead 1 and 2, and both rings that do not divide their layers
@pytest.mark.parametrize("layers,ahead,slots,depth", [full_only(1, 1, 8, 3), full_only(2, 1, 8, 3),
                                                      full_only(3, 2, 8, 3), (3, 1, 8, 3), (1, 2, None, 3),
                                                      full_only(3, 1, None, 3), (4, 2, 8, 4), (5, 2, None, 5)])
def test_streamed_layers_change_nothing(checkpoint_factory, layers, ahead, slots, depth):
    """Every number of streamed layers, with expert offload (8 slots) and without, and rings whose size does not
    divide the streamed layers (4 or 5 layers through 3 buffers: the look-ahead wraps into the next step without
    evicting a layer the step still needs, so each layer sharing a buffer is copied once per step)."""
    path = checkpoint_factory("v3", num_hidden_layers=depth)
    resident = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=slots)
    streamed = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=slots, stream_layers=layers,
                                                 stream_ahead=ahead)
    assert len(streamed.plan.streamed_layers) == layers
    prompts = [[3, 4, 5], [7, 8]]
    for predictor in ("none", "mtp+next_layer_gate"):
        a = resident.generate(prompts, max_new_tokens=9, stop_at_eos=False, predictor=predictor)
        b = streamed.generate(prompts, max_new_tokens=9, stop_at_eos=False, predictor=predictor)
        assert a.sequences == b.sequences
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert torch.equal(resident.forward(ids), streamed.forward(ids))
    stats = b.stats.to_dict()
    sizes = streamed.streamer.layer_bytes  # each streamed layer's own bytes: what one copy of it moves
    record = streamed.streamer.record_bytes
    assert record == max(sizes)
    decode_bytes = b.stats.decode_stream_bytes
    assert stats["streamed_bytes_per_token"] == decode_bytes / b.stats.decode_tokens
    ring = min(ahead + 1, layers)
    if layers > ring:  # the ring is smaller than the streamed layers: every step streams once each layer that
        # shares its ring slot (layer i of the streamed list lives in slot i mod ring)
        sharing = [i for i in range(layers) if any(j != i and j % ring == i % ring for j in range(layers))]
        assert decode_bytes == sum(sizes[i] for i in sharing) * stats["decode_steps"]
        assert 0 < stats["prefill_streamed_bytes"] <= sum(sizes) * len(prompts)  # once per window and layer
    else:  # the ring holds every streamed layer: loaded once, then resident
        assert decode_bytes == 0 and streamed.streamer.bytes_copied == sum(sizes)
    memory = streamed.memory_stats()
    assert memory["streamed_layers"] == streamed.plan.streamed_layers
    assert memory["host_streamed_layer_bytes"] == record * layers
    assert memory["stream_ring_slots"] == min(ahead + 1, layers)
    assert memory["stream_ring_bytes"] == memory["stream_ring_slots"] * record
    from moeprefetch.weights import weights_nbytes

    # streamed layers count as the ring they share, plus their routers and norms kept in VRAM
    moved = sum(weights_nbytes(resident.weights.layers[i]) for i in streamed.plan.streamed_layers)
    assert memory["vram_resident_bytes"] == (resident.memory_stats()["vram_resident_bytes"] - moved
                                             + memory["stream_ring_bytes"] + streamed.streamer.kept_bytes)
    assert streamed.streamer.kept_bytes > 0 or not any(resident.weights.layers[i].router is not None
                                                      for i in streamed.plan.streamed_layers)
    streamer = streamed.streamer
    streamed.close()
    assert streamed.streamer is None and streamer.ring.numel() == 0 and not streamer.pinned


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("offload", [False, True])
def test_streamed_layers_inside_the_decode_graph_keep_the_tokens_on_gpu(checkpoint_factory, offload):
    """Every number of streamed layers from one to all, with and without expert offload: the step is one captured
    graph, synchronises once per token, and gives the all-resident tokens."""
    path = checkpoint_factory("v3")
    prompts = [[3, 4, 5, 6], [9, 10]]
    kwargs = dict(device="cuda", dtype=torch.bfloat16, progress=False)
    reference = MoEPrefetchEngine.from_pretrained(path, **kwargs)
    expected = reference.generate(prompts, max_new_tokens=12, stop_at_eos=False).sequences
    n_layers = reference.args.num_hidden_layers
    reference.close()
    for layers in range(1, n_layers + 1):
        engine = MoEPrefetchEngine.from_pretrained(path, stream_layers=layers, stream_ahead=1,
                                                   expert_cache_slots=4 if offload else None, **kwargs)
        for predictor in ("none", "mtp+next_layer_gate") if offload else ("none",):
            for _ in range(2):  # the second call replays graphs captured by the first
                result = engine.generate(prompts, max_new_tokens=12, stop_at_eos=False, predictor=predictor)
                assert result.sequences == expected, (layers, predictor)
                assert result.stats.decode_syncs == result.stats.decode_steps  # one per step, for both rows
        assert any(step.captured for step in engine._steps.values())
        engine.close()


@gpu
@pytest.mark.gpu
def test_a_streamed_layer_never_computes_on_a_half_copied_ring_slot(checkpoint_factory):
    """A ring of two slots for every layer, many steps: each layer's copy overwrites the slot the layer two back
    computed from, racing the compute; a layer reading a half-copied slot would change the tokens."""
    path = checkpoint_factory("v3", max_position_embeddings=1024)
    kwargs = dict(device="cuda", dtype=torch.bfloat16, progress=False, max_seq_len=1024)
    prompts = [[3, 4, 5], [7, 8]]
    expected = MoEPrefetchEngine.from_pretrained(path, **kwargs).generate(
        prompts, max_new_tokens=300, stop_at_eos=False).sequences
    engine = MoEPrefetchEngine.from_pretrained(path, stream_layers=99, stream_ahead=1, **kwargs)
    assert engine.memory_stats()["stream_ring_slots"] == 2
    result = engine.generate(prompts, max_new_tokens=300, stop_at_eos=False)
    assert result.sequences == expected
    stats = result.stats.to_dict()
    sizes = engine.streamer.layer_bytes
    layers = len(sizes)
    assert layers == len(engine.plan.streamed_layers) == engine.args.num_hidden_layers
    # each step copies every layer that shares its ring slot with another (layer i lives in slot i mod 2)
    sharing = [i for i in range(layers) if any(j != i and j % 2 == i % 2 for j in range(layers))]
    assert stats["streamed_bytes_per_token"] * result.stats.decode_tokens == (
        sum(sizes[i] for i in sharing) * result.stats.decode_steps)
    assert stats["stream_stall_ms_per_token"] > 0.0  # the device clock timed the waits of the replayed graphs


@gpu
@pytest.mark.gpu
def test_an_embedding_table_in_host_memory_keeps_the_tokens_on_gpu(checkpoint_factory, monkeypatch):
    """The plan's host embedding (forced here): every token's row is read over PCIe, inside the decode graph and for
    prefill, MTP included; the tokens are the all-resident ones and the table is not in VRAM."""
    from moeprefetch import build

    path = checkpoint_factory("v3")
    kwargs = dict(device="cuda", dtype=torch.bfloat16, progress=False)
    prompts = [[3, 4, 5, 6], [9, 10]]
    reference = MoEPrefetchEngine.from_pretrained(path, **kwargs)
    expected = {p: reference.generate(prompts, max_new_tokens=12, stop_at_eos=False, predictor=p).sequences
                for p in ("none", "mtp")}
    reference.close()
    plan_memory = build.plan_memory

    def with_host_embedding(**inputs):
        plan = plan_memory(**inputs)
        plan.host_embedding = True
        return plan

    monkeypatch.setattr(build, "plan_memory", with_host_embedding)
    engine = MoEPrefetchEngine.from_pretrained(path, expert_cache_slots=4, stream_layers=2, stream_ahead=1, **kwargs)
    assert engine.weights.embed.device.type == "cpu" and engine.runner.host_embed.pinned
    assert engine.memory_stats()["host_embedding_bytes"] == engine.weights.embed.numel() * 2
    for predictor, sequences in expected.items():
        for _ in range(2):
            assert engine.generate(prompts, max_new_tokens=12, stop_at_eos=False, predictor=predictor).sequences \
                == sequences
    assert any(step.captured for step in engine._steps.values())
    engine.close()
