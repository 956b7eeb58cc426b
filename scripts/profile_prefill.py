#!/usr/bin/env python
"""Where a prompt's time to first token goes: each prompt length twice (the first pass pays one-off costs such as
kernel compiles, the second shows the steady state), then a host profile (cProfile) of one more pass at a length never
seen, so that any cost that recurs per new prompt length shows up by name.

    python scripts/profile_prefill.py CHECKPOINT [--device cuda] [--lengths 39,30,31] [--slots N | --vram-budget 12GiB]
        [--expert-dtype int4] [--steady]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moeprefetch import MoEPrefetchEngine  # noqa: E402


def ttft(engine: MoEPrefetchEngine, length: int, seed: int) -> float:
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, engine.args.vocab_size, (length,), generator=generator).tolist()
    result = engine.generate([prompt], max_new_tokens=2, stop_at_eos=False)
    return result.stats.ttft_seconds


def steady_profiles(engine: MoEPrefetchEngine, length: int) -> dict[str, str]:
    """A repeat of a seen prompt length under cProfile (own time: where the host's Python goes) and under the torch
    profiler (host and device time per op, kernel launches)."""
    from torch.profiler import ProfilerActivity, profile

    ttft(engine, length, 4)
    profiler = cProfile.Profile()
    profiler.enable()
    seconds = ttft(engine, length, 5)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        traced = ttft(engine, length, 6)
    averages = prof.key_averages()
    launches = sum(e.count for e in averages if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    table = averages.table(sort_by="self_cpu_time_total", row_limit=40)
    device_table = averages.table(sort_by="self_device_time_total", row_limit=25) if engine.device.type == "cuda" \
        else ""
    summary = {"prompt_tokens": length, "ttft_steady_s": seconds, "ttft_traced_s": traced, "kernel_launches": launches}
    print(json.dumps(summary), flush=True)
    print(text.getvalue()[:12000])
    print(table)
    print(device_table)
    return {"steady": json.dumps(summary), "steady_cprofile": text.getvalue(), "steady_ops_by_host": table,
            "steady_ops_by_device": device_table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", default="39,30,31")
    parser.add_argument("--slots", type=int, default=None, help="expert cache slots (default: all resident)")
    parser.add_argument("--vram-budget", default=None, help="size the expert cache by a budget instead, e.g. 12GiB")
    parser.add_argument("--expert-dtype", default="model", help="the experts' format (model, fp8, int8, int4)")
    parser.add_argument("--max-seq-len", type=int, default=None, help="the context (and so the KV cache) planned")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--steady", action="store_true",
                        help="also profile a repeat of the first length (steady state): the host's Python by "
                             "function (cProfile, own time) and the torch ops' host and device time, with the count "
                             "of kernel launches")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    engine = MoEPrefetchEngine.from_pretrained(args.checkpoint, device=args.device, dtype=dtype, progress=False,
                                               expert_cache_slots=args.slots, vram_budget=args.vram_budget,
                                               expert_dtype=args.expert_dtype, max_seq_len=args.max_seq_len)
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = []
    for length in lengths:
        first, second = ttft(engine, length, 1), ttft(engine, length, 2)
        rows.append({"prompt_tokens": length, "ttft_first_s": first, "ttft_second_s": second})
        print(json.dumps(rows[-1]), flush=True)
    steady = steady_profiles(engine, lengths[0]) if args.steady else {}
    profiler = cProfile.Profile()
    fresh = max(lengths) + 7  # a length no pass above has seen
    started = time.perf_counter()
    profiler.enable()
    seconds = ttft(engine, fresh, 3)
    profiler.disable()
    print(json.dumps({"prompt_tokens": fresh, "ttft_profiled_s": seconds,
                      "wall_s": time.perf_counter() - started}), flush=True)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
    print(text.getvalue())
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "profile": text.getvalue(), **steady}, indent=1))
    engine.close()


if __name__ == "__main__":
    main()
