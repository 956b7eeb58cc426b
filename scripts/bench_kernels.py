#!/usr/bin/env python
"""Kernel microbenchmarks on the GPU at DeepSeek-V2-Lite's expert shape (bf16, H=2048, I=1408, 17.3 MB per expert).

Rows (medians of CUDA-event timings after a warm-up, each repeated inside a CUDA graph where launch gaps matter):
- link: copy-engine host->device of 256 MiB; the fill kernel (16 programs) copying 16 experts host->VRAM;
- experts: one MoE layer at batch 1 (6 experts) through the fused kernel, from VRAM slots, from host memory
  (zero-copy) and 3+3 mixed, against the old gathered-bmm path; achieved GB/s;
- plan: the residency plan kernel, 27 layers replayed as one graph, per layer;
- overlap: the fill kernel copying while a chain of bf16 GEMVs (HBM-bound, like decode) runs, against each alone.

    python scripts/bench_kernels.py --out /tmp/kernels.json
    python scripts/bench_kernels.py --out /tmp/tiles.json --tiles-sweep   # the expert kernel's tile choices
    python scripts/bench_kernels.py --out /tmp/host.json --host-sweep     # tile choices for misses read from host
    python scripts/bench_kernels.py --out /tmp/b.json --host-sweep --sequences 1,4,16  # steps of several rows
    python scripts/bench_kernels.py --out /tmp/grouped.json --grouped-sweep  # prefill's grouped GEMM tiles
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moeprefetch.expert_records import ExpertFormat, gathered_expert_ffn  # noqa: E402
from moeprefetch.kernels.experts import RoutedExperts, Tiles  # noqa: E402
from moeprefetch.residency.fill import Filler  # noqa: E402
from moeprefetch.residency.plan_kernel import LayerPlanner  # noqa: E402
from moeprefetch.residency.state import E_ACTIVE, ResidencyConfig, TableState  # noqa: E402


def timed(fn, repeats: int = 20, warmup: int = 3, graph: bool = False) -> float:
    """Median milliseconds of fn() (or of a captured graph of it)."""
    if graph:
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


GEMV_CANDIDATES = (  # (block_i, block_h, block_k, num_warps, num_stages): steps of <= 4 rows, CUDA cores
    (16, 16, 128, 4, 3), (32, 32, 64, 4, 3), (8, 8, 256, 4, 3), (16, 16, 256, 4, 2), (32, 32, 128, 8, 3),
    (16, 16, 128, 2, 3), (64, 64, 32, 4, 4),
)
# 4-bit records carry half a byte per input, so wider reductions are candidates too (measured: 128 still best)
INT4_GEMV_CANDIDATES = (
    (16, 16, 128, 4, 3), (16, 16, 256, 4, 3), (32, 32, 256, 4, 3), (8, 8, 256, 4, 3), (16, 16, 512, 4, 2),
    (32, 32, 128, 4, 3), (16, 16, 256, 8, 3), (8, 8, 512, 4, 2),
)
DOT_CANDIDATES = (  # (block_i, block_h, block_k, num_warps, num_stages, weights_first): larger steps, tl.dot
    (32, 32, 128, 4, 4, 0), (64, 64, 128, 4, 3, 0), (32, 32, 64, 4, 5, 0), (32, 64, 128, 4, 4, 0),
    (64, 64, 128, 4, 3, 1), (64, 64, 128, 4, 4, 1), (64, 64, 64, 4, 5, 1), (128, 128, 64, 4, 4, 1),
    (128, 64, 64, 4, 4, 1), (64, 64, 128, 8, 3, 1), (128, 128, 64, 8, 4, 1),
)
# hidden, intermediate, experts, top-k; "deep": the deep benchmark model's experts as bench_gpu pads them to V2-Lite's
# 17.3 MB (hidden 128: gate/up rows of 128 inputs, down projections of only 128 rows)
SHAPES = {"v2lite": (2048, 1408, 64, 6), "v3": (7168, 2048, 256, 8), "deep": (128, 22528, 64, 6)}


def tiles_sweep(out: Path, shape: str = "v2lite", candidates: tuple = (), gemv: bool = True,
                expert_dtype: str = "model", gemv_candidates: tuple = GEMV_CANDIDATES) -> int:
    """One MoE layer (experts in VRAM) through the expert kernel with each tile choice: the GEMV path at 1 and 2
    rows, the tl.dot path at 1, 4, 8 and 16 rows (distinct experts of random routing); against a cuBLAS GEMV over
    the bytes of top-k experts (the HBM anchor). Quantized formats time random records (speed does not depend on
    the values)."""
    dev = torch.device("cuda")
    hidden, inter, n_experts, top_k = SHAPES[shape]
    fmt = ExpertFormat.build(hidden, inter, torch.bfloat16, expert_dtype)
    rec = fmt.record_bytes
    if fmt.quantized:
        pool = torch.randint(0, 256, (n_experts, rec), device=dev, dtype=torch.uint8)
        scales = pool.view(torch.float32)  # finite scales and zero points wherever the format keeps them
        scales.copy_(torch.rand(scales.shape, device=dev) * 0.01)
        for name in ("gate", "up", "down"):
            region = fmt.regions[name]
            pool[:, region.offset : region.offset + region.nbytes].random_(0, 256)
    else:
        pool = (torch.randn(n_experts, rec // 2, device=dev, dtype=torch.bfloat16) * 0.02).view(torch.uint8)
    g = torch.Generator(device="cpu").manual_seed(0)
    results = []
    anchor_w = torch.randn(top_k * 3 * inter, hidden, device=dev, dtype=torch.bfloat16)  # the bytes of k experts
    anchor_x = torch.randn(hidden, 1, device=dev, dtype=torch.bfloat16)
    anchor_ms = timed(lambda: torch.mm(anchor_w, anchor_x), graph=True, repeats=50)
    cases = [(c, rows, step) for c in gemv_candidates for rows, step in ((1, 2), (2, 4))] if gemv else []
    cases += [(c, rows, 16) for c in candidates or DOT_CANDIDATES for rows in (1, 4, 8, 16)]
    for tiles_tuple, rows, step_rows in cases:
        kernel = RoutedExperts(fmt, pool, None, "silu", F.silu, 16, top_k, use_kernels=True,
                               tiles=Tiles(*tiles_tuple))
        ids = torch.stack([torch.randperm(n_experts, generator=g)[:top_k] for _ in range(rows)])
        distinct = sorted(set(ids.flatten().tolist()))
        u_of = {e: i for i, e in enumerate(distinct)}
        assign = torch.tensor([[u_of[e] for e in r] for r in ids.tolist()], dtype=torch.int32, device=dev)
        keys = torch.full((kernel.max_experts,), -1, dtype=torch.int32, device=dev)
        keys[: len(distinct)] = torch.tensor(distinct, dtype=torch.int32, device=dev)
        none = torch.full_like(keys, -1)
        x = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
        w = torch.rand(rows, top_k, device=dev)
        o = torch.empty(rows, hidden, device=dev)
        ms = timed(lambda: kernel(x, assign, w, keys, keys, none, out=o, step_rows=step_rows), graph=True,
                   repeats=50)
        row = {"shape": shape, "expert_dtype": expert_dtype, "tiles": tiles_tuple,
               "path": "gemv" if step_rows <= 4 else "dot", "rows": rows,
               "distinct_experts": len(distinct), "ms": ms,
               "gbps": len(distinct) * fmt.payload_bytes / ms / 1e6}
        results.append(row)
        print(row, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "cublas_gemv_same_bytes_ms": anchor_ms,
                               "cublas_gemv_gbps": anchor_w.numel() * 2 / anchor_ms / 1e6, "tiles": results},
                              indent=1))
    return 0


# 4-bit misses read from host; the first is the engine's 4-bit INT4_GEMV_TILES, the second GEMV_TILES
INT4_HOST_CANDIDATES = (
    (16, 16, 256, 4, 3), (16, 16, 128, 4, 3), (16, 16, 256, 4, 2), (16, 16, 256, 8, 3), (8, 8, 256, 4, 3),
    (16, 16, 512, 4, 2),
)
HOST_CANDIDATES = (  # reads over PCIe want many loads in flight: narrower tiles, more warps (the first is GEMV_TILES)
    (16, 16, 128, 4, 3), (8, 8, 128, 4, 3), (16, 16, 128, 8, 3), (32, 32, 128, 8, 3), (16, 16, 256, 4, 2),
    (8, 8, 256, 4, 3), (16, 16, 64, 4, 3), (4, 4, 256, 4, 3),
)


# (missed of 6, admitted[, staged: copied into slots by the copy engine before the kernel reads them from VRAM])
HOST_CASES = ((0, False), (1, False), (3, False), (6, False), (3, True), (6, True))


def host_sweep(out: Path, layers: int = 8, step_rows: tuple[int, ...] = (1,),
               cases: tuple[tuple[int, bool], ...] = HOST_CASES, candidates: tuple[tuple[int, ...], ...] = (),
               expert_dtype: str = "model", shape: str = "v2lite") -> int:
    """Batch-1 MoE layers whose missed experts the kernel reads from pinned host memory (zero-copy), with each GEMV
    tile choice: `layers` layers back to back in one CUDA graph, each with its own experts (more bytes than L2 holds,
    so no replay reads a cached expert), with 1, 3 or 6 of the 6 experts missed, with and without admission into a
    victim slot; and all 6 from VRAM (the same tiles serve resident experts, whose bits must match). `step_rows`: the
    step shapes to time (a decode step of batch b computes up to 2b rows, so batch 1 runs the 2-row kernel).
    `expert_dtype` int4: the engine's 4-bit records (groups of 128, asymmetric, fp16 metadata), with the 4-bit
    candidates (`INT4_HOST_CANDIDATES`) by default; fp8: 128 x 128 blocks, as quantised on load; both random bytes
    (the timing does not depend on the values). `shape`: an expert shape of SHAPES (its top-k experts a layer)."""
    dev = torch.device("cuda")
    int4 = expert_dtype == "int4"
    hidden, inter, _, top_k = SHAPES[shape]
    fmt = ExpertFormat.build(hidden, inter, torch.bfloat16, expert_dtype)
    rec, per_layer = fmt.record_bytes, top_k
    n_host = layers * per_layer
    host = torch.empty(n_host, rec, dtype=torch.uint8).pin_memory()
    if fmt.quantized:
        host.random_(0, 256)
    else:
        host.view(torch.bfloat16).normal_(0, 0.02)
    pool = torch.empty(2 * n_host, rec, dtype=torch.uint8, device=dev)
    pool[:n_host].copy_(host)
    results = []
    x = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
    w = torch.rand(1, top_k, device=dev)
    o = torch.empty(1, hidden, device=dev)
    assign = torch.arange(top_k, dtype=torch.int32, device=dev)[None]
    default = INT4_HOST_CANDIDATES if int4 else HOST_CANDIDATES
    for tiles_tuple, rows_of_step, case in itertools.product(candidates or default, step_rows, cases):
        missed, admit, staged = (*case, False)[:3]
        kernel = RoutedExperts(fmt, pool, host, "silu", F.silu, rows_of_step, top_k, use_kernels=True,
                               tiles=Tiles(*tiles_tuple))
        plans = []
        for layer in range(layers):
            keys = torch.arange(layer * per_layer, (layer + 1) * per_layer, dtype=torch.int32, device=dev)
            slots = keys.clone()
            slots[:missed] = -1
            dst = torch.full_like(keys, -1)
            if admit:
                dst[:missed] = n_host + keys[:missed]
            plans.append((keys, slots, dst))

        staging = [(host[layer * per_layer : layer * per_layer + missed],
                    pool[n_host + layer * per_layer : n_host + layer * per_layer + missed]) for layer in range(layers)]
        if staged:  # the misses copied into their slots by the copy engine first, then computed from VRAM
            plans = [(keys, torch.where(slots < 0, n_host + keys, slots), torch.full_like(dst, -1))
                     for keys, slots, dst in plans]

        def run() -> None:
            for (keys, slots, dst), (src, into) in zip(plans, staging):
                if staged:
                    into.copy_(src, non_blocking=True)
                kernel(x, assign, w, keys, slots, dst, out=o, step_rows=rows_of_step)

        ms = timed(run, graph=True, repeats=20) / layers
        row = {"tiles": tiles_tuple, "step_rows": rows_of_step, "missed": missed, "admit": admit, "staged": staged,
               "ms_per_layer": ms,
               "host_gbps_if_all_time_is_host": missed * fmt.payload_bytes / ms / 1e6 if missed else None,
               "host_record_gbps_if_all_time_is_host": missed * rec / ms / 1e6 if missed else None,
               "gbps_all_bytes": per_layer * fmt.payload_bytes / ms / 1e6}
        results.append(row)
        print(row, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": layers,
                               "shape": shape, "expert_dtype": expert_dtype, "expert_payload_bytes": fmt.payload_bytes,
                               "expert_record_bytes": rec, "rows": results}, indent=1))
    return 0


def batched_host_sweep(out: Path, sequences: tuple[int, ...], missed_share: float, layers: int = 8,
                       candidates: tuple[tuple[int, ...], ...] = ()) -> int:
    """Decode steps of `sequences` rows without an MTP head (a step of b rows), each row routed to 6 of a layer's 64
    V2-Lite experts at random (rows share experts as random routing makes them), `missed_share` of each layer's
    distinct experts read from pinned host memory in place (with and without admission into victim slots), the rest
    from VRAM; `layers` layers back to back in one CUDA graph, each with experts of its own. The engine's offloaded
    batches read their misses at 24 GB/s from batch 4 on (twenty-ninth session, H100) against 51 for one row's in
    isolation: this says whether the expert kernel alone does, at the engine's tiles or `candidates`."""
    dev = torch.device("cuda")
    fmt = ExpertFormat.build(2048, 1408, torch.bfloat16)
    rec, top_k, n_experts = fmt.record_bytes, 6, 64
    host = torch.empty(layers * n_experts, rec, dtype=torch.uint8).pin_memory()
    host.view(torch.bfloat16).normal_(0, 0.02)
    pool = torch.empty(2 * layers * n_experts, rec, dtype=torch.uint8, device=dev)
    pool[: layers * n_experts].copy_(host)
    g = torch.Generator().manual_seed(0)
    results = []
    for tiles_tuple, b, admit in itertools.product(candidates or (None,), sequences, (False, True)):
        kernel = RoutedExperts(fmt, pool, host, "silu", F.silu, b, top_k, use_kernels=True,
                               **({"tiles": Tiles(*tiles_tuple)} if tiles_tuple else {}))
        x = torch.randn(b, 2048, device=dev, dtype=torch.bfloat16)
        w = torch.rand(b, top_k, device=dev)
        o = torch.empty(b, 2048, device=dev)
        layer_plans, distinct_counts, missed_counts = [], [], []
        for layer in range(layers):
            ids = torch.stack([torch.randperm(n_experts, generator=g)[:top_k] for _ in range(b)])
            distinct = sorted(set(ids.flatten().tolist()))
            u_of = {e: i for i, e in enumerate(distinct)}
            assign = torch.tensor([[u_of[e] for e in r] for r in ids.tolist()], dtype=torch.int32, device=dev)
            keys = torch.full((kernel.max_experts,), -1, dtype=torch.int32, device=dev)
            keys[: len(distinct)] = torch.tensor(distinct, dtype=torch.int32, device=dev) + layer * n_experts
            missed = round(missed_share * len(distinct))
            slots = keys.clone()
            slots[:missed] = -1  # read from host[key]
            dst = torch.full_like(keys, -1)
            if admit:
                dst[:missed] = layers * n_experts + keys[:missed]
            layer_plans.append((assign, keys, slots, dst))
            distinct_counts.append(len(distinct))
            missed_counts.append(missed)

        def run() -> None:
            for assign, keys, slots, dst in layer_plans:
                kernel(x, assign, w, keys, slots, dst, out=o, step_rows=b)

        ms = timed(run, graph=True, repeats=10) / layers
        missed_mean = statistics.mean(missed_counts)
        row = {"tiles": tiles_tuple or "engine", "sequences": b, "admit": admit,
               "distinct_per_layer": statistics.mean(distinct_counts), "missed_per_layer": missed_mean,
               "ms_per_layer": ms, "host_gbps_if_all_time_is_host": missed_mean * fmt.payload_bytes / ms / 1e6}
        results.append(row)
        print(row, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": layers,
                               "missed_share": missed_share, "expert_payload_bytes": fmt.payload_bytes,
                               "rows": results}, indent=1))
    return 0


GROUPED_CANDIDATES = (  # (block_m, block_n, block_k, num_warps, num_stages); the first is the engine's default
    (64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (128, 128, 64, 8, 3), (128, 128, 32, 8, 4),
    (64, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 64, 64, 8, 3), (128, 64, 64, 8, 4), (128, 64, 128, 8, 3),
    (128, 64, 64, 4, 4), (256, 64, 64, 8, 3),
)


def grouped_mm_anchor(x: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> dict:
    """torch._grouped_mm (CUTLASS, where the installed torch has it) on the same layer: pairs sorted by expert,
    weights stacked [E, ...] (no slot table, no host reads): the headroom of a vendor grouped GEMM."""
    if not hasattr(torch, "_grouped_mm"):
        return {"grouped_mm": "not in this torch"}
    order = torch.sort(ids.flatten(), stable=True).indices
    offs = torch.cumsum(torch.bincount(ids.flatten(), minlength=gate_up.shape[0]), 0).to(torch.int32)
    a = x[order // ids.shape[1]].contiguous()
    w1, w2 = gate_up.transpose(1, 2), down.transpose(1, 2)  # [E, K, N] column-major, as CUTLASS wants

    def layer():
        h = torch._grouped_mm(a, w1, offs=offs)
        g, u = h.chunk(2, dim=1)
        return torch._grouped_mm(F.silu(g) * u, w2, offs=offs)

    try:
        return {"grouped_mm_ms": timed(layer, repeats=10)}
    except (RuntimeError, TypeError) as exc:
        return {"grouped_mm": f"failed: {exc}"[:200]}


def grouped_sweep(out: Path, tokens: int = 4096, candidates: tuple[tuple[int, ...], ...] = (),
                  expert_dtype: str = "model") -> int:
    """Prefill's grouped expert GEMMs at V2-Lite's shape: one MoE layer, every expert in VRAM, `tokens` tokens routed
    at random (top-6 of 64), with each tile choice; TFLOP/s of the useful multiplies, against cuBLAS on a dense GEMM
    pair of the same FLOPs, and the GB/s of the layer's expert records read (every expert is used)."""
    from moeprefetch.kernels.grouped import GroupedExperts, GroupedTiles, plan_blocks

    dev = torch.device("cuda")
    n_experts, top_k = 64, 6
    if expert_dtype == "model":
        fmt = ExpertFormat.build(2048, 1408, torch.bfloat16)
        pool = (torch.randn(n_experts, fmt.record_bytes // 2, device=dev, dtype=torch.bfloat16) * 0.02
                ).view(torch.uint8)
    else:  # records packed from random weights (quantized as on load)
        fmt = ExpertFormat.build(2048, 1408, torch.bfloat16, expert_dtype)
        pool = torch.empty(n_experts, fmt.record_bytes, dtype=torch.uint8)
        for e in range(n_experts):
            fmt.pack(*(torch.randn(shape) * 0.02 for shape in ((1408, 2048), (1408, 2048), (2048, 1408))), pool[e])
        pool = pool.to(dev)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(n_experts, generator=g)[:top_k] for _ in range(tokens)])
    x = torch.randn(tokens, fmt.hidden, device=dev, dtype=torch.bfloat16)
    keys = torch.arange(n_experts, dtype=torch.int32, device=dev)
    pairs = tokens * top_k
    flops = pairs * 3 * fmt.hidden * fmt.intermediate * 2
    a = torch.randn(pairs, fmt.hidden, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(fmt.hidden, 2 * fmt.intermediate, device=dev, dtype=torch.bfloat16)
    w2 = torch.randn(fmt.intermediate, fmt.hidden, device=dev, dtype=torch.bfloat16)
    m = torch.empty(pairs, fmt.intermediate, device=dev, dtype=torch.bfloat16)
    cublas_ms = timed(lambda: (torch.mm(a, w1), torch.mm(m, w2)), repeats=10)
    anchor: dict = {}
    if expert_dtype == "model":
        stacked = pool.view(torch.bfloat16).view(n_experts, -1)
        anchor = grouped_mm_anchor(
            x, ids.to(dev), stacked[:, : 2 * fmt.intermediate * fmt.hidden].view(n_experts, 2 * fmt.intermediate, -1),
            stacked[:, 2 * fmt.intermediate * fmt.hidden :].view(n_experts, fmt.hidden, fmt.intermediate))
    if "grouped_mm_ms" in anchor:
        anchor["grouped_mm_tflops"] = flops / anchor["grouped_mm_ms"] / 1e9
    rows = []
    for tiles_tuple in candidates or GROUPED_CANDIDATES:
        tiles = GroupedTiles(*tiles_tuple)
        kernel = GroupedExperts(fmt, pool, None, "silu", F.silu, use_kernels=True, tiles=tiles)
        pair_token, _, blocks = plan_blocks(ids, torch.arange(n_experts), tiles.block_m)
        pt, bl = pair_token.to(dev), blocks.to(dev)
        ms = timed(lambda: kernel(x, pt, bl, keys, keys), repeats=10)
        if not kernel.use_kernels:  # the compiler rejected the tile and the call fell back to the reference
            rows.append({"tiles": tiles_tuple, "failed": "did not compile"})
            continue
        rows.append({"tiles": tiles_tuple, "ms": ms, "tflops": flops / ms / 1e9,
                     "record_gbps": n_experts * fmt.record_bytes / ms / 1e6})
        print(rows[-1], flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": tokens, "pairs": pairs,
              "expert_dtype": expert_dtype, "record_bytes": fmt.record_bytes,
              "cublas_same_flops_ms": cublas_ms, "cublas_tflops": flops / cublas_ms / 1e9, **anchor, "rows": rows}
    print({k: v for k, v in result.items() if k != "rows"}, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiles-sweep", action="store_true", help="only time the expert kernel's tile choices")
    parser.add_argument("--host-sweep", action="store_true", help="only time tile choices on misses read from host")
    parser.add_argument("--grouped-sweep", action="store_true", help="only time prefill's grouped GEMM tiles")
    parser.add_argument("--grouped-tokens", default="4096", help="--grouped-sweep: prompt tokens (comma list)")
    parser.add_argument("--step-rows", default="1", help="--host-sweep: step shapes (comma list of most rows)")
    parser.add_argument("--missed", default="", help="--host-sweep: only these missed counts (comma list)")
    parser.add_argument("--gemv-min-rows", type=int, default=None, help="--host-sweep: the fewest rows a GEMV "
                        "program carries (kernels/experts.py GEMV_MIN_ROWS; 1: the twenty-eighth session's one-row "
                        "programs)")
    parser.add_argument("--staged", action="store_true", help="--host-sweep: also the misses copied into their "
                        "slots by the copy engine first (then read from VRAM)")
    parser.add_argument("--tiles", default="", help="the sweeps: only these tiles (;-separated)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="v2lite",
                        help="--tiles-sweep, --host-sweep: the expert shape")
    parser.add_argument("--expert-dtype", default="model", help="--tiles-sweep: the experts' format (int4: the GEMV "
                        "tiles only, unless --tiles names tl.dot ones); --host-sweep: model, fp8 or int4; "
                        "--grouped-sweep: model or int4")
    parser.add_argument("--sequences", default="", help="--host-sweep: decode steps of these many rows, each "
                        "routed at random (comma list), instead of batch-1 layers")
    parser.add_argument("--missed-share", type=float, default=0.7, help="--sequences: the share of each layer's "
                        "distinct experts read from host")
    return parser


def run_sweep(ns: argparse.Namespace) -> int | None:
    """The sweep the options ask for (its exit code), or None when they ask for the kernel rows."""
    if ns.tiles_sweep:
        tiles = tuple(tuple(int(v) for v in t.split(",")) for t in ns.tiles.split(";") if t)
        if ns.expert_dtype == "int4":  # decode at batch 1 is what the 4-bit aims time: GEMV tiles
            gemv_tiles = tuple(t for t in tiles if len(t) == 5) or INT4_GEMV_CANDIDATES
            return tiles_sweep(ns.out, ns.shape, tuple(t for t in tiles if len(t) == 6), True, "int4", gemv_tiles)
        return tiles_sweep(ns.out, ns.shape, tiles, gemv=not tiles, expert_dtype=ns.expert_dtype)
    if ns.grouped_sweep:
        tiles = tuple(tuple(int(v) for v in t.split(",")) for t in ns.tiles.split(";") if t)
        for tokens in (int(v) for v in ns.grouped_tokens.split(",")):
            grouped_sweep(ns.out.with_name(f"{ns.out.stem}_{tokens}{ns.out.suffix}"), tokens, tiles,
                          ns.expert_dtype)
        return 0
    if ns.host_sweep:
        if ns.gemv_min_rows is not None:
            import moeprefetch.kernels.experts as experts_module

            experts_module.GEMV_MIN_ROWS = ns.gemv_min_rows
        cases = tuple((int(m), False) for m in ns.missed.split(",")) if ns.missed else HOST_CASES
        cases += ((6, True, True),) if ns.staged else ()
        tiles = tuple(tuple(int(v) for v in t.split(",")) for t in ns.tiles.split(";") if t)
        if ns.sequences:
            return batched_host_sweep(ns.out, tuple(int(b) for b in ns.sequences.split(",")), ns.missed_share,
                                      candidates=tiles)
        return host_sweep(ns.out, step_rows=tuple(int(r) for r in ns.step_rows.split(",")), cases=cases,
                          candidates=tiles, expert_dtype=ns.expert_dtype, shape=ns.shape)
    return None


class FillRig:
    """The fill kernel over a two-position table: `fill_all` copies every host record into slots 16.. of the pool."""

    def __init__(self, dev: torch.device, pool: torch.Tensor, host: torch.Tensor):
        self.dev, self.n_host = dev, host.shape[0]
        cfg = ResidencyConfig(positions=2, main_positions=1, n_experts=self.n_host, n_slots=32,
                              record_bytes=host.shape[1], entries=64, wait_late=False)
        self.st = TableState.allocate(cfg, 16, dev)
        self.filler = Filler(self.st, cfg, pool, host, use_kernel=True)

    def arm(self, count: int) -> None:
        st, dev = self.st, self.dev
        st.step.fill_(1)
        st.progress.fill_(1)
        st.e_state[:count] = E_ACTIVE
        st.e_key[:count] = torch.arange(count, dtype=torch.int32, device=dev)
        st.e_slot[:count] = torch.arange(16, 16 + count, dtype=torch.int32, device=dev)
        st.e_deadline[:count] = 1 << 40
        st.e_next.zero_()
        st.e_done.zero_()
        st.e_ready.zero_()
        st.order[0].fill_(-1)
        st.order[0, :count] = torch.arange(count, dtype=torch.int32, device=dev)

    def fill_all(self) -> None:
        self.arm(self.n_host)
        self.filler(-1)


def link_and_fill_rows(dev: torch.device, fills: FillRig, pool: torch.Tensor, host: torch.Tensor) -> dict[str, float]:
    rows: dict[str, float] = {}
    big_h = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    big_d = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    ms = timed(lambda: big_d.copy_(big_h, non_blocking=True))
    rows["h2d_copy_engine_gbps"] = (256 << 20) / ms / 1e6
    for programs in (8, 16, 32):
        fills.filler.programs = programs
        ms = timed(fills.fill_all, repeats=10)
        rows[f"fill_kernel_{programs}_programs_gbps"] = fills.n_host * host.shape[1] / ms / 1e6
    assert torch.equal(pool[16:32].cpu(), host), "fill kernel bytes differ"
    fills.filler.programs = 16
    return rows


def layer_rows(dev: torch.device, fmt: ExpertFormat, pool: torch.Tensor, host: torch.Tensor) -> dict[str, float]:
    """One MoE layer at batch 1: the fused expert kernel reading VRAM, host memory or both; the gathered bmm."""
    rows: dict[str, float] = {}
    experts = RoutedExperts(fmt, pool, host, "silu", F.silu, 16, 6, use_kernels=True)
    x = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16)
    assign = torch.arange(6, dtype=torch.int32, device=dev)[None]
    weights = torch.rand(1, 6, device=dev)
    keys = torch.full((96,), -1, dtype=torch.int32, device=dev)
    keys[:6] = torch.arange(6, dtype=torch.int32, device=dev)
    no = torch.full((96,), -1, dtype=torch.int32, device=dev)
    slots = no.clone()
    slots[:6] = torch.arange(6, dtype=torch.int32, device=dev)
    mixed = no.clone()
    mixed[:3] = torch.arange(3, dtype=torch.int32, device=dev)
    out = torch.empty(1, 2048, device=dev)
    layer_bytes = 6 * fmt.record_bytes
    for name, where in (("vram", slots), ("host", no), ("mixed_3_3", mixed)):
        ms = timed(lambda: experts(x, assign, weights, keys, where, no, out=out), graph=True)
        rows[f"experts_layer_{name}_ms"] = ms
        rows[f"experts_layer_{name}_gbps"] = layer_bytes / ms / 1e6
    gate_up = fmt.gate_up_view(pool)
    down = fmt.view(pool, "down")
    idx = torch.arange(6, device=dev)

    def gathered() -> None:
        gathered_expert_ffn(x.expand(6, -1), gate_up[idx], down[idx], F.silu)

    rows["gathered_bmm_layer_ms"] = timed(gathered, graph=True)
    via_vram = experts(x, assign, weights, keys, slots, no)
    via_host = experts(x, assign, weights, keys, no, no)
    rows["host_read_equals_slot_read"] = float(torch.equal(via_vram, via_host))
    return rows


def plan_rows(dev: torch.device, record_bytes: int) -> dict[str, float]:
    """The plan kernel: 27 V2-Lite layers in one graph."""
    pcfg = ResidencyConfig(positions=27, main_positions=26, n_experts=64, n_slots=544, record_bytes=record_bytes,
                           wait_late=False)
    pst = TableState.allocate(pcfg, 96, dev)
    planner = LayerPlanner(pst, pcfg, 6, 16, 16, use_kernel=True)
    ids = torch.randint(0, 64, (1, 6), device=dev)
    ids_s = torch.randint(0, 64, (1, 6), device=dev)
    act = torch.ones(1, dtype=torch.bool, device=dev)
    a = torch.zeros(2, 6, dtype=torch.int32, device=dev)
    uk, us, ud = (torch.zeros(96, dtype=torch.int32, device=dev) for _ in range(3))

    def plan_step() -> None:
        planner.step_start(True)
        for p in range(27):
            planner(p, ids, act, ids_s, act, a, uk, us, ud, True, True)

    ms = timed(plan_step, repeats=10, graph=True)
    return {"plan_step_27_layers_ms": ms, "plan_per_layer_us": 1000 * ms / 28}


def overlap_rows(dev: torch.device, fills: FillRig) -> dict[str, float]:
    """Fills beside HBM-bound GEMVs: how much each slows the other."""
    rows: dict[str, float] = {}
    w = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    v = torch.randn(8192, 1, device=dev, dtype=torch.bfloat16)

    def gemvs() -> None:
        for _ in range(40):
            torch.mm(w, v)

    side = torch.cuda.Stream()
    rows["gemvs_alone_ms"] = timed(gemvs)
    rows["fills_alone_ms"] = timed(fills.fill_all, repeats=10)

    def both() -> None:
        fills.arm(fills.n_host)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fills.filler(-1)
        gemvs()
        torch.cuda.current_stream().wait_stream(side)

    rows["gemvs_with_fills_ms"] = timed(both, repeats=10)
    return rows


def kernel_rows() -> dict[str, float]:
    """The link, the fill kernel, one MoE layer, the plan kernel and fills beside GEMVs, at V2-Lite's expert."""
    dev = torch.device("cuda")
    fmt = ExpertFormat.build(2048, 1408, torch.bfloat16)
    n_host = 16
    host = torch.empty(n_host, fmt.record_bytes, dtype=torch.uint8).pin_memory()
    for e in range(n_host):
        fmt.pack(torch.randn(1408, 2048) * 0.02, torch.randn(1408, 2048) * 0.02, torch.randn(2048, 1408) * 0.02,
                 host[e])
    pool = torch.zeros(32, fmt.record_bytes, dtype=torch.uint8, device=dev)
    pool[:n_host].copy_(host)
    fills = FillRig(dev, pool, host)
    return {**link_and_fill_rows(dev, fills, pool, host), **layer_rows(dev, fmt, pool, host),
            **plan_rows(dev, fmt.record_bytes), **overlap_rows(dev, fills)}


def main() -> int:
    ns = build_parser().parse_args()
    if (code := run_sweep(ns)) is not None:
        return code
    rows = kernel_rows()
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                                 indent=1))
    for key, value in rows.items():
        print(f"{key:40s} {value:10.3f}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
