#!/usr/bin/env python
"""Settings sweep for the prefetch fills on the GPU: the fill kernel's load block, how long a late expert's wait may
poll, the side stream's priority, and prefetch victims (`spare_recent`), on one loaded engine per workload.

Each variant patches the engine's live fill settings, drops the captured step graphs (the next call captures with the
new settings) and runs the same rows as `bench_gpu.py` (warm-up, cold cache per run, medians). Rows go to --out.

    python scripts/tune_fills.py --out /tmp/tune.json --workloads ref17,v2lite
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_gpu  # noqa: E402
from moeprefetch import MoEPrefetchEngine  # noqa: E402
from moeprefetch.residency import fill  # noqa: E402

logger = logging.getLogger("tune_fills")

VARIANTS = {  # name -> (fill block, await spins, high-priority side stream)
    "default": (fill.FILL_BLOCK, fill.AWAIT_SPINS, False),
    "spins2k": (2048, 2048, False),
    "priority": (2048, 2048, True),
    "block8k": (8192, 2048, False),
    "spins64k": (2048, 1 << 16, False),
    "all": (8192, 1 << 16, True),
}


def apply(engine: MoEPrefetchEngine, block: int, spins: int, high_priority: bool) -> None:
    """Set the fill settings on a loaded engine; the next decode step captures a fresh graph with them."""
    fill.FILL_BLOCK = block
    fill.AWAIT_SPINS = spins
    side = engine.residency.side
    side.stream = torch.cuda.Stream(device=engine.device, priority=-1 if high_priority else 0)
    for step in engine._steps.values():
        step.release()
    engine._steps.clear()
    torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workloads", default="ref17,v2lite")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/moeprefetch-bench"))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--budget-gib", type=float, default=12.0)
    parser.add_argument("--time-limit", type=float, default=540.0, help="stop starting rows after this many s")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    started = time.perf_counter()
    device = torch.device("cuda")
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []

    def save() -> None:
        args.out.write_text(json.dumps({"environment": bench_gpu.environment(device), "rows": rows}, indent=1,
                                       default=str))

    common = dict(device="cuda", dtype=torch.bfloat16, max_seq_len=1024, max_batch_size=1, progress=False)
    for name in args.workloads.split(","):
        if name == "ref17":
            path = bench_gpu.write_padded_reference(ROOT / "moeprefetch/reference_model", args.workdir / "ref17",
                                                    int(17.3e6))
            prompts = bench_gpu.prompts_for(path, ROOT / "experiments/prompts/heldout.jsonl", 8192, args.runs, 64, 1)
            engine = MoEPrefetchEngine.from_pretrained(path, **common, expert_cache_slots=40)
            systems = [("none", "none", 0.0, None), ("oracle", "oracle", 0.0, 1), ("mtp", "mtp", 0.0, None),
                       ("mtp_spare0", "mtp", 0.0, None), ("mtp+next_layer_gate_spare0", "mtp+next_layer_gate",
                                                          0.0, None)]
        else:
            path = bench_gpu.write_random_checkpoint(args.workdir / name, bench_gpu.V2LITE, device)
            prompts = bench_gpu.prompts_for(path, None, bench_gpu.V2LITE["vocab_size"], args.runs, 64, 1)
            engine = MoEPrefetchEngine.from_pretrained(path, **common, vram_budget=f"{args.budget_gib}GiB")
            systems = [("oracle", "oracle", 0.0, 1), ("none", "none", 0.0, None)]
        options = engine.options
        for variant in args.variants.split(","):
            apply(engine, *VARIANTS[variant])
            for system, predictor, cut, lookahead in systems:
                if time.perf_counter() - started > args.time_limit:
                    logger.warning("time limit: skipping %s %s %s", name, variant, system)
                    continue
                engine.options = dataclasses.replace(options, spare_recent=0 if system.endswith("spare0") else
                                                     options.spare_recent)
                row = bench_gpu.run_row(engine, system, prompts, args.new_tokens, predictor=predictor,
                                        runs=args.runs, lookahead=lookahead, min_confidence=cut)
                row.pop("sequences")
                row.update(workload=name, variant=variant, fill_block=fill.FILL_BLOCK, await_spins=fill.AWAIT_SPINS,
                           side_priority="high" if VARIANTS[variant][2] else "default")
                rows.append(row)
                save()
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k in (
                    "workload", "variant", "system", "ms_per_token", "decode_bytes_h2d_per_token",
                    "zero_copy_bytes_per_token", "fill_bytes_per_token", "prefetch_late", "decode_h2d_gbps")}),
                      flush=True)
        engine.options = options
        engine.close()
        if name != "ref17":
            subprocess.run(["rm", "-rf", str(args.workdir / name)])
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
