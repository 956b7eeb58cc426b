"""GPU-only checks (skipped without CUDA): the device-driven decode gives the all-resident tokens at every cache size,
predictor and batch; it synchronises once per token, never per layer; fills racing the compute never expose a
half-written slot; closing an engine gives its memory back."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from conftest import LEARNED_ROWS, gpu, serve_in_turn
from moeprefetch import MoEPrefetchEngine

pytestmark = [gpu, pytest.mark.gpu]

PREDICTORS = ("none", "mtp", "next_layer_gate", "oracle", "mtp+next_layer_gate", "mtp_router", "previous",
              "oracle_next")


@pytest.mark.parametrize("batch", [1, 4])
def test_engine_tokens_identical_across_cache_sizes_on_gpu(checkpoint_factory, batch):
    path = checkpoint_factory("v3")
    prompts = [[3, 4, 5, 6], [9, 10], [11], [12, 13, 14]][:batch]
    reference = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16)
    expected = reference.generate(prompts, max_new_tokens=16, stop_at_eos=False)
    logits = reference.forward([[3, 4, 5, 6]])
    total = reference.plan.total_experts
    reference.close()
    # batch 4 at fewer sizes: every new (slots, predictor) pair captures graphs and the suite must fit one device call
    for slots in (2, 5, total // 2, total) if batch == 1 else (2, total // 2):
        for policy in ("lrfu", "lru") if batch == 1 else ("lrfu",):
            engine = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16,
                                                       expert_cache_slots=slots, policy=policy)
            for predictor in PREDICTORS:
                result = engine.generate(prompts, max_new_tokens=16, stop_at_eos=False, predictor=predictor)
                assert result.sequences == expected.sequences, (slots, policy, predictor)
                stats = result.stats.to_dict()
                assert stats["hits"] + stats["misses"] == stats["expert_uses"]
                assert stats["syncs_per_token"] <= 1.0
                assert not engine.residency.problems()
            assert torch.equal(engine.forward([[3, 4, 5, 6]]), logits)
            spec = engine.generate(prompts, max_new_tokens=16, stop_at_eos=False, speculative="mtp")
            assert spec.sequences == expected.sequences
            engine.close()



def test_drafts_below_verify_confidence_keep_the_tokens_on_gpu():
    """speculative='mtp' with verify_confidence on the GPU (the plan kernels mask the unchecked draft rows): the
    tokens are plain decode's at every cut, fewer drafts are checked at a higher cut, and they move fewer bytes.
    The shipped reference model, whose trained MTP head spreads its drafts' probabilities over (0, 1)."""
    import dataclasses

    import moeprefetch

    path = Path(moeprefetch.__file__).parent / "reference_model"
    prompts = [[5, 17, 29, 41, 53, 65, 77, 89], [7, 11, 13]]
    with MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16) as resident:
        expected = resident.generate(prompts, max_new_tokens=24, stop_at_eos=False).sequences
        total = resident.plan.total_experts
    with MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16,
                                           expert_cache_slots=total // 4) as engine:
        runs = {}
        for cut in (0.0, 0.5, 1.0):
            engine.options = dataclasses.replace(engine.options, verify_confidence=cut)
            engine.reset_expert_cache(forget_routing=True)
            result = engine.generate(prompts, max_new_tokens=24, stop_at_eos=False, speculative="mtp")
            assert result.sequences == expected, cut
            runs[cut] = result.stats.to_dict()
            assert runs[cut]["syncs_per_token"] <= 1.0 and not engine.residency.problems()
        checked = [runs[cut]["draft_proposed"] for cut in (0.0, 0.5, 1.0)]
        assert checked[0] > checked[1] > checked[2] >= 0, checked
        assert runs[1.0]["decode_bytes_h2d_per_token"] < runs[0.0]["decode_bytes_h2d_per_token"]

@pytest.mark.parametrize("draft_tokens,verify_rows", [(2, "separate"), (3, "separate"), (1, "shared"), (3, "shared")])
def test_chained_drafts_keep_the_tokens_on_gpu(draft_tokens, verify_rows):
    """speculative='mtp' with draft_tokens > 1 on the GPU (3 and 4 rows a sequence through the fused attention,
    plan and expert kernels; the rows kept found on the device): greedy and sampled tokens are plain decode's
    resident and offloaded, and every generated token is a live row's sampled one or a kept draft's. With
    verify_rows='shared' (every step one batch of 1 + draft_tokens rows a sequence, cuBLAS shapes included) the
    MTP shadow row's steps keep them too."""
    import moeprefetch

    path = Path(moeprefetch.__file__).parent / "reference_model"
    prompts = [[5, 17, 29, 41, 53, 65, 77, 89], [7, 11, 13]]
    sampling = [dict(), dict(temperature=0.8, seed=3)]
    options = dict(device="cuda", dtype=torch.bfloat16, draft_tokens=draft_tokens, verify_rows=verify_rows)
    with MoEPrefetchEngine.from_pretrained(path, **options) as resident:
        expected = [resident.generate(prompts, max_new_tokens=24, stop_at_eos=False, **kw).sequences
                    for kw in sampling]
        total = resident.plan.total_experts
    for slots in (None, total // 4):
        sized = {} if slots is None else dict(expert_cache_slots=slots)
        with MoEPrefetchEngine.from_pretrained(path, **options, **sized) as engine:
            for kw, tokens in zip(sampling, expected):
                result = engine.generate(prompts, max_new_tokens=24, stop_at_eos=False, speculative="mtp", **kw)
                assert result.sequences == tokens, (slots, kw)
                stats = result.stats.to_dict()
                assert stats["generated_tokens"] == len(prompts) + stats["draft_offered"] + stats["draft_accepted"]
                assert len(stats["draft_acceptance_by_position"]) == draft_tokens
                assert stats["syncs_per_token"] <= 1.0 and not engine.residency.problems()
                if verify_rows == "shared":
                    shadow = engine.generate(prompts, max_new_tokens=24, stop_at_eos=False, predictor="mtp", **kw)
                    assert shadow.sequences == tokens, (slots, kw, "shadow")


def test_offloaded_decode_never_synchronises_inside_a_step(checkpoint_factory, monkeypatch):
    """Everything between a step's upload and its one read-back runs without a device->host synchronisation: any
    synchronising call in the step (a per-layer read of the routing, say) raises under the sync debug mode."""
    from moeprefetch import decode

    path = checkpoint_factory("v3")
    engine = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, expert_cache_slots=5)
    original = decode.DecodeStep._run
    steps = {"n": 0}

    def guarded(self):
        torch.cuda.set_sync_debug_mode("error")
        try:
            original(self)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        steps["n"] += 1

    monkeypatch.setattr(decode.DecodeStep, "_run", guarded)
    for predictor in ("none", "mtp+next_layer_gate", "oracle"):
        result = engine.generate([[3, 4, 5]], max_new_tokens=12, stop_at_eos=False, predictor=predictor)
        stats = result.stats
        assert stats.decode_syncs == stats.decode_steps and stats.to_dict()["syncs_per_token"] == 1.0
    assert steps["n"] >= 30
    assert any(step.captured for step in engine._steps.values())


def test_fills_racing_the_compute_never_expose_a_half_written_slot(checkpoint_factory):
    """A tiny cache and aggressive prefetching: fills land while layers read the pool, for many steps."""
    path = checkpoint_factory("v3", max_position_embeddings=1024)
    prompts = [[3, 4, 5], [7, 8]]
    expected = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, max_seq_len=1024).generate(
        prompts, max_new_tokens=400, stop_at_eos=False).sequences
    engine = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, expert_cache_slots=4,
                                               max_seq_len=1024, prefetch_budget=3.0, max_inflight_experts=8)
    for predictor in ("mtp+next_layer_gate", "oracle", "previous+next_layer_gate"):
        result = engine.generate(prompts, max_new_tokens=400, stop_at_eos=False, predictor=predictor)
        assert result.sequences == expected, predictor
        stats = result.stats.to_dict()
        assert stats["fill_bytes"] > 0 and stats["prefetch_issued"] > 0
        assert not engine.residency.problems()


def test_late_fills_of_real_sized_records_publish_whole_copies(tmp_path):
    """The residency table alone (`scripts/table_stress.py`), routed by 128 tokens of the real V2-Lite trace: 26 MoE
    layers of 64 FP8 experts of V2-Lite's shape (133 chunks a record) at 1,040 slots, the oracles' fills on a busy
    link (also yielding it to host reads), hundreds of them late: every expert product of every layer equals
    all-resident's and no published slot differs from its record. With each warp of a fill program reading the main
    stream's clock on its own, 3 of 4 such runs had wrong products (1-17; BENCHMARKS "The fill kernel's torn
    chunks"); on skewed random routing of 8 layers, none of 6 did, hence the real trace."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "stress.json"
    done = subprocess.run([sys.executable, str(root / "scripts" / "table_stress.py"), "--out", str(out), "--trace",
                           str(root / "tests" / "data" / "nvmoe-dsv2lite-a.first128.tokens.jsonl"), "--expert-dtype",
                           "fp8", "--slots", "1040", "--tokens", "128", "--runs",
                           "oracle,oracle:reread,oracle_next:spare0:idle", "--repeats", "2"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in json.loads(out.read_text())["rows"] if r["run"] != "all_resident"]
    assert len(rows) == 6
    for row in rows:
        assert row["wrong"] == 0 and row["wrong_layer_outputs"] == 0 and row["corrupt_slots"] == 0, row["run"]
        assert row["checked"] == 128 * 26 * 6, row["run"]  # every step's six experts of every layer
        assert row["counters"]["late"] > 0, row["run"]  # fills were late: the path that tore them ran


def test_idle_link_fills_fill_cuts_and_forced_routing_keep_the_tokens_on_gpu(checkpoint_factory, tmp_path):
    """Fills that yield the link to host reads (`fill_link="idle"`), a fill cut above the protection cut, the
    one-token oracle, and decode routing forced from a trace (in the step's graph): tokens of every expert resident,
    one synchronisation per token."""
    from moeprefetch.traces import write_trace

    path = checkpoint_factory("v3", max_position_embeddings=1024)
    prompts = [[3, 4, 5], [7, 8]]
    resident = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, max_seq_len=1024)
    expected = resident.generate(prompts, max_new_tokens=200, stop_at_eos=False).sequences
    moe, n, k = resident.args.moe_layers, resident.args.n_routed_experts, resident.args.num_experts_per_tok
    g = torch.Generator().manual_seed(0)
    write_trace(tmp_path / "t.jsonl", moe, torch.stack([torch.stack([torch.randperm(n, generator=g)[:k] for _ in moe])
                                                        for _ in range(40)]))
    resident.close()
    engine = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, expert_cache_slots=4,
                                               max_seq_len=1024, prefetch_budget=3.0, max_inflight_experts=8,
                                               fill_link="idle", fill_confidence=0.3, spare_recent=0)
    for predictor in ("oracle_next", "mtp+next_layer_gate", "oracle"):
        result = engine.generate(prompts, max_new_tokens=200, stop_at_eos=False, predictor=predictor)
        assert result.sequences == expected, predictor
        stats = result.stats.to_dict()
        assert stats["prefetch_issued"] > 0 and stats["syncs_per_token"] <= 1.0
        assert not engine.residency.problems()
    engine.close()
    forced = []
    for slots in (None, 3, 7):
        options = dict(expert_cache_slots=slots, fill_link="idle") if slots else {}
        engine = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, max_seq_len=1024,
                                                   routing_trace=str(tmp_path / "t.jsonl"), **options)
        for predictor in ("oracle_next", "oracle") if slots else ("none",):
            forced.append(engine.generate(prompts, max_new_tokens=60, stop_at_eos=False,
                                          predictor=predictor).sequences)
        assert all(step.captured for step in engine._steps.values())
        engine.close()
    assert all(f == forced[0] for f in forced)


def test_gpu_matches_cpu_in_fp32(checkpoint_factory):
    path = checkpoint_factory("v3_groups_qlora_yarn")
    cpu = MoEPrefetchEngine.from_pretrained(path)
    cuda = MoEPrefetchEngine.from_pretrained(path, device="cuda", expert_cache_slots=6)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    assert (cpu.forward(ids) - cuda.forward(ids).cpu()).abs().max().item() < 1e-3
    assert cpu.generate([[3, 4, 5]], max_new_tokens=8, stop_at_eos=False).sequences == \
        cuda.generate([[3, 4, 5]], max_new_tokens=8, stop_at_eos=False).sequences
    assert cuda.memory_stats()["host_pinned_bytes"] == cuda.memory_stats()["host_expert_bytes"] > 0


def test_cuda_graphs_change_nothing(checkpoint_factory):
    """A captured step replays exactly what the eager step computes (offloaded and all-resident)."""
    path = checkpoint_factory("v3")
    prompts = [[3, 4, 5, 6], [9, 10]]
    for slots in (None, 5):
        runs = []
        for graphs in (False, True):
            engine = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16,
                                                       expert_cache_slots=slots, cuda_graphs=graphs)
            runs.append(engine.generate(prompts, max_new_tokens=12, stop_at_eos=False, predictor="mtp").sequences)
            runs.append(engine.generate(prompts, max_new_tokens=12, stop_at_eos=False, speculative="mtp").sequences)
            if graphs:
                assert all(step.captured for step in engine._steps.values())
            engine.close()
        assert runs[0] == runs[1] == runs[2] == runs[3]


@pytest.mark.parametrize("expert_dtype", ["fp8", "int8", "int4"])
def test_dequantisation_on_the_gpu_matches_the_cpu(checkpoint_factory, expert_dtype):
    """Compressed experts travel as FP8/int8 and are dequantised inside the expert kernel; the result matches the
    CPU's dequantisation of the same bytes, and host RAM holds the compact records."""
    path = checkpoint_factory("v3_groups_qlora_yarn")
    kwargs = dict(expert_dtype=expert_dtype, expert_cache_slots=12)
    cpu = MoEPrefetchEngine.from_pretrained(path, **kwargs)
    cuda = MoEPrefetchEngine.from_pretrained(path, device="cuda", **kwargs)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    assert (cpu.forward(ids) - cuda.forward(ids).cpu()).abs().max().item() < 1e-3
    result = cuda.generate([[3, 4, 5], [6, 7]], max_new_tokens=8, stop_at_eos=False)
    assert result.stats.to_dict()["zero_copy_bytes"] % cuda.residency.expert_bytes == 0
    stats = cuda.memory_stats()
    assert stats["host_pinned_bytes"] == stats["host_expert_bytes"]
    assert cuda.residency.expert_bytes < 0.3 * 3 * 64 * 32 * 4  # about a quarter of the fp32 record


@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_experts_keep_their_tokens_at_every_cache_size_on_gpu(checkpoint_factory, symmetric):
    """Within the int4 format on the GPU (compiled kernels, graphs, zero-copy reads of packed records, admissions,
    fills), cache sizes, policies and predictors change speed, never tokens."""
    path = checkpoint_factory("v3")
    prompts = [[3, 4, 5, 6], [9, 10]]
    options = dict(device="cuda", dtype=torch.bfloat16, expert_dtype="int4", int4_group_size=16,
                   int4_symmetric=symmetric)
    with MoEPrefetchEngine.from_pretrained(path, **options) as reference:
        expected = reference.generate(prompts, max_new_tokens=16, stop_at_eos=False).sequences
        logits = reference.forward([[3, 4, 5, 6]])
        total = reference.plan.total_experts
    for slots in (2, 5, total // 2):
        with MoEPrefetchEngine.from_pretrained(path, expert_cache_slots=slots, **options) as engine:
            for predictor in ("none", "next_layer_gate", "mtp+next_layer_gate", "oracle"):
                result = engine.generate(prompts, max_new_tokens=16, stop_at_eos=False, predictor=predictor)
                assert result.sequences == expected, (slots, predictor)
                assert not engine.residency.problems()
            assert torch.equal(engine.forward([[3, 4, 5, 6]]), logits)


def test_close_gives_device_memory_back(checkpoint_factory):
    path = checkpoint_factory("v3")
    gc.collect()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    for _ in range(2):
        engine = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, expert_cache_slots=5)
        engine.generate([[3, 4, 5]], max_new_tokens=8, stop_at_eos=False, predictor="mtp+next_layer_gate")
        assert torch.cuda.memory_allocated() > baseline
        pinned = engine.memory_stats()["host_pinned_bytes"]
        assert pinned > 0
        engine.close()
        assert torch.cuda.memory_allocated() - baseline < 1 << 20, torch.cuda.memory_allocated() - baseline
        with pytest.raises(Exception, match="has been closed"):
            engine.generate([[3]], max_new_tokens=2)
    del engine


def test_an_unpinned_store_falls_back_to_the_reference_residency(checkpoint_factory):
    """pin_memory=False (or a refused page-lock) leaves host memory the GPU cannot read in place: the engine must
    switch to the host-driven residency path, not hand pageable addresses to the kernels."""
    path = checkpoint_factory("v3")
    prompts = [[3, 4, 5, 6], [9, 10]]
    reference = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16)
    expected = reference.generate(prompts, max_new_tokens=8, stop_at_eos=False)
    reference.close()
    engine = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, expert_cache_slots=3,
                                               pin_memory=False)
    assert not engine.residency.use_kernels and not engine.residency.grouped.use_kernels
    assert engine.generate(prompts, max_new_tokens=8, stop_at_eos=False).sequences == expected.sequences
    engine.close()


def test_fused_decode_logits_track_the_definitions_in_bf16(checkpoint_factory):
    """The stated tolerance of the fused decode kernels in bf16: the first decode step's logits (same prompt, same
    prefill) within 3 % relative norm of the torch definitions' (fp32 stays within 1e-5: test_layer_ops)."""
    path = checkpoint_factory("v3_groups_qlora_yarn")
    logits = []
    for fused in (False, True):
        engine = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, fused_kernels=fused)
        engine.generate([[3, 4, 5, 6, 7]], max_new_tokens=2, stop_at_eos=False)
        (step,) = engine._steps.values()
        logits.append(step.logits.clone())
        engine.close()
    error = ((logits[1] - logits[0]).norm() / logits[0].norm()).item()
    assert error < 3e-2, error


def test_rereading_late_prefetches_keeps_the_tokens_on_gpu(checkpoint_factory):
    """late_prefetch="reread" on the device (the default waits: the await kernel polls the ready flags while the
    fill kernel copies beside it): late experts are read from host again; tokens and table invariants unchanged."""
    path = checkpoint_factory("v3")
    prompts = [[3, 4, 5, 6], [9, 10]]
    reference = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16)
    expected = reference.generate(prompts, max_new_tokens=24, stop_at_eos=False).sequences
    reference.close()
    for slots in (3, 6):
        engine = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, expert_cache_slots=slots,
                                                   late_prefetch="reread")
        for predictor in ("oracle", "mtp+next_layer_gate"):
            result = engine.generate(prompts, max_new_tokens=24, stop_at_eos=False, predictor=predictor)
            assert result.sequences == expected, (slots, predictor)
            stats = result.stats.to_dict()
            assert stats["hits"] + stats["misses"] == stats["expert_uses"]
            assert stats["prefetch_issued"] == stats["prefetch_useful"] + stats["prefetch_late"] + stats["prefetch_wasted"]
            assert stats["syncs_per_token"] <= 1.0 and not engine.residency.problems()
        engine.close()


def test_the_oracle_planning_steps_ahead_keeps_the_tokens_on_gpu(checkpoint_factory):
    """lookahead 2 and 3 give the plan kernel a window of several steps (ring 3 and 4): the kernel's earliest-need
    dedup across steps runs only there. Same tokens at every size, batch 1 and 2, prefetches land earlier."""
    path = checkpoint_factory("v3")
    prompts = [[3, 4, 5, 6], [9, 10]]
    reference = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16)
    expected = {b: reference.generate(prompts[:b], max_new_tokens=20, stop_at_eos=False).sequences for b in (1, 2)}
    total = reference.plan.total_experts
    reference.close()
    for slots in (3, 6, total // 2):  # no prefetch_lead: the window's later steps are reserved too
        engine = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, expert_cache_slots=slots,
                                                   prefetch_lead=0)
        for lookahead in (2, 3):
            for batch in (1, 2):
                result = engine.generate(prompts[:batch], max_new_tokens=20, stop_at_eos=False, predictor="oracle",
                                         lookahead=lookahead)
                assert result.sequences == expected[batch], (slots, lookahead, batch)
                stats = result.stats.to_dict()
                assert stats["hits"] + stats["misses"] == stats["expert_uses"]
                assert stats["prefetch_issued"] == \
                    stats["prefetch_useful"] + stats["prefetch_late"] + stats["prefetch_wasted"]
                assert stats["syncs_per_token"] <= 1.0 and not engine.residency.problems()
        engine.close()


@pytest.mark.parametrize("kernel", ["grouped_mm", "triton"])
def test_prefill_staging_batches_on_the_copy_engine_keep_the_tokens(checkpoint_factory, kernel):
    """Long prompts and a tiny cache: most of a prefill window's experts find no slot and cross through the staging
    rows on the copy stream, one expert per batch, each batch reusing a half the batch before last computed from;
    the bits of the all-resident engine, with CUTLASS grouped GEMMs (bf16 on Hopper) and with the Triton kernel; and
    a window of several chunks gives the bits of its chunks one at a time."""
    import dataclasses

    path = checkpoint_factory("v3", max_position_embeddings=1024)
    prompts = [list(range(3, 200)), list(range(7, 90))]
    reference = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, max_seq_len=512,
                                                  prefill_chunk=64)
    if kernel == "grouped_mm" and not reference.residency.grouped_mm:
        pytest.skip("no torch._grouped_mm for bf16 on this GPU")
    reference.residency.grouped_mm = kernel == "grouped_mm"
    expected = reference.generate(prompts, max_new_tokens=6, stop_at_eos=False).sequences
    expected_logits = reference.forward([prompts[0]])
    reference.close()
    for batch, window in ((1, None), (None, None), (None, 64)):
        engine = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, max_seq_len=512,
                                                   expert_cache_slots=3, prefill_chunk=64)
        res = engine.residency
        assert res.grouped.use_kernels and engine.options.prefill_window == 512
        res.grouped_mm = kernel == "grouped_mm"
        if batch:
            res.stage_batch = batch
        if window:
            engine.options = dataclasses.replace(engine.options, prefill_window=window)
        result = engine.generate(prompts, max_new_tokens=6, stop_at_eos=False)
        assert result.sequences == expected, (batch, window)
        assert torch.equal(engine.forward([prompts[0]]), expected_logits), (batch, window)
        stats = result.stats.to_dict()
        assert stats["prefill_bytes_h2d"] > 0 and not res.problems()
        assert res.slots_and_staging[res.n_slots:].any()  # staging rows were written
        assert stats["prefill_stall_seconds"] >= 0
        engine.close()


def test_chunked_prefill_on_gpu_matches_cpu_in_fp32(checkpoint_factory):
    """Prompts longer than a chunk: later chunks attend to the cache through the lower-right causal bias on CUDA (a
    mask tensor on the CPU); the same tokens in fp32, and the same first decode step within 1e-3."""
    path = checkpoint_factory("v3_groups_qlora_yarn", max_position_embeddings=256)
    prompts = [list(range(3, 43)), list(range(50, 67))]
    runs = []
    for device in ("cpu", "cuda"):
        engine = MoEPrefetchEngine.from_pretrained(path, device=device, prefill_chunk=16, max_seq_len=128,
                                                   expert_cache_slots=6)
        result = engine.generate(prompts, max_new_tokens=6, stop_at_eos=False)
        (step,) = engine._steps.values()
        runs.append((result.sequences, step.logits.cpu()))
        engine.close()
    assert runs[0][0] == runs[1][0]
    assert (runs[0][1] - runs[1][1]).abs().max().item() < 1e-3


@pytest.mark.parametrize("hidden,intermediate", [(2048, 1408), (7168, 2048)])  # V2-Lite's and V3's experts
def test_grouped_mm_rows_do_not_depend_on_the_call(hidden, intermediate):
    """Prefill's experts as CUTLASS grouped GEMMs give every cache size the same bits only if a pair's result depends
    on its row and its expert alone: the same pairs in one call over a layer's consecutive slots (large tiles), in
    batches over copies of the records (other groupings), and a few rows per group (the small-tile kernel)."""
    from moeprefetch.expert_records import ExpertFormat
    from moeprefetch.kernels.grouped import grouped_mm_experts, grouped_mm_usable

    fmt = ExpertFormat.build(hidden, intermediate, torch.bfloat16)
    if not grouped_mm_usable(fmt, torch.device("cuda")):
        pytest.skip("no torch._grouped_mm for bf16 on this GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 8
    records = (torch.randn(n, fmt.record_bytes // 2, device="cuda", generator=g) * 0.02).bfloat16().view(torch.uint8)
    counts = torch.tensor([300, 0, 257, 129, 1, 512, 64, 200], dtype=torch.int32, device="cuda")
    x = torch.randn(int(counts.sum()), fmt.hidden, device="cuda", generator=g).bfloat16()
    act = torch.nn.functional.silu
    whole = grouped_mm_experts(x, counts, records, fmt, act)
    ends = torch.cumsum(counts, 0).tolist()
    starts = [0] + ends[:-1]
    copies = records.clone()  # other addresses, as staging rows
    for lo, hi in ((0, 3), (3, 4), (4, 8)):  # batches of consecutive groups
        got = grouped_mm_experts(x[starts[lo] : ends[hi - 1]], counts[lo:hi], copies[lo:hi], fmt, act)
        assert torch.equal(got, whole[starts[lo] : ends[hi - 1]]), (lo, hi)
    few = torch.clamp(counts, max=16)  # <= 128 rows per group: the small-tile kernel
    rows = torch.cat([torch.arange(s, s + int(c), device="cuda") for s, c in zip(starts, few.tolist())])
    assert torch.equal(grouped_mm_experts(x[rows], few, records, fmt, act), whole[rows])


def test_chained_mtp_drafts_keep_the_tokens_in_graphs(checkpoint_factory):
    """lookahead 2 and 3 chain the MTP head inside the captured step: the tokens of `none` at two cache sizes and two
    batches, one synchronisation per token, and a recall for every lead."""
    path = checkpoint_factory("v3")
    for prompts in ([[3, 4, 5, 6]], [[3, 4, 5, 6], [7, 8]]):
        reference = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, max_seq_len=128)
        expected = reference.generate(prompts, max_new_tokens=16, stop_at_eos=False).sequences
        reference.close()
        for slots in (3, 6):
            engine = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, max_seq_len=128,
                                                       expert_cache_slots=slots)
            for predictor in ("mtp", "mtp+next_layer_gate", "mtp_router"):
                for lookahead in (2, 3):
                    result = engine.generate(prompts, max_new_tokens=16, stop_at_eos=False, predictor=predictor,
                                             lookahead=lookahead)
                    assert result.sequences == expected, (slots, predictor, lookahead)
                    stats = result.stats.to_dict()
                    assert stats["syncs_per_token"] <= 1.0
                    assert len(stats["prediction_recall_by_lead"]) == lookahead
                    assert stats["prediction_recall_by_lead"][-1] > 0.0
            assert all(step.captured for step in engine._steps.values())
            assert not engine.residency.problems()
            engine.close()


def test_a_request_in_a_continuous_batch_gets_its_tokens_whoever_joins(checkpoint_factory):
    """On CUDA a row's bits depend on the step's shape (kernel tiles), not on the other rows: a request run alone
    through a batch-invariant ContinuousBatch of two rows gets the tokens it gets while others join and leave around
    it, offloaded with MTP prefetch and all-resident."""
    from moeprefetch.batching import ContinuousBatch
    from moeprefetch.sampling import SamplingParams

    path = checkpoint_factory("v3")
    requests = [([3, 4, 5, 6], 9, SamplingParams()), ([7, 8], 12, SamplingParams(temperature=0.8, seed=11)),
                ([9, 10, 11], 7, SamplingParams(temperature=1.1, top_k=5, seed=4)),
                ([12], 10, SamplingParams(temperature=0.9, top_p=0.7, seed=2))]

    for slots, predictor in ((None, "none"), (6, "mtp+next_layer_gate")):
        engine = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, max_seq_len=128,
                                                   max_batch_size=2, expert_cache_slots=slots)
        alone = {}
        for i in range(len(requests)):
            alone.update(serve_in_turn(ContinuousBatch(engine, predictor, batch_invariant=True), requests, [i]))
        together = serve_in_turn(ContinuousBatch(engine, predictor, batch_invariant=True), requests,
                                 range(len(requests)))
        assert together == alone, (slots, predictor)
        assert not engine.residency.problems()
        engine.close()


def test_requests_admitted_together_get_their_tokens_alone_on_gpu(checkpoint_factory):
    """`admit_together` on CUDA: three requests whose prompts share prefill windows (one prompt across two), then
    decoded in a batch-invariant batch of four rows, get the tokens each gets admitted alone (greedy and seeded;
    offloaded with MTP prefetch and all-resident): the shared windows' expert GEMMs keep each token's bits."""
    from moeprefetch.batching import ContinuousBatch
    from moeprefetch.sampling import SamplingParams

    path = checkpoint_factory("v3")
    requests = [([3, 4, 5, 6, 7, 8, 9], 6, SamplingParams()), ([7, 8], 9, SamplingParams(temperature=0.8, seed=11)),
                (list(range(9, 19)), 5, SamplingParams(temperature=1.1, top_k=5, seed=4))]
    for slots, predictor in ((None, "none"), (6, "mtp+next_layer_gate")):
        engine = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, max_seq_len=128,
                                                   max_batch_size=4, expert_cache_slots=slots, prefill_chunk=4,
                                                   prefill_window=8)
        alone = {}
        for i in range(len(requests)):
            alone.update(serve_in_turn(ContinuousBatch(engine, predictor, batch_invariant=True), requests, [i]))
        batch = ContinuousBatch(engine, predictor, batch_invariant=True)
        started = batch.admit_together([r + (frozenset(),) for r in requests])
        assert [first for _, first in started] == [alone[i][0] for i in range(len(requests))], (slots, predictor)
        got = {}
        while len(got) < len(started):
            batch.step()
            for i, (row, _) in enumerate(started):
                if i not in got and batch.finished(row):
                    got[i] = batch.state[row].generated
                    batch.release(row)
        assert got == alone, (slots, predictor)
        assert not engine.residency.problems()
        engine.close()


def test_a_lone_request_in_a_continuous_batch_gets_the_tokens_of_generate(checkpoint_factory):
    """A batch of 4 rows serving one request at a time runs one-row steps (`step_rows`), the shape generate runs for
    one prompt: its tokens are generate's on CUDA too, greedy and seeded, offloaded with prefetch and all-resident,
    and the batch captured its one-row step."""
    from moeprefetch.batching import ContinuousBatch
    from moeprefetch.sampling import SamplingParams

    path = checkpoint_factory("v3")
    requests = [([3, 4, 5, 6], 9, SamplingParams()), ([7, 8], 12, SamplingParams(temperature=0.8, seed=11)),
                ([9, 10, 11], 7, SamplingParams(temperature=1.1, top_k=5, seed=4))]
    for slots, predictor in ((None, "none"), (6, "next_layer_gate")):
        engine = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, max_seq_len=128,
                                                   max_batch_size=4, expert_cache_slots=slots)
        expected = [engine.generate([p], max_new_tokens=n, temperature=s.temperature, top_k=s.top_k,
                                    seed=s.seed, stop_at_eos=False, predictor=predictor).sequences[0]
                    for p, n, s in requests]
        batch = ContinuousBatch(engine, predictor)
        got = {}
        for i in range(len(requests)):
            got.update(serve_in_turn(batch, requests, [i]))
        assert [got[i] for i in range(len(requests))] == expected, (slots, predictor)
        assert batch.step_sizes == [1] and all(step.captured for step in batch.decode_steps)
        assert not engine.residency.problems()
        engine.close()


def test_the_learned_predictor_keeps_the_tokens_in_graphs():
    """predictor='learned' (the shipped reference head, 1 and 2 tokens ahead, alone and with the gate) captured in
    the step graphs: the all-resident tokens at every cache size, one synchronisation per token, and recall above
    'previous'."""
    reference = Path(__file__).resolve().parents[1] / "moeprefetch" / "reference_model"
    head = reference / "routing_head.safetensors"
    prompts = [[40, 41, 42, 43, 44, 45, 46, 47]]
    with MoEPrefetchEngine.from_pretrained(reference, device="cuda", dtype=torch.bfloat16) as resident:
        expected = resident.generate(prompts, max_new_tokens=24, stop_at_eos=False).sequences
    for slots, reuse, bypass in ((8, 0.9, False), (40, 0.0, True), (120, 0.9, True)):
        with MoEPrefetchEngine.from_pretrained(reference, device="cuda", dtype=torch.bfloat16,
                                               expert_cache_slots=slots, predictor_path=str(head),
                                               reuse_weight=reuse, bypass=bypass) as engine:
            recall = {}
            for predictor, lookahead in LEARNED_ROWS:
                result = engine.generate(prompts, max_new_tokens=24, stop_at_eos=False, predictor=predictor,
                                         lookahead=lookahead)
                assert result.sequences == expected, (slots, predictor, lookahead)
                stats = result.stats.to_dict()
                assert stats["syncs_per_token"] <= 1.0
                recall[(predictor, lookahead)] = stats["prediction_recall"]
                assert not engine.residency.problems()
            assert all(step.captured for step in engine._steps.values())
            assert recall[("learned", 1)] > recall[("previous", 1)]


def test_bias_penalties_and_logprobs_in_captured_steps_match_eager_and_every_cache_size(checkpoint_factory):
    """The adjusted draws and the log-probabilities inside captured graphs: the same tokens and log-probabilities as
    eager steps, at every cache size and predictor; greedy with bias and penalties picks the float64 reference's
    argmax over the engine's own uncached logits; a continuous batch's rows get generate's."""
    from conftest import reference_adjusted
    from moeprefetch.batching import ContinuousBatch
    from moeprefetch.sampling import SamplingParams

    path = checkpoint_factory("v3")
    prompts = [[3, 4, 5, 6], [9, 10]]
    bias = {7: 2.0, 4: -100.0}
    kwargs = dict(max_new_tokens=14, stop_at_eos=False, logit_bias=bias, presence_penalty=0.6,
                  frequency_penalty=0.4, logprobs=3)
    eager = MoEPrefetchEngine.from_pretrained(path, device="cuda", cuda_graphs=False)
    expected = eager.generate(prompts, **kwargs)
    sequence = prompts[0] + expected.sequences[0]
    logits = eager.forward([sequence])[0].cpu()
    eager.close()
    for i, token in enumerate(expected.sequences[0]):
        row = logits[len(prompts[0]) - 1 + i]
        assert token == int(reference_adjusted(row, sorted(bias.items()), 0.6, 0.4, expected.sequences[0][:i]).argmax())
        assert abs(expected.logprobs[0][i].logprob - float(row.double().log_softmax(-1)[token])) < 1e-4
    for slots in (None, 3, 7):
        engine = MoEPrefetchEngine.from_pretrained(path, device="cuda", expert_cache_slots=slots)
        for predictor in ("none", "mtp+next_layer_gate", "oracle"):
            got = engine.generate(prompts, predictor=predictor, **kwargs)
            assert got.sequences == expected.sequences, (slots, predictor)
            for a, b in zip(sum(got.logprobs, []), sum(expected.logprobs, [])):
                assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-5
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
            sampled = engine.generate(prompts, temperature=0.9, seed=5, predictor=predictor, **kwargs)
            assert 4 not in sum(sampled.sequences, [])
        assert all(step.captured for step in engine._steps.values())
        engine.close()
    engine = MoEPrefetchEngine.from_pretrained(path, device="cuda", max_seq_len=128, max_batch_size=2)
    alone = engine.generate([prompts[1]], **kwargs)
    batch = ContinuousBatch(engine)
    requests = [(prompts[0], 14, SamplingParams()),
                (prompts[1], 14, SamplingParams(logit_bias=tuple(sorted(bias.items())), presence_penalty=0.6,
                                                frequency_penalty=0.4, logprobs=3))]
    assert serve_in_turn(batch, requests, [1])[1] == alone.sequences[0]  # alone: generate's one-row step
    together = serve_in_turn(batch, requests, [0, 1])  # two rows, one adjusted: its bias holds
    assert 4 not in together[1] and len(together[0]) == 14
    assert any(kind[2] and kind[3] for kind in batch.step_kinds)
    engine.close()


def test_the_sampling_kernel_draws_the_references_tokens_at_a_real_vocabulary():
    """The one-pass Gumbel arg-max on the device against the reference's noise tensor and argmax at V2-Lite's
    vocabulary: 1,536 draws, every one the same token (the noise's logarithms round alike on both paths)."""
    from moeprefetch.kernels.sampling import gumbel_argmax, pcg

    vocab, rows = 102400, 512
    generator = torch.Generator(device="cuda").manual_seed(5)
    vocab_hash = pcg(torch.arange(vocab, dtype=torch.int64, device="cuda"))
    seeds = torch.randint(0, 2**32, (rows, 2), generator=generator, device="cuda")  # 32-bit words (`seed_halves`)
    for trial in range(3):
        scaled = torch.randn(rows, vocab, generator=generator, device="cuda") * (1.0 + trial)
        streams = torch.zeros(rows, dtype=torch.int64, device="cuda")
        positions = torch.randint(0, 4096, (rows,), generator=generator, device="cuda")
        expected = gumbel_argmax(scaled, vocab_hash, streams, positions, seeds[:, 0], seeds[:, 1], use_kernel=False)
        got = gumbel_argmax(scaled, vocab_hash, streams, positions, seeds[:, 0], seeds[:, 1], use_kernel=True)
        assert int((got != expected).sum()) == 0, trial
