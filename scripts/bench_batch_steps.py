"""A continuous batch's decode step (what `moeprefetch serve` runs per token) by the sampling paths its shape takes:
the paths its rows use (`sampling.row_paths`: greedy rows take the argmax) against every path on (temperature, top-k
and top-p for every row: the served step before `row_paths`). V2-Lite's shape, random weights, one engine; each
variant is the median of `--steps` replays of the same captured step over the same rows, after warm-up replays.

    python3 scripts/bench_batch_steps.py --expert-dtype int4 --out experiments/results/batch_steps_h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_gpu import environment, random_v2lite_engine  # noqa: E402
from moeprefetch.batching import ContinuousBatch  # noqa: E402
from moeprefetch.decode import run_rows  # noqa: E402
from moeprefetch.sampling import SamplingParams, row_paths  # noqa: E402

MIXES = {
    "greedy": SamplingParams(),
    "temperature": SamplingParams(temperature=0.8, seed=1),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9, seed=1),
}
EVERY_PATH = SamplingParams(temperature=1.0, top_k=1, top_p=0.5)


def timed_steps(batch: ContinuousBatch, rows: int, paths: SamplingParams, steps: int) -> float:
    """Median ms of one step of the first `rows` rows with `paths` (the same inputs every replay)."""
    step = batch.decode_step(rows, paths)
    states = batch.state[:rows]
    for _ in range(3):  # eager first run, capture, one replay
        run_rows(step, states)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run_rows(step, states)  # returns after the step's one synchronisation
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", choices=["full", "tiny"], default="full")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/moeprefetch-bench"))
    parser.add_argument("--expert-dtype", default="int4")
    parser.add_argument("--budget-gib", type=float, default=12.0)
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--steps", type=int, default=50)
    ns = parser.parse_args()
    device = torch.device(ns.device)
    levels = [int(r) for r in ns.rows.split(",")]
    engine = random_v2lite_engine(ns.workdir, "v2lite_serve", ns.scale, device, ns.budget_gib,
                                  max_batch_size=max(levels), max_seq_len=128, expert_dtype=ns.expert_dtype)
    report = {"environment": environment(device), "plan": engine.plan.describe(), "command": sys.argv, "rows": []}
    generator = torch.Generator().manual_seed(3)
    for mix, params in MIXES.items():
        for rows in levels:
            batch = ContinuousBatch(engine, "none")
            for _ in range(rows):
                prompt = torch.randint(3, engine.args.vocab_size, (16,), generator=generator).tolist()
                batch.admit(prompt, 64, params)
            live = [s for s in batch.sampling[:rows] if s is not None]
            for variant, paths in (("row_paths", row_paths(live, engine.args.vocab_size)), ("every_path", EVERY_PATH)):
                row = {"mix": mix, "rows": rows, "variant": variant, "expert_dtype": ns.expert_dtype,
                       "cache_slots": engine.plan.expert_slots,
                       "ms_per_step": round(timed_steps(batch, rows, paths, ns.steps), 3)}
                report["rows"].append(row)
                print(json.dumps(row), flush=True)
            for row in batch.active_rows:
                batch.release(row)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(report, indent=1, default=str))
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
