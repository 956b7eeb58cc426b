"""Prefill's routed experts (residency/prefill.py) and its windows (runner.forward_window): the same tokens and bits
as the per-expert loop and as chunks one at a time, whichever kernel computes them, wherever the experts sit."""

from __future__ import annotations

import pytest
import torch

from conftest import full_only, gpu
from moeprefetch import MoEPrefetchEngine
from moeprefetch.runner import KVCaches


@pytest.mark.parametrize("slots", [None, 5])
def test_a_prefill_window_computes_the_bits_of_its_chunks_one_by_one(checkpoint_factory, slots):
    """A window runs its chunks layer by layer together (each chunk's kernels keep their shapes): the same hidden
    states, bit for bit, as the chunks one at a time; offloaded, each used expert crosses once per window instead of
    once per chunk; the MTP head's window as well (the MTP predictor drafts with it)."""
    import dataclasses

    path = checkpoint_factory("v3_groups_qlora_yarn")
    options = dict(progress=False, prefill_chunk=4) | (dict(expert_cache_slots=slots) if slots else {})
    engine = MoEPrefetchEngine.from_pretrained(path, **options)
    assert engine.options.prefill_window > 4 and engine.options.prefill_window % 4 == 0
    prompt = torch.randint(0, engine.args.vocab_size, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    tokens = torch.tensor([prompt])
    starts = [0, 4, 8, 12]
    pieces = [tokens[:, s : s + 4] for s in starts]
    positions = [torch.arange(s, s + p.shape[1])[None] for s, p in zip(starts, pieces)]
    hidden = []
    for window in (True, False):
        res = engine.residency
        res.configure()
        res.begin_call()
        caches = KVCaches.allocate(engine.args, 1, engine.options.max_seq_len, torch.float32, engine.device, False)
        res.begin_step(decode=False)
        if window:
            hidden.append(engine.runner.forward_window(pieces, positions, caches, 0, starts))
        else:
            hidden.append([engine.runner.forward_block(p, q, caches, 0, s) for p, q, s in zip(pieces, positions,
                                                                                              starts)])
        res.end_call()
    assert all(torch.equal(a, b) for a, b in zip(*hidden))

    windowed = engine.generate([prompt], max_new_tokens=6, stop_at_eos=False, predictor="mtp+next_layer_gate")
    engine.options = dataclasses.replace(engine.options, prefill_window=4)  # one chunk per window: as before
    engine.reset_expert_cache()
    chunked = engine.generate([prompt], max_new_tokens=6, stop_at_eos=False, predictor="mtp+next_layer_gate")
    assert windowed.sequences == chunked.sequences
    moved = [r.stats.to_dict()["prefill_bytes_h2d"] for r in (windowed, chunked)]
    assert (moved[0] < moved[1]) if slots else (moved == [0, 0])


def _prefill_together_and_alone(engine: MoEPrefetchEngine, prompts: list[list[int]],
                                before_alone=None) -> tuple[list, list, list]:
    """The prompts' hidden states, cache rows and expert records read from host: packed into shared windows
    (`session.prefill_rows`), then one prompt at a time (`prefill_row_windows`; `before_alone()` first), each from a
    cold cache."""
    from moeprefetch.residency.state import C
    from moeprefetch.session import prefill_row_windows, prefill_rows, run_through

    res = engine.residency
    hidden, caches, moved = [], [], []
    for together in (True, False):
        res.configure()
        res.begin_call()
        res.reset()
        cache = KVCaches.allocate(engine.args, len(prompts), engine.options.max_seq_len, engine.options.dtype,
                                  engine.device, False)
        if together:
            hidden.append(prefill_rows(engine, cache, prompts))
        else:
            if before_alone is not None:
                before_alone()
            hidden.append([run_through(prefill_row_windows(engine, cache, b, p)) for b, p in enumerate(prompts)])
        counters = res.end_call()
        caches.append(cache)
        moved.append(int(counters[:, C["zero_copy"]].sum() + counters[:, C["fills_done"]].sum()))
    return hidden, caches, moved


ON_GPU = dict(device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("variant,slots,device", [
    ("v3_groups_qlora_yarn", 5, {}), ("mixtral_window", None, {}), full_only("qwen3", 6, {}),
    full_only("v3", None, {}), pytest.param("v3_groups_qlora_yarn", 5, ON_GPU, marks=[gpu, pytest.mark.gpu]),
    pytest.param("qwen3", None, ON_GPU, marks=[gpu, pytest.mark.gpu])])
def test_prompts_that_share_prefill_windows_keep_the_bits_each_gets_alone(checkpoint_factory, variant, slots, device):
    """`session.prefill_rows`: several prompts' chunks packed in order into shared windows of 8 tokens (a prompt
    across two windows, two or three prompts in one) give each prompt the final hidden states and cache row it gets
    alone, bit for bit (MLA and grouped-query attention, every expert cached or 5-6 slots; on CUDA in bf16 too, where
    a routed expert's GEMM over a window's tokens must give each token the bits of its own chunk's GEMM)."""
    path = checkpoint_factory(variant)
    options = dict(progress=False, prefill_chunk=4, prefill_window=8, **device) | (
        dict(expert_cache_slots=slots) if slots else {})
    engine = MoEPrefetchEngine.from_pretrained(path, **options)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, engine.args.vocab_size, (n,), generator=g).tolist() for n in (7, 3, 10, 1, 5)]
    hidden, caches, _ = _prefill_together_and_alone(engine, prompts)
    assert all(torch.equal(a, b) for a, b in zip(*hidden))
    assert [h.shape[0] for h in hidden[0]] == [len(p) for p in prompts]
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert vars(a).keys() == vars(b).keys() and all(torch.equal(vars(a)[n], vars(b)[n]) for n in vars(a))


@pytest.mark.parametrize("expert_dtype,device", [
    ("int4", {}), full_only("model", {}), pytest.param("int4", ON_GPU, marks=[gpu, pytest.mark.gpu]),
    pytest.param("fp8", ON_GPU, marks=[gpu, pytest.mark.gpu])])
def test_chunks_joined_in_one_grouped_launch_keep_the_bits_each_gets_alone(checkpoint_factory, expert_dtype, device):
    """Every expert resident, Triton's grouped kernel (quantized experts on CUDA; here also in its interpreter): a
    window's chunks that take the same tiles run in one launch, up to a chunk's tokens, and each prompt still gets
    the hidden states and cache rows it gets alone (each chunk in its own launch), bit for bit; a launch never holds
    more than the joint limit."""
    from moeprefetch.kernels import HAS_TRITON
    from moeprefetch.kernels.grouped import GroupedExperts

    if not HAS_TRITON:
        pytest.skip("needs triton")
    if not device and torch.cuda.is_available():  # the interpreter is on only where CUDA is not (conftest)
        pytest.skip("runs the grouped kernel on CPU tensors (interpreter); the CUDA parameters run it for real")
    int4 = dict(int4_group_size=16) if expert_dtype == "int4" else {}
    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory("v3_groups_qlora_yarn"), progress=False,
                                               prefill_chunk=4, prefill_window=16, expert_dtype=expert_dtype,
                                               **int4, **device)
    res = engine.residency
    if engine.device.type == "cpu":  # the CPU runs the loop unless told otherwise
        res.grouped = GroupedExperts(res.fmt, res.slots_and_staging, res.host, engine.args.hidden_act, res.act,
                                     use_kernels=True)
    assert res.preloaded and res.grouped.use_kernels and not res.grouped_mm
    prefill = res._prefill
    assert prefill.joint_tokens == 4  # the engine's prefill chunk
    prefill.joint_tokens = 12
    launched: list[list[int]] = [[]]  # tokens per launch: together, then (chunk_by_chunk) alone
    one = prefill._in_place
    prefill._in_place = lambda position, x, *rest: (launched[-1].append(x.shape[0]), one(position, x, *rest))[1]

    def chunk_by_chunk():
        prefill.joint_tokens = None  # the baseline: each chunk in its own launch, as before joint launches
        launched.append([])

    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, engine.args.vocab_size, (n,), generator=g).tolist() for n in (7, 3, 10, 1, 5, 2)]
    hidden, caches, _ = _prefill_together_and_alone(engine, prompts, before_alone=chunk_by_chunk)
    assert all(torch.equal(a, b) for a, b in zip(*hidden))
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert all(torch.equal(vars(a)[n], vars(b)[n]) for n in vars(a))
    together, alone = launched
    assert 4 < max(together) <= 12 and max(alone) <= 4  # chunks joined within the limit; alone, one chunk each
    engine.close()


@pytest.mark.parametrize("variant", ["v3_groups_qlora_yarn", full_only("qwen3")])
def test_prompts_in_one_prefill_window_read_each_expert_once(checkpoint_factory, variant):
    """Five short prompts in one window (64 tokens a window, 26 in all) read each expert the window uses from host
    once, where one prompt at a time read some again after a 5-slot cache had evicted them: fewer records cross."""
    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory(variant), progress=False, prefill_chunk=4,
                                               prefill_window=64, expert_cache_slots=5)
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, engine.args.vocab_size, (n,), generator=g).tolist() for n in (7, 3, 10, 1, 5)]
    hidden, _, moved = _prefill_together_and_alone(engine, prompts)
    assert all(torch.equal(a, b) for a, b in zip(*hidden))
    assert 0 < moved[0] < moved[1]


@pytest.mark.parametrize("kernel,slots,stage_batch,long_blocks,expert_dtype", [
    ("grouped_mm", None, None, False, "model"), full_only("grouped_mm", 5, None, False, "model"),
    full_only("grouped_mm", 5, 1, False, "model"), ("grouped_mm", 3, 2, False, "model"),
    full_only("grouped_mm", 12, 3, False, "model"), full_only("triton", None, None, False, "model"),
    full_only("triton", 5, None, False, "model"), ("triton", 5, 1, False, "model"), full_only("triton", 3, 2, False, "model"),
    full_only("triton", 5, 1, True, "model"), ("triton", 5, 2, False, "int8")])
def test_prefill_grouped_gemms_match_the_loop(checkpoint_factory, kernel, slots, stage_batch, long_blocks,
                                              expert_dtype):
    """Prefill's experts as grouped GEMMs against the per-expert loop that the CPU runs: `torch._grouped_mm` (what a
    Hopper GPU runs for bf16 experts; here on the CPU in fp32) and the Triton kernel (in Triton's interpreter), with
    its 64-pair blocks of short chunks and the 128-pair blocks of long ones. Every expert resident (a layer's
    consecutive slots), and staged from slots and from host memory, in one batch or in many that reuse the staging
    halves, with admissions written into their slots; the long prompt uses every expert of a layer, so the next
    layer's experts are copied ahead of its router. Quantized experts (int8 blocks) take the Triton kernel on CUDA,
    staged the same way."""
    from moeprefetch.kernels import HAS_TRITON
    from moeprefetch.kernels.grouped import LONG_BLOCK_TILES, GroupedExperts

    if kernel == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    if kernel == "triton" and not HAS_TRITON:
        pytest.skip("needs triton")
    path = checkpoint_factory("v3_groups_qlora_yarn")
    options = dict(progress=False, expert_dtype=expert_dtype) | (dict(expert_cache_slots=slots) if slots else {})
    prompts = [list(range(3, 70)), [9, 10]]
    engine = MoEPrefetchEngine.from_pretrained(path, **options)
    expected = engine.generate(prompts, max_new_tokens=5, stop_at_eos=False)
    expected_logits = engine.forward([prompts[0]])
    res = engine.residency
    assert not res.grouped_mm and not res.grouped.use_kernels  # the CPU runs the loop unless told otherwise
    if kernel == "grouped_mm":
        res.grouped_mm = True
    else:
        res.grouped = GroupedExperts(res.fmt, res.slots_and_staging, res.host, engine.args.hidden_act, res.act,
                                     use_kernels=True, tiles=LONG_BLOCK_TILES if long_blocks else None)
    if stage_batch:
        res.stage_batch = stage_batch
    engine.reset_expert_cache()
    got = engine.generate(prompts, max_new_tokens=5, stop_at_eos=False)
    logits = engine.forward([prompts[0]])
    assert got.sequences == expected.sequences
    stats = got.stats.to_dict()
    unused_ahead = stats["prefill_experts_ahead_unused"] * stats["expert_bytes"]  # the loop copies nothing ahead
    assert stats["prefill_bytes_h2d"] == expected.stats.to_dict()["prefill_bytes_h2d"] + unused_ahead
    assert (stats["prefill_experts_ahead"] > 0) == bool(slots)  # all resident: nothing crosses, nothing ahead
    assert 0 <= stats["prefill_experts_ahead_unused"] <= stats["prefill_experts_ahead"]
    if slots:  # experts crossed through the staging rows (on the CPU a copy counts as a wait)
        assert stats["prefill_stall_seconds"] > 0
    assert torch.allclose(logits, expected_logits, rtol=1e-4, atol=1e-5)
    assert not res.problems()
