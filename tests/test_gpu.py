"""GPU-only checks (skipped without CUDA): copy/compute ordering, the no-overwrite guarantee, and bit-identical
tokens across cache sizes, policies and predictors on the device."""

from __future__ import annotations

import pytest
import torch

from conftest import gpu
from moeprefetch import MoEPrefetchEngine
from moeprefetch.transfer import TransferEngine

pytestmark = [gpu, pytest.mark.gpu]


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory()


def test_compute_waits_for_the_copy_it_needs():
    """A kernel enqueued after wait_for() sees the copied data even though the copy runs on another stream."""
    device = torch.device("cuda")
    n = 64 * 1024 * 1024  # 64 MiB: long enough that an unordered read would see the old contents
    transfer = TransferEngine(device, n_slots=1)
    slot = torch.zeros(n, dtype=torch.uint8, device=device)
    src = _pinned(torch.full((n,), 7, dtype=torch.uint8))
    for _ in range(3):
        slot.zero_()
        torch.cuda.synchronize()
        transfer.copy(src, slot, 0, demand=True)
        transfer.wait_for([0])
        total = slot.sum(dtype=torch.int64)  # enqueued on the compute stream after the wait
        assert total.item() == 7 * n
    assert transfer.collect_stall_seconds() >= 0.0


def test_a_slot_is_not_overwritten_while_a_kernel_reads_it():
    """A copy into a slot waits for the release event recorded after the kernel that reads the slot."""
    device = torch.device("cuda")
    transfer = TransferEngine(device, n_slots=1)
    size = 4096
    slot = torch.ones(size, size, device=device)
    new_expert = _pinned(torch.full((size, size), 3.0))
    x = torch.randn(size, size, device=device)
    torch.cuda.synchronize()
    # A long chain of matmuls reading the slot, then the release, then a copy that must wait for them.
    out = x
    for _ in range(20):
        out = (out @ slot) / size
    transfer.release([0])
    transfer.copy(new_expert, slot, 0, demand=False)
    expected = x
    ones = torch.ones(size, size, device=device)
    for _ in range(20):
        expected = (expected @ ones) / size
    torch.cuda.synchronize()
    assert torch.allclose(out, expected)
    assert slot.eq(3.0).all()


def test_engine_tokens_identical_across_cache_sizes_on_gpu(checkpoint_factory):
    path = checkpoint_factory("v3")
    prompts = [[3, 4, 5, 6], [9, 10]]
    reference = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, progress=False)
    expected = reference.generate(prompts, max_new_tokens=16, stop_at_eos=False)
    logits = reference.forward([[3, 4, 5, 6]])
    total = reference.plan.total_experts
    for slots in (4, 5, total // 2, total):
        for policy in ("lru", "lfu"):
            engine = MoEPrefetchEngine.from_pretrained(
                path, device="cuda", dtype=torch.bfloat16, expert_cache_slots=slots, policy=policy, progress=False
            )
            for predictor in ("none", "mtp", "next_layer_gate", "oracle", "mtp+next_layer_gate", "mtp_router"):
                result = engine.generate(prompts, max_new_tokens=16, stop_at_eos=False, predictor=predictor)
                assert result.sequences == expected.sequences, (slots, policy, predictor)
                stats = result.stats.to_dict()
                assert stats["hits"] + stats["misses"] == stats["expert_uses"]
            assert torch.equal(engine.forward([[3, 4, 5, 6]]), logits)
            if slots >= 2 * len(prompts) * engine.args.num_experts_per_tok:  # verify rows double the working set
                spec = engine.generate(prompts, max_new_tokens=16, stop_at_eos=False, speculative="mtp")
                assert spec.sequences == expected.sequences
            engine.close()


def test_gpu_matches_cpu_in_fp32(checkpoint_factory):
    path = checkpoint_factory("v3_groups_qlora_yarn")
    cpu = MoEPrefetchEngine.from_pretrained(path, progress=False)
    cuda = MoEPrefetchEngine.from_pretrained(path, device="cuda", progress=False, expert_cache_slots=6)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    assert (cpu.forward(ids) - cuda.forward(ids).cpu()).abs().max().item() < 1e-3
    assert cuda.memory_stats()["host_pinned_bytes"] == cuda.memory_stats()["host_expert_bytes"] > 0


def test_cuda_graphs_change_nothing(checkpoint_factory):
    """Captured segment graphs replay exactly what eager execution computes (offloaded and all-resident)."""
    path = checkpoint_factory("v3")
    prompts = [[3, 4, 5, 6], [9, 10]]
    for slots in (None, 8):  # 8 = batch 2 x 2 verify rows x top-2: speculative decoding fits
        runs = []
        for graphs in (False, True):
            engine = MoEPrefetchEngine.from_pretrained(
                path, device="cuda", dtype=torch.bfloat16, expert_cache_slots=slots, cuda_graphs=graphs, progress=False
            )
            runs.append(engine.generate(prompts, max_new_tokens=12, stop_at_eos=False, predictor="mtp").sequences)
            runs.append(engine.generate(prompts, max_new_tokens=12, stop_at_eos=False, speculative="mtp").sequences)
            assert not engine._graphs.failed
            if graphs:
                assert engine._graphs.captured > 0
        assert runs[0] == runs[1] == runs[2] == runs[3]


@pytest.mark.parametrize("expert_dtype", ["fp8", "int8"])
def test_dequantisation_on_the_gpu_matches_the_cpu(checkpoint_factory, expert_dtype):
    """Compressed experts travel as FP8/int8 and are dequantised on the GPU after landing; the result matches the
    CPU's dequantisation of the same bytes, and host RAM holds the compact records."""
    path = checkpoint_factory("v3_groups_qlora_yarn")
    kwargs = dict(progress=False, expert_dtype=expert_dtype, expert_cache_slots=12)
    cpu = MoEPrefetchEngine.from_pretrained(path, **kwargs)
    cuda = MoEPrefetchEngine.from_pretrained(path, device="cuda", **kwargs)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    assert (cpu.forward(ids) - cuda.forward(ids).cpu()).abs().max().item() < 1e-3
    result = cuda.generate([[3, 4, 5], [6, 7]], max_new_tokens=8, stop_at_eos=False)
    assert result.stats.to_dict()["bytes_h2d"] % cuda.runtime.expert_bytes == 0
    stats = cuda.memory_stats()
    assert stats["host_pinned_bytes"] == stats["host_expert_bytes"]
    assert cuda.runtime.expert_bytes < 0.3 * 3 * 64 * 32 * 4  # about a quarter of the fp32 record
