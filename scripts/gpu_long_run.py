#!/usr/bin/env python
"""Long offloaded decode on the GPU: do VRAM, pinned and host memory stay flat over ~10,000 decode steps?

The shipped reference model at 25 % cached with `mtp+next_layer_gate` (shadow rows, fills, graphs): calls of
`--tokens-per-call` new tokens, each from a short prompt. After every call it records allocated and reserved VRAM,
the process's resident host memory and the call's decode speed, and rewrites the JSON, so a run cut short still
reports what it saw. Then `close()`, and VRAM after it.

    python scripts/gpu_long_run.py --out /tmp/long_run.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moeprefetch import MoEPrefetchEngine  # noqa: E402
from moeprefetch.cli import REFERENCE_MODEL  # noqa: E402

MiB = 1024**2


def rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=10_000, help="decode steps in all")
    parser.add_argument("--tokens-per-call", type=int, default=1000)
    parser.add_argument("--predictor", default="mtp+next_layer_gate")
    ns = parser.parse_args(argv)
    engine = MoEPrefetchEngine.from_pretrained(REFERENCE_MODEL, device="cuda", dtype=torch.bfloat16,
                                               expert_cache_fraction=0.25, max_batch_size=1, max_seq_len=2048)
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "predictor": ns.predictor,
                    "cache_slots": engine.residency.n_slots, "calls": []}
    prompts = [[0, 464, 1085, 262, 1628, 318], [0, 383, 3047, 286], [0, 1640, 11, 290]]
    engine.generate([prompts[0]], max_new_tokens=16, stop_at_eos=False, predictor=ns.predictor)  # warm-up
    torch.cuda.synchronize()
    report["after_warmup"] = {"allocated_mib": torch.cuda.memory_allocated() / MiB,
                              "reserved_mib": torch.cuda.memory_reserved() / MiB, "rss_mib": rss_mib()}
    steps, call = 0, 0
    while steps < ns.steps:
        start = time.perf_counter()
        result = engine.generate([prompts[call % len(prompts)]], max_new_tokens=ns.tokens_per_call,
                                 stop_at_eos=False, predictor=ns.predictor)
        stats = result.stats.to_dict()
        if stats["decode_steps"] == 0:
            raise SystemExit("a call made no decode step: give --tokens-per-call of at least 2")
        steps += stats["decode_steps"]
        call += 1
        report["calls"].append({
            "call": call, "decode_steps_total": steps, "seconds": time.perf_counter() - start,
            "ms_per_token": stats["ms_per_token"], "syncs_per_token": stats["syncs_per_token"],
            "allocated_mib": torch.cuda.memory_allocated() / MiB, "reserved_mib": torch.cuda.memory_reserved() / MiB,
            "peak_allocated_mib": torch.cuda.max_memory_allocated() / MiB, "rss_mib": rss_mib(),
            "problems": engine.residency.problems()})
        ns.out.write_text(json.dumps(report, indent=1))
    first, last = report["calls"][0], report["calls"][-1]
    report["growth_after_first_call"] = {k: last[k] - first[k] for k in ("allocated_mib", "reserved_mib", "rss_mib")}
    engine.close()
    del engine
    torch.cuda.synchronize()
    report["after_close_allocated_mib"] = torch.cuda.memory_allocated() / MiB
    ns.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "calls"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
