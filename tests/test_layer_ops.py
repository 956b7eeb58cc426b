"""layer_ops.FusedOps: whole decode steps through the fused kernels (Triton's interpreter on the CPU, real kernels
on CUDA) against the definitions, on tiny checkpoints of every attention and router variant, in fp32."""

from __future__ import annotations

import pytest
import torch

from moeprefetch import MoEPrefetchEngine
from moeprefetch.kernels import HAS_TRITON
from moeprefetch.layer_ops import FusedOps

from conftest import full_only

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fused(engine: MoEPrefetchEngine) -> FusedOps:
    runner, weights = engine.runner, engine.weights
    layers = weights.layers + ([weights.mtp.layer] if weights.mtp is not None else [])
    return FusedOps(engine.args, runner.act, engine.args.hidden_act, runner.rope, engine.options.max_seq_len,
                    2 * engine.options.max_batch_size, engine.device, fuse=layers)


def _last_logits(engine: MoEPrefetchEngine) -> torch.Tensor:
    (step,) = engine._steps.values()
    return step.logits.clone()


@pytest.mark.parametrize("variant,predictor,slots", [
    ("v3_groups_qlora_yarn", "none", None),  # grouped sigmoid router, q LoRA, YaRN, interleaved rope
    ("v3_nogroup_plainrope", "mtp", 5),  # shared experts x2, de-interleaved rope, the MTP head and its shadow row
    full_only("v2_group_limited", "next_layer_gate", 7),  # softmax router, group-limited greedy, q_proj
    ("qwen3", "next_layer_gate", 5),  # grouped-query attention with q/k norm (gqa_attention.py)
    full_only("mixtral_window", "none", None),  # one key-value head, head dim 8, a 5-key sliding window
    full_only("glm4", "mtp", 6),  # GQA with bias and half rotary, the MTP head
])
def test_fused_decode_matches_the_definitions(checkpoint_factory, variant, predictor, slots):
    path = checkpoint_factory(variant)
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10], [9, 10]]
    options = dict(device=DEVICE, progress=False, max_seq_len=160, max_batch_size=2, cuda_graphs=False,
                   fused_kernels=False)
    if slots is not None:
        options["expert_cache_slots"] = slots
    engine = MoEPrefetchEngine.from_pretrained(path, **options)
    expected = engine.generate(prompts, max_new_tokens=6, stop_at_eos=False, predictor=predictor)
    expected_logits = _last_logits(engine)
    engine.close()

    engine = MoEPrefetchEngine.from_pretrained(path, **options)
    before = engine.forward([prompts[0]])
    bytes_before = engine.memory_stats()["vram_resident_bytes"]
    engine.runner.decode_ops = _fused(engine)
    # fused projections re-lay weights as views: every other reader (here the uncached forward) is unchanged
    assert torch.equal(engine.forward([prompts[0]]), before)
    assert engine.memory_stats()["vram_resident_bytes"] == bytes_before
    per_layer = 2 if engine.args.attention == "mla" else 1  # gate with up; q with kv_a (MLA), q/k/v (GQA without bias)
    assert len(engine.runner.decode_ops._fused) >= per_layer * engine.args.num_hidden_layers
    # the uncached forwards above used the cache and the routing history: start as the fresh engine above did
    engine.reset_expert_cache(forget_routing=True)
    got = engine.generate(prompts, max_new_tokens=6, stop_at_eos=False, predictor=predictor)
    logits = _last_logits(engine)
    engine.close()
    assert got.sequences == expected.sequences
    error = ((logits - expected_logits).norm() / expected_logits.norm()).item()
    assert error < 1e-5, error
    assert got.stats.to_dict()["decode_hit_rate"] == expected.stats.to_dict()["decode_hit_rate"]


def test_fused_decode_with_streamed_layers(checkpoint_factory):
    """Streamed layers' fused projections are views that span their parts in the ring record (no copy, nothing
    moved out of the ring), and decode through the fused kernels gives the definitions' tokens."""
    path = checkpoint_factory("v3")
    prompts = [[3, 4, 5, 6, 7], [9, 10]]
    options = dict(progress=False, max_seq_len=64, max_batch_size=2, cuda_graphs=False, fused_kernels=False,
                   stream_layers=2, device=DEVICE)
    engine = MoEPrefetchEngine.from_pretrained(path, **options)
    expected = engine.generate(prompts, max_new_tokens=5, stop_at_eos=False).sequences
    ops = _fused(engine)
    streamed = [lw for lw in engine.weights.layers if engine.streamer.streams(lw.index)]
    ring = engine.streamer.ring
    ring_span = (ring.data_ptr(), ring.data_ptr() + ring.numel())
    assert streamed
    for lw in streamed:
        query = lw.attn.q_proj if lw.attn.q_proj is not None else lw.attn.q_a_proj
        fused = ops._fused[id(lw.attn)]
        assert ring_span[0] <= fused.data_ptr() < ring_span[1] and fused.data_ptr() == query.weight.data_ptr()
        assert torch.equal(fused, torch.cat([query.weight, lw.attn.kv_a_proj.weight]))
        assert ring_span[0] <= query.weight.data_ptr() < ring_span[1]  # the parts still read the ring
    engine.runner.decode_ops = ops
    assert engine.generate(prompts, max_new_tokens=5, stop_at_eos=False).sequences == expected
    engine.close()
