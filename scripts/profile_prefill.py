#!/usr/bin/env python
"""Where a prompt's time to first token goes: each prompt length twice (the first pass pays one-off costs such as
kernel compiles, the second shows the steady state), then a host profile (cProfile) of one more pass at a length never
seen, so that any cost that recurs per new prompt length shows up by name.

    python scripts/profile_prefill.py CHECKPOINT [--device cuda] [--lengths 39,30,31] [--slots N]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", default="39,30,31")
    parser.add_argument("--slots", type=int, default=None, help="expert cache slots (default: all resident)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    engine = MoEPrefetchEngine.from_pretrained(args.checkpoint, device=args.device, dtype=dtype, progress=False,
                                               expert_cache_slots=args.slots)
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = []
    for length in lengths:
        first, second = ttft(engine, length, 1), ttft(engine, length, 2)
        rows.append({"prompt_tokens": length, "ttft_first_s": first, "ttft_second_s": second})
        print(json.dumps(rows[-1]), flush=True)
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
        args.out.write_text(json.dumps({"rows": rows, "profile": text.getvalue()}, indent=1))
    engine.close()


if __name__ == "__main__":
    main()
