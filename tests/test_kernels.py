"""kernels/: every Triton kernel against its reference (on the CPU through Triton's interpreter, on the GPU for real),
and a compile for Hopper (sm_90) that catches what the interpreter cannot."""

from __future__ import annotations

import zlib
from pathlib import Path
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from conftest import full_only
from moeprefetch.expert_records import ExpertFormat
from moeprefetch.kernels import HAS_TRITON
from moeprefetch.residency.state import E_ACTIVE, ResidencyConfig, TableState

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

if HAS_TRITON:
    import triton
    import triton.language as tl

    from moeprefetch.residency.plan_kernel import _clocks, _floats, _words

    @triton.jit
    def _mark_fields(words, clocks, floats, S, P: tl.constexpr, E: tl.constexpr, M: tl.constexpr, A: tl.constexpr,
                     NC: tl.constexpr):
        """Writes 1, 2, ... through each field pointer the plan kernels find in the table's buffers."""
        ints = _words(words, S, P, E, M, A)
        for i in tl.static_range(len(ints)):
            tl.store(ints[i], i + 1)
        longs = _clocks(clocks, S, P, M, NC)
        for i in tl.static_range(len(longs)):
            tl.store(longs[i], i + 1)
        reals = _floats(floats, P, E)
        for i in tl.static_range(len(reals)):
            tl.store(reals[i], i + 1.0)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


COMPILE_CHECK = Path(__file__).resolve().parent.parent / "scripts" / "compile_check.py"  # a tool, not the package


def _experts(fmt: ExpertFormat, count: int, generator: torch.Generator) -> tuple[torch.Tensor, list]:
    host = torch.zeros(count, fmt.record_bytes, dtype=torch.uint8)
    weights = []
    for e in range(count):
        w = (torch.randn(fmt.intermediate, fmt.hidden, generator=generator) * 0.1,
             torch.randn(fmt.intermediate, fmt.hidden, generator=generator) * 0.1,
             torch.randn(fmt.hidden, fmt.intermediate, generator=generator) * 0.1)
        fmt.pack(*w, host[e])
        weights.append(w)
    return host, weights


def _format(hidden: int, inter: int, dtype: torch.dtype, expert_dtype: str) -> ExpertFormat:
    """An expert format for the tests: 8-bit block (32, 32) scales; "int4" asymmetric and "int4-sym" symmetric
    groups of 32 inputs (ragged against 72-wide rows and against the 64/128 tiles), "int4-g64" groups of 64 (a
    64-input tile lies in one group); "fp8-b128" FP8 blocks of (32, 128), as FP8 checkpoints publish 128-wide ones (a
    tile of 64 or 128 inputs lies in one block column, a 256-wide GEMV tile spans two: the kernels load a scale per
    row and block column)."""
    if expert_dtype.startswith("int4"):
        return ExpertFormat.build(hidden, inter, dtype, "int4", group_size=64 if expert_dtype.endswith("g64") else 32,
                                  symmetric=expert_dtype == "int4-sym")
    if expert_dtype == "fp8-b128":
        return ExpertFormat.build(hidden, inter, dtype, "fp8", (32, 128))
    return ExpertFormat.build(hidden, inter, dtype, expert_dtype, (32, 32))


def _shape(expert_dtype: str) -> tuple[int, int]:
    """(hidden, intermediate) of a test format: ragged against the 64/128 tiles; with 128-wide FP8 blocks, rows of
    three and two block columns (the last ragged), so the tiles step across blocks."""
    return (288, 136) if expert_dtype == "fp8-b128" else (96, 72)


def _float64_expert(x: torch.Tensor, fmt: ExpertFormat, record: torch.Tensor) -> torch.Tensor:
    gate_up, down = fmt.dequantize(record.view(1, -1))
    gate, up = (x.double() @ gate_up[0].double().T).chunk(2, -1)
    return (F.silu(gate) * up) @ down[0].double().T


@pytest.mark.parametrize("dtype,expert_dtype,tolerance,max_rows,weights_first", [
    (torch.float32, "model", 1e-5, 8, False), (torch.bfloat16, "model", 2e-2, 8, False),
    (torch.float32, "int8", 1e-5, 8, False), (torch.bfloat16, "fp8", 2e-2, 8, False),
    (torch.float32, "model", 1e-5, 3, False), (torch.bfloat16, "fp8", 2e-2, 3, False),
    (torch.float32, "int8", 1e-5, 4, False), (torch.float32, "model", 1e-5, 8, True),
    (torch.bfloat16, "fp8", 2e-2, 8, True), (torch.bfloat16, "model", 2e-2, 16, True),
    (torch.float32, "int4", 1e-5, 3, False), (torch.float32, "int4-sym", 1e-5, 8, False),
    (torch.bfloat16, "int4", 2e-2, 8, True), (torch.bfloat16, "int4-sym", 2e-2, 4, False),
    (torch.float32, "fp8-b128", 1e-5, 3, False), (torch.float32, "fp8-b128", 1e-5, 8, True),
    full_only(torch.bfloat16, "fp8-b128", 2e-2, 4, False),
])
def test_routed_experts_match_float64_from_slots_and_host(dtype, expert_dtype, tolerance, max_rows, weights_first):
    """Both multiplies: tl.dot tiles (more than GEMV_MAX_ROWS rows per step; rows by weights or weights by rows)
    and the CUDA-core GEMV (fewer)."""
    from moeprefetch.kernels.experts import DEFAULT_TILES, GEMV_MAX_ROWS, RoutedExperts

    g = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{expert_dtype}".encode()) % 1000)  # same in every process
    fmt = _format(*_shape(expert_dtype), dtype, expert_dtype)
    host, _ = _experts(fmt, 6, g)
    if DEVICE == "cuda":
        host = host.pin_memory()
    pool = torch.full((4, fmt.record_bytes), 0x7F, dtype=torch.uint8, device=DEVICE)  # NaN-ish garbage
    pool[0].copy_(host[2])
    pool[1].copy_(host[4])
    rows, k = 3, 2
    x = torch.randn(rows, fmt.hidden, generator=g).to(dtype).to(DEVICE)
    # distinct experts 2 (slot 0), 0 (host, admitted to slot 2), 4 (slot 1), 1 (host, not admitted)
    u_key = torch.tensor([2, 0, 4, 1, -1, -1], dtype=torch.int32, device=DEVICE)
    u_slot = torch.tensor([0, -1, 1, -1, -1, -1], dtype=torch.int32, device=DEVICE)
    u_dst = torch.tensor([-1, 2, -1, -1, -1, -1], dtype=torch.int32, device=DEVICE)
    assign = torch.tensor([[0, 1], [2, 0], [-1, 3]], dtype=torch.int32, device=DEVICE)
    weights = torch.rand(rows, k, generator=g).to(DEVICE)
    tiles = None if max_rows <= GEMV_MAX_ROWS else replace(DEFAULT_TILES, weights_first=weights_first)  # None: the format's own
    kernel = RoutedExperts(fmt, pool, host, "silu", F.silu, 16, k, use_kernels=True, tiles=tiles)
    out = kernel(x, assign, weights, u_key, u_slot, u_dst, out=torch.full((rows, fmt.hidden), float("nan"),
                                                                           device=DEVICE), step_rows=max_rows)
    keys = u_key.tolist()
    expected = torch.zeros(rows, fmt.hidden, dtype=torch.float64)
    for r in range(rows):
        for j in range(k):
            u = int(assign[r, j])
            if u >= 0:
                expected[r] += float(weights[r, j]) * _float64_expert(x[r : r + 1].cpu(), fmt, host[keys[u]])[0]
    error = ((out.cpu().double() - expected).norm() / expected.norm()).item()
    assert error < tolerance, error
    # the admitted expert landed whole: its slot now computes exactly what its host record does
    slot_gu, slot_down = fmt.dequantize(pool[2].cpu().view(1, -1))
    host_gu, host_down = fmt.dequantize(host[0].view(1, -1))
    assert torch.equal(slot_gu, host_gu) and torch.equal(slot_down, host_down)


@pytest.mark.parametrize("dtype,expert_dtype,tolerance", [(torch.float32, "model", 1e-5),
                                                           (torch.bfloat16, "model", 2e-2),
                                                           (torch.float32, "int4", 1e-5)])
def test_a_one_row_step_matches_float64(dtype, expert_dtype, tolerance):
    """A step of one row (batch 1 on a checkpoint without an MTP layer, whose steps compute their real rows alone:
    the GEMV's programs carry GEMV_MIN_ROWS rows, the second masked: one-row programs made the engine's offloaded
    batch-1 step 1.9 x slower), from a slot, from host memory admitted to a slot, and from host memory in place."""
    from moeprefetch.kernels.experts import RoutedExperts

    g = torch.Generator().manual_seed(11)
    fmt = _format(96, 72, dtype, expert_dtype)
    host, _ = _experts(fmt, 4, g)
    if DEVICE == "cuda":
        host = host.pin_memory()
    pool = torch.zeros((3, fmt.record_bytes), dtype=torch.uint8, device=DEVICE)
    pool[0].copy_(host[1])
    kernel = RoutedExperts(fmt, pool, host, "silu", F.silu, 1, 3, use_kernels=True)
    x = torch.randn(1, fmt.hidden, generator=g).to(dtype).to(DEVICE)
    assign = torch.tensor([[0, 1, 2]], dtype=torch.int32, device=DEVICE)
    u_key = torch.tensor([1, 3, 0], dtype=torch.int32, device=DEVICE)
    u_slot = torch.tensor([0, -1, -1], dtype=torch.int32, device=DEVICE)
    u_dst = torch.tensor([-1, 2, -1], dtype=torch.int32, device=DEVICE)
    weights = torch.rand(1, 3, generator=g).to(DEVICE)
    out = kernel(x, assign, weights, u_key, u_slot, u_dst, step_rows=1)
    assert kernel._n_pad(1) == 2 and kernel._n_pad(3) == 4
    expected = sum(float(weights[0, j]) * _float64_expert(x.cpu(), fmt, host[[1, 3, 0][j]])[0] for j in range(3))
    error = ((out[0].cpu().double() - expected).norm() / expected.norm()).item()
    assert error < tolerance, error
    assert torch.equal(pool[2].cpu(), host[3].cpu())  # the admitted expert landed whole


@pytest.mark.parametrize("expert_dtype", ["model", "fp8", "int4"])
def test_routed_experts_take_each_step_shapes_measured_tiles(expert_dtype):
    """The engine's own tile choice by a step's rows: the CUDA-core GEMV up to GEMV_MAX_ROWS, tl.dot with 16-row
    tiles above it, and the one-stage DOT_WIDE_TILES once tiles are wider than 16 rows, for unquantised records only
    (where host_batched_h200.json measured it); a 32-row step from slots and host matches float64."""
    from moeprefetch.kernels.experts import (DEFAULT_TILES, DOT_WIDE_TILES, EIGHT_BIT_GEMV_TILES, GEMV_TILES,
                                             INT4_GEMV_TILES, RoutedExperts)

    g = torch.Generator().manual_seed(7)
    fmt = _format(96, 72, torch.float32, expert_dtype)
    host, _ = _experts(fmt, 6, g)
    pool = torch.zeros((4, fmt.record_bytes), dtype=torch.uint8, device=DEVICE)
    pool[0].copy_(host[2])
    kernel = RoutedExperts(fmt, pool, host.to(DEVICE) if DEVICE == "cpu" else host.pin_memory(), "silu", F.silu, 32,
                           2, use_kernels=True)
    rows = 20
    x = torch.randn(rows, fmt.hidden, generator=g).to(DEVICE)
    assign = torch.tensor([[r % 2, 2] for r in range(rows)], dtype=torch.int32, device=DEVICE)
    u_key = torch.tensor([2, 0, 5] + [-1] * 37, dtype=torch.int32, device=DEVICE)
    u_slot = torch.tensor([0, -1, -1] + [-1] * 37, dtype=torch.int32, device=DEVICE)
    u_dst = torch.full_like(u_key, -1)
    gemv = {"int4": INT4_GEMV_TILES, "fp8": EIGHT_BIT_GEMV_TILES}.get(expert_dtype, GEMV_TILES)
    assert EIGHT_BIT_GEMV_TILES.block_k == 256 != GEMV_TILES.block_k  # two FP8 block columns a tile
    wide = DOT_WIDE_TILES if expert_dtype == "model" else DEFAULT_TILES
    assert DOT_WIDE_TILES.num_stages == 1 and DEFAULT_TILES.num_stages == 3
    for step_rows, tiles in ((4, gemv), (8, DEFAULT_TILES), (16, DEFAULT_TILES), (32, wide)):
        n = min(rows, step_rows)
        launches = kernel.product_launches(x[:n], assign[:n], u_key, u_slot, u_dst, step_rows)
        assert all(launch.num_stages == tiles.num_stages for launch in launches), (step_rows, expert_dtype)
        assert launches[0].args["BI"] == tiles.block_i and launches[0].args["BK"] == tiles.block_k
    weights = torch.rand(rows, 2, generator=g).to(DEVICE)
    out = kernel(x, assign, weights, u_key, u_slot, u_dst, step_rows=32)
    keys = u_key.tolist()
    expected = torch.stack([sum(float(weights[r, j]) * _float64_expert(x[r : r + 1].cpu(), fmt,
                                                                        host[keys[int(assign[r, j])]])[0]
                                for j in range(2)) for r in range(rows)])
    error = ((out.cpu().double() - expected).norm() / expected.norm()).item()
    assert error < (1e-5 if expert_dtype == "model" else 2e-2), error


@pytest.mark.parametrize("expert_dtype,group,block_k,scale_dtype", [
    ("int4", 32, 128, torch.float16), full_only("int4", 128, 64, torch.float16), ("int4", 48, 128, torch.bfloat16),
    full_only("int4", 16, 32, torch.float32), ("fp8", 64, 256, None), ("fp8", 128, 64, None),
    full_only("fp8", 48, 128, None)])
def test_quantized_groups_tiled_every_way_match_float64(expert_dtype, group, block_k, scale_dtype):
    """The metadata paths of 4-bit and FP8 tiles: groups (FP8: block columns) inside a tile (loaded once per
    group), a group spanning several tiles (one per tile and row), groups that straddle tiles (gathered per
    weight); from a slot and admitted from host; with each dtype a 4-bit record stores its scales and zero points
    in."""
    from moeprefetch.kernels.experts import GEMV_TILES, RoutedExperts

    g = torch.Generator().manual_seed(group * 1000 + block_k)
    if expert_dtype == "int4":
        fmt = ExpertFormat.build(192, 144, torch.float32, "int4", group_size=group,  # ragged against every tile
                                 scale_dtype=scale_dtype)
    else:  # blocks of 24 rows: a 16-row tile's rows reach into two of them
        fmt = ExpertFormat.build(192, 144, torch.float32, "fp8", (24, group))
    host, _ = _experts(fmt, 3, g)
    if DEVICE == "cuda":
        host = host.pin_memory()  # read in place: zero-copy
    pool = torch.full((3, fmt.record_bytes), 0x7F, dtype=torch.uint8, device=DEVICE)  # garbage
    pool[0].copy_(host[1])
    x = torch.randn(2, fmt.hidden, generator=g).to(DEVICE)
    u_key = torch.tensor([1, 2, -1, -1], dtype=torch.int32, device=DEVICE)
    u_slot = torch.tensor([0, -1, -1, -1], dtype=torch.int32, device=DEVICE)
    u_dst = torch.tensor([-1, 2, -1, -1], dtype=torch.int32, device=DEVICE)
    assign = torch.tensor([[0, 1], [1, -1]], dtype=torch.int32, device=DEVICE)
    weights = torch.rand(2, 2, generator=g).to(DEVICE)
    kernel = RoutedExperts(fmt, pool, host, "silu", F.silu, 2, 2, use_kernels=True,
                           tiles=replace(GEMV_TILES, block_k=block_k))
    out = kernel(x, assign, weights, u_key, u_slot, u_dst, step_rows=2)
    expected = torch.zeros(2, fmt.hidden, dtype=torch.float64)
    for r, entries in enumerate(assign.tolist()):
        for j, u in enumerate(entries):
            if u >= 0:
                expected[r] += float(weights[r, j]) * _float64_expert(x[r : r + 1].cpu(), fmt,
                                                                      host[int(u_key[u])])[0]
    assert ((out.cpu().double() - expected).norm() / expected.norm()).item() < 1e-5
    landed, recorded = fmt.dequantize(pool[2].cpu().view(1, -1)), fmt.dequantize(host[2].view(1, -1))
    assert all(torch.equal(a, b) for a, b in zip(landed, recorded))  # the admitted record landed whole


def test_a_host_read_gives_exactly_the_slot_result():
    from moeprefetch.kernels.experts import RoutedExperts

    g = torch.Generator().manual_seed(7)
    fmt = ExpertFormat.build(64, 48, torch.float32 if DEVICE == "cpu" else torch.bfloat16)
    host, _ = _experts(fmt, 3, g)
    pool = torch.zeros(3, fmt.record_bytes, dtype=torch.uint8, device=DEVICE)
    pool.copy_(host.to(DEVICE))
    x = torch.randn(2, 64, generator=g).to(fmt.compute_dtype).to(DEVICE)
    assign = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32, device=DEVICE)
    weights = torch.rand(2, 2, generator=g).to(DEVICE)
    keys = torch.tensor([0, 1, 2, -1], dtype=torch.int32, device=DEVICE)
    none = torch.full((4,), -1, dtype=torch.int32, device=DEVICE)
    kernel = RoutedExperts(fmt, pool, host.pin_memory() if DEVICE == "cuda" else host, "silu", F.silu, 4, 2, True)
    from_slots = kernel(x, assign, weights, keys, torch.tensor([0, 1, 2, -1], dtype=torch.int32, device=DEVICE), none)
    from_host = kernel(x, assign, weights, keys, none, none)
    assert torch.equal(from_slots, from_host)


@pytest.mark.parametrize("step_rows", [4, 8])  # the CUDA-core GEMV and tl.dot
def test_expert_terms_are_the_products_that_the_combine_sums(step_rows):
    """Expert parallelism's per-(row, k) products: the kernels' equal the definition's, zero where another rank's
    expert sits (assign -1), and combining them in k order gives the routed output bit for bit."""
    from moeprefetch.kernels.experts import RoutedExperts, routed_experts_reference
    from moeprefetch.kernels.experts import combine_in_k_order

    g = torch.Generator().manual_seed(3)
    fmt = ExpertFormat.build(64, 48, torch.float32 if DEVICE == "cpu" else torch.bfloat16)
    host, _ = _experts(fmt, 3, g)
    pool = host.to(DEVICE).clone()
    x = torch.randn(3, 64, generator=g).to(fmt.compute_dtype).to(DEVICE)
    assign = torch.tensor([[0, -1], [2, 0], [-1, 1]], dtype=torch.int32, device=DEVICE)
    weights = torch.rand(3, 2, generator=g).to(DEVICE)
    keys = torch.tensor([0, 1, 2, -1, -1, -1], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([0, 1, 2, -1, -1, -1], dtype=torch.int32, device=DEVICE)
    none = torch.full((6,), -1, dtype=torch.int32, device=DEVICE)
    host_arg = host.pin_memory() if DEVICE == "cuda" else host
    reference = RoutedExperts(fmt, pool, host_arg, "silu", F.silu, step_rows, 2, False)
    kernel = RoutedExperts(fmt, pool, host_arg, "silu", F.silu, step_rows, 2, True)
    terms = reference.terms(x, assign, keys, slots, none)
    assert terms.shape == (3, 2, 64) and not terms[0, 1].any() and not terms[2, 0].any()
    assert terms[1, 1].abs().sum() > 0
    products = kernel.terms(x, assign, keys, slots, none)
    assert not products[0, 1].any() and not products[2, 0].any()
    # bf16 on the GPU: the kernel rounds act(gate) * up once from fp32, the definition after bf16 GEMVs
    tolerance = 1e-5 if fmt.compute_dtype == torch.float32 else 1e-2
    assert ((products - terms).norm() / terms.norm()).item() < tolerance
    combined = combine_in_k_order(terms, weights, assign >= 0)
    expected = routed_experts_reference(x, assign, weights, keys, slots, none, pool, host, fmt, F.silu)
    assert torch.equal(combined, expected)


# ---- the plan kernel against the reference: identical tables after random sequences --------------------------------


def _simulate(seed: int, policy: str, slots: int, spare: int, steps: int = 6, positions: int = 4, experts: int = 8,
              k: int = 2, nx: int = 2, ns: int = 1, wait: bool = False, ring: int = 2, foreign: float = 0.0,
              lead: int = 0, fill_confidence: float = 0.0, idle: bool = False, budget: int = 3,
              bypass: bool = False):
    from moeprefetch.residency.fill import await_fills
    from moeprefetch.residency.plan_kernel import LayerPlanner

    g = torch.Generator().manual_seed(seed)
    g_reuse = torch.Generator().manual_seed(seed + 10_000)  # its own stream: the other draws stay as they were
    cfg = ResidencyConfig(positions=positions, main_positions=positions - 1, n_experts=experts, n_slots=slots,
                          record_bytes=256, ring=ring, entries=16, max_inflight=4, budget_per_target=budget,
                          min_confidence=0.2, chunk_bytes=64, policy=policy, spare_recent=spare, wait_late=wait,
                          prefetch_lead=lead, fill_confidence=fill_confidence, fill_idle_link=idle,
                          bypass=bypass)
    u = (nx + ns) * k
    tables = [TableState.allocate(cfg, u, torch.device("cpu")) for _ in range(2)]
    for table in tables:
        table.pinned[3] = int(policy == "static")
    planners = [LayerPlanner(tables[0], cfg, k, nx, ns, use_kernel=False), LayerPlanner(tables[1], cfg, k, nx, ns, True)]
    traces = [torch.zeros(steps + 2, positions, experts, dtype=torch.uint8) for _ in range(2)]
    for step in range(steps):
        decode = step > 0
        for planner in planners:
            planner.step_start(decode)
        _same(tables, f"start of step {step}")
        pred = torch.rand(cfg.ring, positions, experts, generator=g) * (
            torch.rand(cfg.ring, positions, experts, generator=g) < 0.3)
        reuse = torch.rand(cfg.keys, generator=g_reuse) * (torch.rand(cfg.keys, generator=g_reuse) < 0.6)
        for table in tables:
            table.pred[: cfg.ring].copy_(pred)
            table.reuse.copy_(reuse)  # a predictor's P(needed soon): the bypass rule reads it
        for p in range(-1, positions):
            ids_x = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(nx)])
            act_x = torch.rand(nx, generator=g) < 0.85
            ids_s = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(ns)])
            act_s = torch.ones(ns, dtype=torch.bool)
            if foreign:  # expert parallelism: entries of another rank's experts are -1
                ids_x = torch.where(torch.rand(ids_x.shape, generator=g) < foreign, -1, ids_x)
                ids_s = torch.where(torch.rand(ids_s.shape, generator=g) < foreign, -1, ids_s)
            ready = torch.rand(cfg.entries, generator=g) < 0.5
            partial = torch.randint(0, cfg.chunks + 1, (cfg.entries,), generator=g, dtype=torch.int32)
            outputs = []
            landed = torch.rand(cfg.entries, generator=g) < 0.5  # fills landing while a late expert waits
            for planner, table, trace in zip(planners, tables, traces):
                # what the side stream did meanwhile: some fills landed, others copied a few chunks
                active = table.e_state == E_ACTIVE
                table.e_ready.copy_((active & ready).int() | table.e_ready)
                table.e_done.copy_(torch.where(active, torch.maximum(table.e_done, partial), table.e_done))
                table.e_next.copy_(torch.maximum(table.e_next, table.e_done))
                assign = torch.full((nx + ns, k), -7, dtype=torch.int32)
                u_key, u_slot, u_dst, u_wait = (torch.full((u,), -7, dtype=torch.int32) for _ in range(4))
                if p < 0:
                    planner(p, ids_x[:0], act_x[:0], None, None, assign[:0], u_key, u_slot, u_dst, decode, False,
                            u_wait=u_wait)
                else:
                    planner(p, ids_x, act_x, ids_s if decode else None, act_s if decode else None,
                            assign if decode else assign[:nx], u_key, u_slot, u_dst, decode, decode,
                            trace if decode else None, u_wait=u_wait)
                if wait and p >= 0:
                    waited = u_wait[u_wait >= 0].long()
                    table.e_ready[waited] |= landed[waited].int()
                    await_fills(table, p, u_wait, u_slot, use_kernel=planner is planners[1])
                outputs.append((assign, u_key, u_slot, u_dst) + ((u_wait,) if wait else ()))
            for a, b in zip(*outputs):
                assert torch.equal(a, b), (step, p, a, b)
            _same(tables, f"step {step}, position {p}")
    assert torch.equal(traces[0], traces[1])
    return tables[0].counters.sum(0)


def _same(tables, where: str) -> None:
    a, b = tables[0].tensors(), tables[1].tensors()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs at {where}:\n{a[name]}\n{b[name]}"


# the fast lane: 13 (LRU with a spare slot, as 0 has, plus foreign entries) and 19 (late waits, a 3-step ring, a lead)
@pytest.mark.parametrize("seed,policy,slots,spare,wait,ring,foreign,lead", [
    full_only(0, "lru", 7, 1, False, 2, 0.0, 0), full_only(1, "lfu", 20, 0, False, 2, 0.0, 0),
    full_only(2, "static", 14, 1, False, 2, 0.0, 0), full_only(3, "lru", 30, 0, False, 2, 0.0, 0),
    full_only(4, "lru", 12, 2, False, 2, 0.0, 0), full_only(11, "lru", 12, 0, True, 2, 0.0, 0),
    full_only(6, "lru", 20, 0, True, 2, 0.0, 0), full_only(12, "lru", 20, 0, True, 3, 0.0, 0),
    full_only(8, "lru", 9, 0, False, 4, 0.0, 0),
    (13, "lru", 9, 1, False, 2, 0.4, 0), full_only(14, "lru", 12, 0, True, 2, 0.3, 0),
    full_only(15, "lru", 20, 0, False, 2, 0.0, 1), (19, "lru", 20, 0, True, 3, 0.0, 3),
    full_only(21, "lrfu", 12, 1, False, 2, 0.0, 0)])
def test_plan_kernel_matches_the_reference(seed, policy, slots, spare, wait, ring, foreign, lead):
    """Plans, tables and counters identical; with `wait_late`, late experts' waits too (some fills land while they
    wait, the others are read from host and counted as zero-copy by the await launch); rings of 3 and 4 steps are
    the oracle's windows of 2 and 3 steps ahead; `foreign` entries (-1, another rank's experts) are never planned;
    a `lead` reserves fills only that many MoE positions ahead."""
    if DEVICE == "cuda":
        pytest.skip("runs the kernel on CPU tensors (interpreter); the GPU path is covered by the engine tests")
    from moeprefetch.residency.state import C

    totals = _simulate(seed, policy, slots, spare, steps=8 if wait else 6, wait=wait, ring=ring, foreign=foreign,
                       lead=lead)
    # the random walk reaches every outcome the kernel handles
    for name in ("hit", "miss", "admitted", "evictions", "prefetch_issued", "fills_done") + (("late",) if wait else ()):
        assert totals[C[name]] > 0, name


@pytest.mark.parametrize("seed,policy,wait,ring", [(31, "lrfu", False, 3), full_only(32, "lru", True, 2)])
def test_plan_kernel_matches_the_reference_with_a_fill_cut_and_idle_link_fills(seed, policy, wait, ring):
    """A fill cut above the confidence cut (weaker predictions protect, stronger ones are also fetched), and the
    layer's host reads published for yielding fills (`demand`): the same tables, plans and counters."""
    if DEVICE == "cuda":
        pytest.skip("runs the kernel on CPU tensors (interpreter); the GPU path is covered by the engine tests")
    from moeprefetch.residency.state import C

    totals = _simulate(seed, policy, 12, 0, steps=7, wait=wait, ring=ring, fill_confidence=0.55, idle=True)
    assert totals[C["prefetch_issued"]] > 0 and totals[C["predicted"]] > totals[C["prefetch_issued"]]


@pytest.mark.parametrize("seed,slots,wait", [full_only(53, 12, False), (56, 12, True)])
def test_plan_kernel_matches_the_reference_when_misses_bypass_the_cache(seed, slots, wait):
    """`bypass`: a miss less likely to be needed soon than its victim's expert is read without admission; the
    kernel's plans and tables equal the reference's, and some misses did bypass (fewer admissions than victims)."""
    if DEVICE == "cuda":
        pytest.skip("runs the kernel on CPU tensors (interpreter); the GPU path is covered by the engine tests")
    from moeprefetch.residency.state import C

    with_bypass = _simulate(seed, "lrfu", slots, 0, steps=6, wait=wait, bypass=True)
    without = _simulate(seed, "lrfu", slots, 0, steps=6, wait=wait)
    assert with_bypass[C["miss"]] > 0 and with_bypass[C["admitted"]] < with_bypass[C["miss"]]
    assert with_bypass[C["admitted"]] != without[C["admitted"]]


@pytest.mark.parametrize("seed,wait", [full_only(41, False), (42, True)])
def test_plan_kernel_without_a_fill_budget_only_protects(seed, wait):
    """No fill budget (protection only): the kernel skips its reservation passes and still plans exactly as the
    reference, which fills nothing and protects what the predictions name."""
    if DEVICE == "cuda":
        pytest.skip("runs the kernel on CPU tensors (interpreter); the GPU path is covered by the engine tests")
    from moeprefetch.residency.state import C

    totals = _simulate(seed, "lrfu", 12, 0, steps=6, wait=wait, budget=0)
    assert totals[C["prefetch_issued"]] == 0 and totals[C["predicted"]] > 0 and totals[C["hit"]] > 0


@pytest.mark.parametrize("seed,cells,wait,ring", [full_only(21, 8, False, 2), full_only(22, 16, True, 3),
                                                   (23, 32, False, 4)])  # the fast lane: 4-row blocks of a 4-step ring
def test_plan_kernel_reserves_the_same_in_blocks_of_the_window(seed, cells, wait, ring, monkeypatch):
    """The reservation goes through the prediction window in blocks of rows (long models would spill registers
    otherwise): with blocks of one, two or four rows the tables stay identical to the reference."""
    if DEVICE == "cuda":
        pytest.skip("runs the kernel on CPU tensors (interpreter); the GPU path is covered by the engine tests")
    from moeprefetch.residency import plan_kernel as plan
    from moeprefetch.residency.state import C

    monkeypatch.setattr(plan, "WINDOW_CELLS", cells)  # 8 experts a row: blocks of cells / 8 rows
    totals = _simulate(seed, "lru", 12, 0, steps=7, wait=wait, ring=ring)
    assert totals[C["prefetch_issued"]] > 0 and totals[C["evictions"]] > 0


def test_the_plan_kernels_find_every_field_of_the_packed_table():
    """The kernels take the table as three buffers and find its fields by `_words`, `_clocks` and `_floats`, which
    repeat `state.PACKED`'s order: a mark written through each pointer they give lands in that field's first element
    and nowhere else, on a table whose ring is longer than the plans' (those fields come last)."""
    if DEVICE == "cuda":
        pytest.skip("the layout is the same on every device; the engine tests run the kernels on the GPU")
    from moeprefetch.residency.state import COUNTERS, PACKED

    cfg = ResidencyConfig(positions=3, main_positions=2, n_experts=5, n_slots=7, record_bytes=64, ring=4, entries=8)
    st = TableState.allocate(cfg, 11, torch.device("cpu"))
    for buffer in (st.words, st.clocks, st.floats):
        buffer.zero_()
    _mark_fields[(1,)](st.words, st.clocks, st.floats, cfg.n_slots, P=cfg.positions, E=cfg.n_experts, M=cfg.entries, A=11,
               NC=len(COUNTERS))
    fields = st.tensors()
    skipped = {"counted", "frequency"}  # no kernel reads them
    for names, buffer in zip(PACKED, (st.words, st.clocks, st.floats)):
        read = [name for name in names if name not in skipped]
        assert [int(fields[name].flatten()[0]) for name in read] == list(range(1, len(read) + 1))
        assert int(buffer.count_nonzero()) == len(read)


@pytest.mark.parametrize("idle", [False, True])
def test_fill_kernel_copies_in_deadline_order_and_skips_passed_needs(idle):
    """With `fill_idle_link` and a layer still reading from host (`demand`), a fill for a later layer waits a
    bounded time (a few polls in the interpreter, where nothing runs beside it) and then copies as without."""
    if DEVICE == "cuda":
        pytest.skip("interpreter check; the GPU race test covers the device")
    from moeprefetch.residency.fill import Filler, fill_reference

    cfg = ResidencyConfig(positions=3, main_positions=2, n_experts=4, n_slots=6, record_bytes=8192 * 3 + 64,
                          entries=8, chunk_bytes=8192, fill_idle_link=idle)
    host = torch.randint(0, 255, (12, cfg.record_bytes), dtype=torch.uint8)
    results = []
    for use_kernel in (False, True):
        st = TableState.allocate(cfg, 4, torch.device("cpu"))
        pool = torch.zeros(cfg.n_slots, cfg.record_bytes, dtype=torch.uint8)
        st.step.fill_(2)
        st.progress.fill_(2 * (2 * 3 + 1))  # the plan of position 1 in step 2
        for j, (key, slot, position) in enumerate(((5, 0, 2), (7, 3, 1), (9, 4, 2))):
            st.e_state[j], st.e_key[j], st.e_slot[j] = E_ACTIVE, key, slot
            st.e_deadline[j] = 2 * (2 * 3 + position)
        st.order[2, :3] = torch.tensor([1, 0, 2])  # entry 1's need (position 1) is being planned now: skipped
        st.demand.fill_(int(idle))
        if use_kernel:
            Filler(st, cfg, pool, host, use_kernel=True, programs=3)(1)  # three programs share the chunks
        else:
            fill_reference(st, cfg, pool, host, 1)
        results.append((pool.clone(), st.e_ready.clone()))
        assert torch.equal(pool[0], host[5]) and torch.equal(pool[4], host[9]) and not pool[3].any()
        assert st.e_ready[:3].tolist() == [1, 0, 1]
    assert torch.equal(results[0][0], results[1][0])


def test_fill_programs_decide_on_one_read_of_the_main_streams_words():
    """A fill program reads the words the main stream changes while it runs (the plan clock, `demand`) only through
    `_read_shared`, one value for all its warps, never with a per-warp volatile load: warps that decided on different
    clocks left chunks half copied and counted them landed (BENCHMARKS "The fill kernel's torn chunks"). The
    interpreter runs a program as one thread, so on the CPU only the kernels' source can show it."""
    import inspect

    from moeprefetch.residency import fill

    for kernel in (fill._fill_kernel, fill._claim, fill._yield_link):
        source = inspect.getsource(kernel.fn)
        assert "volatile" not in source, kernel.fn.__name__
        assert "tl.load(progress_ptr" not in source and "tl.load(demand_ptr" not in source, kernel.fn.__name__
    assert "_read_shared(progress_ptr)" in inspect.getsource(fill._claim.fn)
    assert "_read_shared(e_deadline_ptr" in inspect.getsource(fill._fill_kernel.fn)  # late plans raise it
    assert "_read_shared(demand_ptr)" in inspect.getsource(fill._yield_link.fn)
    assert "tl.atomic_add(ptr, 0" in inspect.getsource(fill._read_shared.fn)  # a scalar atomic: one thread, shared


@pytest.mark.slow
def test_kernels_compile_for_hopper():
    """What the interpreter cannot check: the compiler's type rules and resources, at DeepSeek-V2-Lite's shape
    (in a fresh process: this one defines the kernels for the interpreter)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(COMPILE_CHECK)], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "shared_bytes" in line]
    from conftest import load_script

    check = load_script("compile_check")
    INT4_LAUNCHES, example_launches = check.INT4_LAUNCHES, check.example_launches

    readers = [name for name in example_launches() if name.startswith(INT4_LAUNCHES)]
    assert len(readers) == 14  # gate_up and down of 5 step shapes, grouped gate_up and down of 2
    # every launch with bf16 and with fp8 experts, and those reading expert records with int4 experts
    assert len(lines) == 2 * len(example_launches()) + len(readers)
    assert len(lines) >= 32
    for line in lines:
        shared = int(line.rsplit("'shared_bytes':", 1)[1].strip(" }"))
        assert shared <= 228 * 1024, line  # fits one Hopper multiprocessor


@pytest.mark.slow
def test_the_plan_kernel_does_not_spill_at_large_models_shapes():
    """The prefetch reservation over 48-58 layers of 128-256 experts, 2 and 3 steps ahead, compiled for sm_90: no
    local-memory traffic (the window in one block spilled 1,206-34,222 local loads and stores per launch)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(COMPILE_CHECK), "--plan-spills"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "local_memory_ops" in line]
    assert len(lines) == 6, done.stdout
    if any("None" in line for line in lines):
        pytest.skip("Triton's cuobjdump is not installed")
    assert all(line.endswith("{'local_memory_ops': 0}") for line in lines), lines


# ---- the fused decode-layer kernels against their references -------------------------------------------------------


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,capacity,per_seq,window", [
    (8, 2, 16, 300, 1, None),  # ten 32-key splits, 4 query heads per key-value head (padded to 16)
    full_only(4, 4, 24, 4500, 1, None),  # 71 splits of 64 keys, ragged head dim, no grouping
    (12, 4, 16, 130, 2, None),  # two new tokens per sequence (verify steps), 3 heads per group
    (8, 2, 16, 400, 1, 37),  # a sliding window: keys before slot - 36 are never read
])
def test_gqa_decode_attention_matches_float64(dtype, tolerance, heads, kv_heads, head_dim, capacity, per_seq, window):
    """The split/merge kernels give the softmax over each row's keys lo..slot in float64; cache entries outside
    (NaN here) are never read."""
    from moeprefetch.kernels.gqa_attention import GQADecode, gqa_attend_reference

    g = torch.Generator().manual_seed(heads + head_dim)
    batch = 2
    rows = batch * per_seq
    key = torch.randn(batch, capacity, kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(batch, capacity, kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.tensor([capacity - 2, 3]).repeat_interleave(per_seq) + torch.arange(per_seq).repeat(batch)
    cache_rows = torch.arange(rows) // per_seq
    for c in range(batch):  # what none of a cache row's queries may see: beyond their slots, before their windows
        seen = slots[cache_rows == c]
        key[c, int(seen.max()) + 1 :] = float("nan")
        if window:
            value[c, : max(int(seen.min()) + 1 - window, 0)] = float("nan")
    q = torch.randn(rows, heads, head_dim, generator=g).to(dtype)
    want = gqa_attend_reference(q.double(), key.double(), value.double(), cache_rows, slots, 0.3, window)
    key, value, q, slots = key.to(DEVICE), value.to(DEVICE), q.to(DEVICE), slots.to(DEVICE)
    out = GQADecode(heads, kv_heads, head_dim, capacity, rows, window, torch.device(DEVICE), True).attend(
        q, key, value, slots, per_seq, 0.3)
    error = ((out.double().cpu() - want).norm() / want.norm()).item()
    assert error < tolerance, error


def test_gqa_reference_is_the_models_decode_attention():
    """gqa_attend_reference is model.attention_gqa_decode's attention core (fp32, with a sliding window)."""
    from types import SimpleNamespace

    from moeprefetch.kernels.gqa_attention import gqa_attend_reference
    from moeprefetch.model import _visible

    g = torch.Generator().manual_seed(5)
    b, cap, heads, kv_heads, d, window = 2, 40, 6, 2, 8, 9
    key, value = torch.randn(b, cap, kv_heads, d, generator=g), torch.randn(b, cap, kv_heads, d, generator=g)
    q = torch.randn(b, heads, d, generator=g)
    slots = torch.tensor([30, 4])
    args = SimpleNamespace(sliding_window=window)
    grouped = q[:, None].unflatten(2, (kv_heads, heads // kv_heads))  # [B, 1, g, r, d]
    scores = torch.einsum("blgrd,bsgd->blgrs", grouped, key) * 0.25
    visible = _visible(args, torch.arange(cap)[None, None, :], slots[:, None, None])
    probs = torch.softmax(scores.masked_fill(~visible[:, :, None, None, :], float("-inf")), dim=-1)
    want = torch.einsum("blgrs,bsgd->blgrd", probs, value).flatten(2, 3)[:, 0]  # [B, h, d]
    got = gqa_attend_reference(q, key, value, torch.arange(b), slots, 0.25, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


MLA_SHAPES = [
    (4, 16, 32, 8, 300, 1, True),  # ten 32-key splits, one head block padded from 4 heads
    (2, 8, 16, 8, 4500, 1, True),  # 71 splits of 64 keys (longer rows get larger splits, never more than 128)
    (20, 8, 48, 16, 130, 2, False),  # two head blocks, two new tokens per sequence, ragged latent
]


# every shape in both dtypes (ids as two stacked parametrizations gave them); the fast lane runs the long rows' splits
# in fp32 only (the tighter tolerance), bf16 on the other two shapes
@pytest.mark.parametrize("heads,nope,latent,rope_dim,capacity,per_seq,interleave,dtype,tolerance", [
    pytest.param(*shape, dtype, tolerance, id="-".join(map(str, shape)) + f"-dtype{i}-{tolerance}",
                 marks=[pytest.mark.slow] if shape[4] == 4500 and dtype == torch.bfloat16 else [])
    for shape in MLA_SHAPES for i, (dtype, tolerance) in enumerate([(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])])
def test_mla_decode_attention_matches_the_absorbed_definition(dtype, tolerance, heads, nope, latent, rope_dim,
                                                              capacity, per_seq, interleave):
    """prepare + attend give model.attention_absorbed's result over each row's own keys; keys beyond a row's slot
    (garbage here) are never read."""
    from moeprefetch.kernels.attention import MLADecode, attend_reference

    g = torch.Generator().manual_seed(heads)
    batch = 2
    rows = batch * per_seq
    mla = MLADecode(heads, nope, latent, rope_dim, capacity, rows, torch.device(DEVICE), True)
    latent_cache = torch.randn(batch, capacity, latent, generator=g).to(dtype).to(DEVICE)
    rope_cache = torch.randn(batch, capacity, rope_dim, generator=g).to(dtype).to(DEVICE)
    slots = torch.tensor([capacity - 2, 3][:batch]).repeat_interleave(per_seq) + torch.arange(per_seq).repeat(batch)
    slots = slots.to(DEVICE)
    positions = slots + 5
    q = torch.randn(rows, heads, nope + rope_dim, generator=g).to(dtype).to(DEVICE)
    kv = torch.randn(rows, latent + rope_dim, generator=g).to(dtype).to(DEVICE)
    norm = (torch.rand(latent, generator=g) + 0.5).to(dtype).to(DEVICE)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, rope_dim, 2).float() / rope_dim)).to(DEVICE)
    ref_q, ref_latent, ref_rope = q.clone(), latent_cache.clone(), rope_cache.clone()
    MLADecode(heads, nope, latent, rope_dim, capacity, rows, torch.device(DEVICE), False).prepare(
        ref_q, kv, positions, slots, per_seq, ref_latent, ref_rope, norm, 1e-6, inv_freq, 1.2, interleave)
    mla.prepare(q, kv, positions, slots, per_seq, latent_cache, rope_cache, norm, 1e-6, inv_freq, 1.2, interleave)
    ulp = 1e-6 if dtype == torch.float32 else 3e-2
    for got, want in ((q, ref_q), (latent_cache, ref_latent), (rope_cache, ref_rope)):
        assert (got.float() - want.float()).abs().max().item() <= ulp * max(1.0, want.float().abs().max().item())
    q_latent = torch.randn(heads, rows, latent, generator=g).to(dtype).to(DEVICE)
    out = mla.attend(q_latent, q, latent_cache, rope_cache, slots, per_seq, 0.2)
    cache_rows = torch.arange(rows, device=DEVICE) // per_seq
    want = attend_reference(q_latent.double(), q[..., nope:].double(), latent_cache.double(), rope_cache.double(),
                            cache_rows, slots, 0.2)
    error = ((out.double() - want).norm() / want.norm()).item()
    assert error < tolerance, error


def test_residual_norm_and_act_mul_match_their_references():
    from moeprefetch.kernels.norm import act_mul, residual_norm

    g = torch.Generator().manual_seed(3)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x = torch.randn(3, 200, generator=g).to(dtype).to(DEVICE)
        d1 = torch.randn(3, 200, generator=g).to(DEVICE)  # fp32, like the routed experts' sum
        d2 = torch.randn(3, 200, generator=g).to(dtype).to(DEVICE)
        w = torch.rand(200, generator=g).to(dtype).to(DEVICE)
        for deltas, weight in (([], w), ([d2], w), ([d1, d2], w), ([d1, d2], None)):
            want_x, want_n = residual_norm(x, deltas, weight, 1e-6, use_kernel=False)
            got_x, got_n = residual_norm(x, deltas, weight, 1e-6, use_kernel=True)
            if dtype == torch.float32 or DEVICE == "cuda":
                assert torch.equal(got_x, want_x)  # the residual add rounds exactly as the definition
            else:  # the interpreter's fp32 -> bf16 conversion may round differently from the device's
                assert (got_x.float() - want_x.float()).abs().max().item() <= 2 ** -6 * want_x.float().abs().max()
            if weight is not None:
                assert (got_n.float() - want_n.float()).abs().max().item() <= tol * 4
            else:
                assert got_n is None
        gate, up = (torch.randn(2, 300, generator=g).to(dtype).to(DEVICE) for _ in range(2))
        for name, fn in (("silu", F.silu), ("relu", F.relu), ("gelu_pytorch_tanh", lambda t: F.gelu(t, approximate="tanh"))):
            got = act_mul(gate, up, name, fn, use_kernel=True)
            want = fn(gate) * up
            assert (got.float() - want.float()).abs().max().item() <= tol * 4, name


@pytest.mark.parametrize("shape", [
    dict(n_experts=64, top_k=6, n_group=1, topk_group=1, method="greedy", sigmoid=False, norm_topk_prob=False,
         scaling=1.0),
    dict(n_experts=256, top_k=8, n_group=8, topk_group=4, method="noaux_tc", sigmoid=True, norm_topk_prob=True,
         scaling=2.5),
    dict(n_experts=16, top_k=3, n_group=4, topk_group=2, method="group_limited_greedy", sigmoid=False,
         norm_topk_prob=True, scaling=1.5),
    dict(n_experts=10, top_k=4, n_group=5, topk_group=2, method="noaux_tc", sigmoid=True, norm_topk_prob=True,
         scaling=2.0),
])
def test_router_selection_matches_the_definition(shape):
    from moeprefetch.kernels.router import RouterShape, select_experts, select_experts_reference

    router = RouterShape(**shape)
    g = torch.Generator().manual_seed(router.n_experts)
    logits = torch.randn(7, router.n_experts, generator=g).to(DEVICE)
    bias = (torch.randn(router.n_experts, generator=g) * 0.3).to(DEVICE) if router.sigmoid else None
    got = select_experts(router, logits, bias, use_kernel=True)
    want = select_experts_reference(router, logits, bias)
    assert torch.equal(got[0], want[0])  # the same experts in the same (descending) order
    assert torch.allclose(got[1], want[1], rtol=1e-5, atol=1e-7)
    assert torch.equal(torch.isinf(got[2]), torch.isinf(want[2]))  # the same groups masked
    finite = torch.isfinite(want[2])
    assert torch.allclose(got[2][finite], want[2][finite], rtol=1e-5, atol=1e-7)


# ---- prefill's grouped GEMM ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed,tokens,block_m", [(0, 1, 4), (1, 37, 4), (2, 300, 64), (3, 129, 16)])
def test_plan_blocks_cuts_each_experts_sorted_pairs_into_blocks(seed, tokens, block_m):
    """The vectorised plan against its definition: pairs sorted by (expert's u, pair index), each expert's run cut
    into blocks of at most block_m in order."""
    from moeprefetch.kernels.grouped import plan_blocks

    g = torch.Generator().manual_seed(seed)
    k, n_experts = 3, 11
    ids = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(tokens)])
    distinct = sorted(set(ids.flatten().tolist()))
    u_of_expert = torch.zeros(n_experts, dtype=torch.int64)
    u_of_expert[distinct] = torch.arange(len(distinct))
    pairs = sorted(range(tokens * k), key=lambda p: (distinct.index(int(ids.flatten()[p])), p))
    expected, start = [], 0
    for u, e in enumerate(distinct):
        count = int((ids == e).sum())
        expected += [[u, start + f, min(block_m, count - f)] for f in range(0, count, block_m)]
        start += count
    # as a host plans it (u up to the last distinct expert), and as a device does: a fixed number of u, some unused
    for n_u in (None, n_experts + 2):
        pair_token, order, blocks = plan_blocks(ids, u_of_expert, block_m, n_u)
        assert order.tolist() == pairs and pair_token.tolist() == [p // k for p in pairs]
        bound = -(-tokens * k // block_m) + (len(distinct) if n_u is None else n_u)
        assert blocks.shape[0] == bound >= len(expected)  # fixed by the shapes, never by the routing
        assert blocks[: len(expected)].tolist() == expected
        assert blocks[len(expected) :].tolist() == [[-1, 0, 0]] * (bound - len(expected))


def test_grouped_tiles_follow_the_calls_shape_not_its_routing():
    from moeprefetch.kernels.grouped import LONG_BLOCK_PAIRS, GroupedExperts, GroupedTiles
    from moeprefetch.kernels.tiles import SHORT_BLOCK_INT4_TILES, SHORT_BLOCK_TILES

    fmt = ExpertFormat.build(96, 72, torch.float32)
    pool = torch.zeros(2, fmt.record_bytes, dtype=torch.uint8)
    grouped = GroupedExperts(fmt, pool, None, "silu", F.silu, use_kernels=False)
    assert grouped.tiles_for(LONG_BLOCK_PAIRS * 64, 64).block_m == 128
    assert grouped.tiles_for(LONG_BLOCK_PAIRS * 64 - 1, 64).block_m == 64
    fixed = GroupedTiles(block_m=32, block_n=32)
    assert GroupedExperts(fmt, pool, None, "silu", F.silu, False, tiles=fixed).tiles_for(10**6, 64) == fixed
    # 4-bit records below the long blocks' share: their own tiles (the format's, whatever the call routes)
    int4 = _format(96, 72, torch.float32, "int4")
    packed = GroupedExperts(int4, torch.zeros(2, int4.record_bytes, dtype=torch.uint8), None, "silu", F.silu, False)
    assert packed.tiles_for(LONG_BLOCK_PAIRS * 64 - 1, 64) == SHORT_BLOCK_INT4_TILES != SHORT_BLOCK_TILES
    assert packed.tiles_for(LONG_BLOCK_PAIRS * 64, 64).block_m == 128


@pytest.mark.parametrize("dtype,expert_dtype,tolerance,long_blocks", [
    (torch.float32, "model", 1e-5, False), (torch.bfloat16, "fp8", 2e-2, False), (torch.float32, "int8", 1e-5, False),
    (torch.bfloat16, "model", 2e-2, True), (torch.float32, "int4", 1e-5, False), (torch.bfloat16, "int4-sym", 2e-2, True),
    (torch.float32, "int4-g64", 1e-5, False), (torch.bfloat16, "int4-g64", 2e-2, True),
    (torch.float32, "fp8-b128", 1e-5, False)])
def test_grouped_prefill_experts_match_float64(dtype, expert_dtype, tolerance, long_blocks):
    """Blocks of one expert's pairs (one expert with more pairs than a block), experts in slots and in host memory;
    with the 64-pair blocks of short prompts and the 128-pair blocks of long ones; 4-bit groups of 32 inside a
    64-input tile and of 64 (one per row of a tile, the last one ragged)."""
    from moeprefetch.kernels.grouped import LONG_BLOCK_TILES, GroupedExperts, GroupedTiles, plan_blocks
    from moeprefetch.model import combine_expert_outputs

    g = torch.Generator().manual_seed(11)
    fmt = _format(*_shape(expert_dtype), dtype, expert_dtype)
    host, _ = _experts(fmt, 5, g)
    if DEVICE == "cuda":
        host = host.pin_memory()
    pool = torch.zeros(3, fmt.record_bytes, dtype=torch.uint8, device=DEVICE)
    pool[1].copy_(host[3])
    tiles = LONG_BLOCK_TILES if long_blocks else GroupedTiles()
    tokens, k = tiles.block_m + 10, 2
    ids = torch.stack([torch.zeros(tokens, dtype=torch.int64), torch.randint(1, 5, (tokens,), generator=g)], 1)
    distinct = sorted(set(ids.flatten().tolist()))
    u_of_expert = torch.zeros(5, dtype=torch.int64)
    u_of_expert[distinct] = torch.arange(len(distinct))
    pair_token, order, blocks = plan_blocks(ids, u_of_expert, tiles.block_m)
    assert blocks.shape[0] >= len(distinct) + 1  # expert 0 needs two blocks
    keys = torch.tensor(distinct, dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([1 if e == 3 else -1 for e in distinct], dtype=torch.int32, device=DEVICE)
    x = torch.randn(tokens, fmt.hidden, generator=g).to(dtype).to(DEVICE)
    weights = torch.rand(tokens, k, generator=g).to(DEVICE)
    grouped = GroupedExperts(fmt, pool, host, "silu", F.silu, use_kernels=True)
    y = grouped(x, pair_token.to(DEVICE), blocks.to(DEVICE), keys, slots, tiles=tiles)
    products = torch.empty_like(y)
    products[order.to(DEVICE)] = y
    out = combine_expert_outputs(products.view(tokens, k, -1), weights, None).cpu().double()
    expected = torch.zeros(tokens, fmt.hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(k):
            e = int(ids[t, j])
            expected[t] += float(weights[t, j]) * _float64_expert(x[t : t + 1].cpu(), fmt, host[e])[0]
    error = ((out - expected).norm() / expected.norm()).item()
    assert error < tolerance, error


# ---- embedding rows read from host memory ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,hidden", [(torch.bfloat16, 2048), (torch.float32, 3000)])
def test_host_embedding_rows_are_exactly_the_tables_rows(dtype, hidden):
    """The zero-copy gather (a table in host memory, ids and rows on the device) against F.embedding, including
    repeated ids and a hidden size that is not a multiple of the block."""
    from moeprefetch.kernels.gather import HostRows, embedding_reference

    generator = torch.Generator().manual_seed(hidden)
    table = torch.randn(500, hidden, generator=generator).to(dtype)
    from moeprefetch.store import pin_in_place

    rows = HostRows(table, torch.device(DEVICE), use_kernel=True,
                    unpin=pin_in_place(table) if DEVICE == "cuda" else None)
    ids = torch.randint(0, 500, (3, 5), generator=generator)
    ids[0, :2] = 499
    ids = ids.to(DEVICE)
    out = rows(ids)
    assert out.device.type == DEVICE and out.shape == (3, 5, hidden)
    assert torch.equal(out.cpu(), F.embedding(ids.cpu(), table))
    assert torch.equal(embedding_reference(table, ids).cpu(), F.embedding(ids.cpu(), table))
    rows.close()


def test_the_table_kernels_compile_one_variant_per_configuration():
    """The plan, fill, await and step-start kernels run once per MoE layer with the layer's position, row counts and
    policy flags as integers: Triton specialises integers that equal 1 or divide by 16 unless told not to, which
    compiled ~90 variants of the plan kernel (seconds each) in one engine's first calls on the H200."""
    import inspect

    import triton.language as tl

    from conftest import load_script

    example_launches = load_script("compile_check").example_launches

    launches = {name: launch for name, launch in example_launches().items()
                if name.startswith(("plan", "await", "step_start", "fill"))}
    assert len(launches) == 6
    for name, launch in launches.items():
        kernel = launch.kernel  # a JITFunction, or the interpreter's wrapper of one (its options in `kwargs`)
        kept = getattr(kernel, "do_not_specialize", None) or kernel.kwargs["do_not_specialize"] or ()
        signature = inspect.signature(kernel.fn).parameters
        integers = [arg for arg, value in launch.args.items() if signature[arg].annotation not in (tl.constexpr,
                    "tl.constexpr") and isinstance(value, int) and not isinstance(value, bool)]
        assert integers, name
        specialised = [arg for arg in integers if arg not in kept]
        assert not specialised, (name, specialised)


def test_the_tile_table_is_what_the_kernels_run(tmp_path):
    """kernels/tiles.json is the kernels' tile choices: each entry parses into its dataclass, the engine's defaults
    are those entries, every choice names where it was measured, and an entry with a misspelt field is refused
    (it must not fall back to a default silently)."""
    import json

    from moeprefetch.kernels import experts, grouped, tiles

    raw = json.loads(tiles.TABLE_PATH.read_text())
    routed, groups = raw["routed_experts"], raw["grouped_experts"]
    assert experts.DEFAULT_TILES == tiles.Tiles(**routed["dot"]["tiles"])
    assert experts.DOT_WIDE_TILES == tiles.Tiles(**routed["dot_wide"]["tiles"])
    assert experts.GEMV_TILES == tiles.Tiles(**routed["gemv"]["tiles"])
    assert experts.INT4_GEMV_TILES == tiles.Tiles(**routed["gemv_int4"]["tiles"])
    assert experts.EIGHT_BIT_GEMV_TILES == tiles.Tiles(**routed["gemv_8bit"]["tiles"])
    assert grouped.LONG_BLOCK_TILES == tiles.GroupedTiles(**groups["long"]["tiles"])
    assert grouped.BLOCK_M == groups["short"]["tiles"]["block_m"]
    root = Path(__file__).resolve().parent.parent
    for entry in [*routed.values(), groups["short"], groups["long"]]:
        assert entry["why"] and (root / entry["source"]).exists(), entry
    raw["routed_experts"]["gemv"]["tiles"]["block_kk"] = raw["routed_experts"]["gemv"]["tiles"].pop("block_k")
    broken = tmp_path / "tiles.json"
    broken.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="gemv names"):
        tiles.load_table(broken)


# ---- sampling: the Gumbel noise and its arg-max in one pass ----------------------------------------------------------
def test_gumbel_argmax_draws_the_references_token():
    """`gumbel_argmax` (one pass: hash, noise, running maxima per span, then the spans') against the reference's
    noise tensor and argmax: a ragged vocabulary over three spans, filtered (-inf) entries, one seed for every row (a call's) and each row's
    own (a batch's strided seeds, words of 32 bits), rows with every entry filtered but one, and positions past 2**32."""
    from moeprefetch.kernels.sampling import SAMPLE_SPAN, gumbel_argmax, pcg

    generator = torch.Generator().manual_seed(11)
    vocab, rows = 2 * SAMPLE_SPAN + 77, 5  # three programs a row, the last ragged
    vocab_hash = pcg(torch.arange(vocab, dtype=torch.int64)).to(DEVICE)
    # full 32-bit words: `seed_halves` puts bits 62 and 63 of a seed in their top bits
    row_seeds = torch.randint(0, 2**32, (rows, 2), generator=generator, dtype=torch.int64).to(DEVICE)
    for trial in range(6):
        scaled = (torch.randn(rows, vocab, generator=generator) * (0.3 + trial)).to(DEVICE)
        scaled[1, torch.randperm(vocab, generator=generator)[: vocab // 2].to(DEVICE)] = float("-inf")
        scaled[2] = float("-inf")
        scaled[2, vocab - 3] = 0.0  # one survivor, in the last, ragged block
        streams = torch.arange(rows, device=DEVICE) if trial % 2 else torch.zeros(rows, dtype=torch.int64,
                                                                                   device=DEVICE)
        positions = torch.randint(0, 2**34, (rows,), generator=generator).to(DEVICE)
        shared = row_seeds[0, 0].clone(), row_seeds[0, 1].clone()  # 0-dim: one seed for every row
        for hi, lo in (shared, (row_seeds[:, 0], row_seeds[:, 1])):
            expected = gumbel_argmax(scaled, vocab_hash, streams, positions, hi, lo, use_kernel=False)
            got = gumbel_argmax(scaled, vocab_hash, streams, positions, hi, lo, use_kernel=True)
            assert torch.equal(got, expected), (trial, got.tolist(), expected.tolist())
            assert int(got[2]) == vocab - 3
