#!/usr/bin/env python
"""Does the host arena itself slow zero-copy reads? One V2-Lite expert layer at batch 1 (6 experts, all read from
host through the fused kernel), over arenas of different kinds, and the copy engine from each:

- `pinned_small`: `pin_memory()` of 48 experts (what bench_kernels.py times);
- `registered_large`: one ordinary arena of `--arena-gib` registered with cudaHostRegister, like the engine's store,
  the layers' experts spread across it;
- `registered_large_thp`: the same after madvise(MADV_HUGEPAGE), so the kernel may back it with 2 MiB pages.

Medians of CUDA-event timings of `--layers` layers replayed as one CUDA graph, after a warm-up. On the large arenas
also `rotating`: before each replay the layers' keys are rewritten (on the device, outside the timed span) to experts
drawn at random from the whole arena, as decode's misses are, so no replay finds its pages' address translations
(GPU TLB, IOMMU) warm from the one before.

    python scripts/arena_reads.py --out /tmp/arena.json --arena-gib 26
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_kernels import timed  # noqa: E402
from moeprefetch.expert_records import ExpertFormat  # noqa: E402
from moeprefetch.kernels.experts import RoutedExperts  # noqa: E402
from moeprefetch.store import register_pinned  # noqa: E402

MADV_HUGEPAGE = 14


def mmap_arena(nbytes: int, huge: bool) -> tuple[torch.Tensor, mmap.mmap]:
    """An anonymous mapping as a uint8 tensor; with `huge`, advised to use transparent huge pages before first touch."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        rc = libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
        print("madvise rc", rc, ctypes.get_errno(), flush=True)
    return torch.frombuffer(buf, dtype=torch.uint8), buf


def layer_reader(fmt: ExpertFormat, host: torch.Tensor, pool: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """One batch-1 MoE layer whose 6 experts (keys [6], on the device) are all read from host memory."""
    dev = pool.device
    kernel = RoutedExperts(fmt, pool, host, "silu", F.silu, 1, 6, use_kernels=True)
    x = torch.randn(1, fmt.hidden, device=dev, dtype=torch.bfloat16)
    w = torch.rand(1, 6, device=dev)
    o = torch.empty(1, fmt.hidden, device=dev)
    assign = torch.arange(6, dtype=torch.int32, device=dev)[None]
    none = torch.full((6,), -1, dtype=torch.int32, device=dev)
    return lambda keys: kernel(x, assign, w, keys, none, none, out=o, step_rows=1)


def time_layers(fmt: ExpertFormat, host: torch.Tensor, keys_of_layers: list[list[int]], pool: torch.Tensor) -> float:
    read = layer_reader(fmt, host, pool)
    plans = [torch.tensor(k, dtype=torch.int32, device=pool.device) for k in keys_of_layers]

    def run() -> None:
        for keys in plans:
            read(keys)

    return timed(run, graph=True, repeats=15) / len(plans)


def time_rotating(fmt: ExpertFormat, host: torch.Tensor, layers: int, pool: torch.Tensor, repeats: int = 15) -> float:
    """Median ms per layer when every replay reads `layers` x 6 experts drawn afresh from the whole arena."""
    dev = pool.device
    read = layer_reader(fmt, host, pool)
    keys = torch.zeros(layers, 6, dtype=torch.int32, device=dev)
    g = torch.Generator().manual_seed(0)
    draws = [torch.randperm(host.shape[0], generator=g)[: layers * 6].view(layers, 6).to(torch.int32).to(dev)
             for _ in range(repeats + 3)]

    def run() -> None:
        for layer in range(layers):
            read(keys[layer])

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    times = []
    for i, draw in enumerate(draws):
        keys.copy_(draw)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 3:  # warm-up replays
            times.append(start.elapsed_time(end))
    return statistics.median(times) / layers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arena-gib", type=float, default=26.0)
    parser.add_argument("--layers", type=int, default=8)
    ns = parser.parse_args()
    dev = torch.device("cuda")
    fmt = ExpertFormat.build(2048, 1408, torch.bfloat16)
    rec = fmt.record_bytes
    pool = torch.zeros(8, rec, dtype=torch.uint8, device=dev)
    layer_bytes = 6 * fmt.payload_bytes
    rows = {}
    small = torch.zeros(ns.layers * 6, rec, dtype=torch.uint8).pin_memory()
    keys = [[layer * 6 + j for j in range(6)] for layer in range(ns.layers)]
    ms = time_layers(fmt, small, keys, pool)
    rows["pinned_small"] = {"ms_per_layer": ms, "gbps": layer_bytes / ms / 1e6}
    print(rows, flush=True)
    del small
    n = int(ns.arena_gib * (1 << 30)) // rec
    stride = n // (ns.layers * 6)
    spread = [[(layer * 6 + j) * stride for j in range(6)] for layer in range(ns.layers)]
    for name, huge in (("registered_large", False), ("registered_large_thp", True)):
        start = time.perf_counter()
        flat, buf = mmap_arena(n * rec, huge)
        flat.fill_(0)
        arena = flat.view(n, rec)
        pin = register_pinned(arena)
        setup = time.perf_counter() - start
        assert pin.pinned, pin.message
        ms = time_layers(fmt, arena, spread, pool)
        ms_dense = time_layers(fmt, arena, keys, pool)
        ms_rotating = time_rotating(fmt, arena, ns.layers, pool)
        rows[name] = {"ms_per_layer_spread": ms, "gbps_spread": layer_bytes / ms / 1e6, "ms_per_layer_dense": ms_dense,
                      "gbps_dense": layer_bytes / ms_dense / 1e6, "ms_per_layer_rotating": ms_rotating,
                      "gbps_rotating": layer_bytes / ms_rotating / 1e6, "setup_s": setup, "experts": n,
                      "register_s": pin.seconds}
        copy_dst = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
        src = flat[n * rec // 2: n * rec // 2 + (64 << 20)]
        cms = timed(lambda src=src: copy_dst.copy_(src, non_blocking=True), repeats=10)
        rows[name]["copy_engine_64mib_gbps"] = (64 << 20) / cms / 1e6
        print(name, rows[name], flush=True)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(arena.data_ptr())
        del arena, flat, src
        try:
            buf.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with the process
            pass
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        thp = "unknown"
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                  "transparent_hugepage": thp, "layers": ns.layers, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
