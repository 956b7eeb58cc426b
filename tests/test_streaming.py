"""streaming.py: layers streamed from host RAM compute exactly what resident layers compute."""

from __future__ import annotations

import pytest
import torch

from moeprefetch import MoEPrefetchEngine


@pytest.mark.parametrize("layers,ahead", [(1, 1), (2, 1), (3, 2), (3, 1)])
def test_streamed_layers_change_nothing(checkpoint_factory, layers, ahead):
    path = checkpoint_factory("v3")
    resident = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=8)
    streamed = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_cache_slots=8, stream_layers=layers,
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
    record = streamed.streamer.record_bytes
    assert stats["layer_stream_bytes"] % record == 0
    if layers > ahead + 1:  # the ring is smaller than the streamed layers: layers are re-streamed every step
        assert stats["layer_stream_bytes"] >= record * stats["decode_steps"]
    else:  # the ring holds every streamed layer: loaded once, then resident
        assert stats["layer_stream_bytes"] == 0 and streamed.streamer.bytes_copied == record * layers
    memory = streamed.memory_stats()
    assert memory["streamed_layers"] == streamed.plan.streamed_layers
    assert memory["host_streamed_layer_bytes"] == record * layers
