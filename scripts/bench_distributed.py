#!/usr/bin/env python
"""Expert-parallel decode benchmark (issue 18), one process per GPU under torchrun:

    torchrun --nproc-per-node 2 scripts/bench_distributed.py --out experiments/results/distributed_h200.json
    torchrun --nproc-per-node 2 scripts/bench_distributed.py --device cpu --scale tiny --out /tmp/dist.json  # check

V2-Lite shape (random weights), batch 1, for each system (reactive `none` and `next_layer_gate`): `--budget-gib` per
GPU, and the same total split over the GPUs. Rows carry `gpus` (the world size), the budgets, the medians of
`bench_gpu.run_row` (statistics count every rank's experts together; `decode_bytes_h2d_per_token` is every link's
sum) and `allreduce_ms_per_token`: the MoE layers' all-reduces of one decode token timed alone (one [1, k, H + 1] fp32
tensor per MoE layer). Rank 0 writes the JSON; on one GPU (`--nproc-per-node 1`) the same rows give the baseline.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_gpu import V2LITE, environment, prompts_for, run_row, tiny, write_random_checkpoint  # noqa: E402
from moeprefetch import MoEPrefetchEngine  # noqa: E402
from moeprefetch.distributed import local_device  # noqa: E402

logger = logging.getLogger("bench_distributed")


def allreduce_ms_per_token(engine: MoEPrefetchEngine, repeats: int = 200) -> float:
    """The decode step's all-reduces alone: one per MoE layer, each of a batch-1 row's packed products."""
    res, args = engine.residency, engine.args
    if res.group is None or res.group.world == 1:
        return 0.0
    packed = torch.zeros(1, args.num_experts_per_tok, args.hidden_size + 1, device=engine.device)
    layers = len(res.layers)

    def sync() -> None:
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)

    for _ in range(10):
        dist.all_reduce(packed)
    sync()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(packed)
        sync()
        times.append((time.perf_counter() - start) / repeats)
    return 1000 * statistics.median(times) * layers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/distributed_h200.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", choices=["full", "tiny"], default="full")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/moeprefetch-bench"))
    parser.add_argument("--budget-gib", type=float, default=12.0, help="VRAM budget per GPU")
    parser.add_argument("--systems", default="none,next_layer_gate")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = local_device(torch.device(args.device))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # the engines join this group
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = tiny(V2LITE) if args.scale == "tiny" else V2LITE
    path = args.workdir / ("v2lite_tiny" if args.scale == "tiny" else "v2lite")
    if rank == 0:
        write_random_checkpoint(path, shape, device)
    dist.barrier()
    prompts = prompts_for(path, None, shape["vocab_size"], 3, 64, seed=0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    budgets = [("per_gpu", args.budget_gib), ("split", args.budget_gib / world)] if world > 1 else \
        [("per_gpu", args.budget_gib)]
    rows = []
    for label, per_gpu in budgets:
        sizing = {"vram_budget": f"{per_gpu}GiB"} if args.scale == "full" else {"expert_cache_fraction": 0.25}
        engine = MoEPrefetchEngine.from_pretrained(path, device=str(device), dtype=dtype, distributed=True,
                                                   max_seq_len=256, max_batch_size=1, **sizing)
        reduce_ms = allreduce_ms_per_token(engine)
        memory = engine.memory_stats()
        for system in args.systems.split(","):
            row = run_row(engine, system, prompts, args.new_tokens, predictor=system, runs=args.runs)
            row.pop("sequences", None)
            row.update(workload="v2lite", gpus=world, budget=label, vram_budget_gib_per_gpu=per_gpu,
                       vram_budget_gib_total=per_gpu * world, allreduce_ms_per_token=reduce_ms,
                       expert_cache_slots_per_gpu=memory["expert_cache_slots"],
                       host_expert_gib_per_gpu=memory["host_expert_bytes"] / 2**30)
            rows.append(row)
            if rank == 0:
                logger.info("%s", json.dumps({k: row[k] for k in ("system", "gpus", "budget", "ms_per_token",
                                                                   "decode_tokens_per_s", "allreduce_ms_per_token")}))
        engine.close()
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"environment": environment(device), "world": world, "rows": rows}, indent=1,
                                       default=str))
        logger.info("wrote %s", args.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
