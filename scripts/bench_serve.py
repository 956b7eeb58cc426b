#!/usr/bin/env python
"""Serving benchmark (issue 19): `moeprefetch serve`'s engine and scheduler in-process on the V2-Lite shape (random
weights, --budget-gib), driven over HTTP by C concurrent streaming clients for C in --concurrency: aggregate decode
tokens/s and per-request time per output token (p50/p99), plus time to first token; then the engine's own batched
`generate` on the same prompts at the same batch and budget (`engine_b{C}`: C requests per call, as many calls as
the server got requests), so that each server row has its overhead beside it (`server_overhead`: the engine's
aggregate tokens/s over the server's, minus one). `--expert-dtype` picks the experts' format (int4: the smallest).
One JSON file of rows.

    python scripts/bench_serve.py --out experiments/results/serve_h200.json            # on the GPU machine
    python scripts/bench_serve.py --device cpu --scale tiny --out /tmp/serve.json         # a check of the script
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import logging
import socket
import statistics
import sys
import threading
import time
import multiprocessing
import multiprocessing.pool
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_gpu import environment, link_bandwidth, prompts_for, random_v2lite_engine  # noqa: E402
from moeprefetch import MoEPrefetchEngine  # noqa: E402

logger = logging.getLogger("bench_serve")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@functools.lru_cache(maxsize=1)
def _http_client():
    """One HTTP client per client process, made before any request is timed: a new httpx client loads its
    certificate bundle (tens of ms), which the twenty-first session's first call timed inside every time to first
    token (its `serve_c1` TTFT 195 ms against the engine's 105)."""
    import httpx

    return httpx.Client(timeout=600)


def stream_request(url: str, prompt: list[int], max_tokens: int) -> dict[str, float]:
    """One streaming completion: arrival time of each token's chunk."""
    client = _http_client()
    t0 = time.perf_counter()
    arrivals = []
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"][0]["finish_reason"] is None:
                    arrivals.append(time.perf_counter())
    tokens = len(arrivals)
    return {"ttft": arrivals[0] - t0, "tokens": tokens, "end": arrivals[-1], "start": t0,
            "tail": time.perf_counter() - arrivals[-1],  # the last token's chunk to the stream's end
            "tpot": (arrivals[-1] - arrivals[0]) / max(tokens - 1, 1)}


def run_level(clients: "multiprocessing.pool.Pool", url: str, prompts: list[list[int]], concurrency: int, requests: int,
              max_tokens: int) -> dict[str, Any]:
    """`requests` streams, `concurrency` at a time, each in one of the `clients` processes: the clients' own Python
    (HTTP, SSE parsing) must not take the server process's interpreter lock, as real clients never do."""
    def one(i: int) -> dict[str, float]:
        return clients.apply_async(stream_request, (url, prompts[i % len(prompts)], max_tokens)).get()

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(requests)))
    elapsed = time.perf_counter() - started
    tpot = [r["tpot"] for r in results]
    quantile = (lambda v, q: statistics.quantiles(v, n=100)[q - 1] if len(v) > 1 else v[0])  # noqa: E731
    return {"concurrency": concurrency, "requests": requests, "max_tokens": max_tokens, "seconds": elapsed,
            "output_tokens": sum(r["tokens"] for r in results),
            "decode_tokens_per_s": sum(r["tokens"] for r in results) / elapsed,
            "tpot_p50_ms": 1000 * quantile(tpot, 50), "tpot_p99_ms": 1000 * quantile(tpot, 99),
            "ttft_p50_ms": 1000 * quantile([r["ttft"] for r in results], 50),
            "stream_end_p50_ms": 1000 * quantile([r["tail"] for r in results], 50),
            # how far apart the first wave's requests began (perf_counter is the system's monotonic clock, the same
            # in every client process): requests that arrive apart are admitted between steps, one prefill each
            "first_wave_spread_ms": 1000 * (max(r["start"] for r in results[:concurrency]) -
                                            min(r["start"] for r in results[:concurrency]))}


def engine_level(engine: MoEPrefetchEngine, prompts: list[list[int]], batch: int, requests: int, max_tokens: int,
                 predictor: str | None) -> dict[str, Any]:
    """The engine's batched generate over the same requests as a server level: `requests` prompts in calls of
    `batch`, greedy, `max_tokens` each, never stopping at EOS (as the server's `ignore_eos`), after one untimed call
    of the same batch (it compiles and captures that step shape: the twentieth session's rows without it timed a
    first call's 5 s of capture)."""
    engine.generate([prompts[i % len(prompts)] for i in range(batch)], max_new_tokens=8, stop_at_eos=False,
                    predictor=predictor)
    started = time.perf_counter()
    tokens, ttft, step_ms = 0, [], []
    for first in range(0, requests, batch):
        chunk = [prompts[i % len(prompts)] for i in range(first, min(first + batch, requests))]
        result = engine.generate(chunk, max_new_tokens=max_tokens, stop_at_eos=False, predictor=predictor)
        tokens += sum(len(seq) for seq in result.sequences)
        ttft.append(result.stats.ttft_seconds)
        step_ms.append(1000 * result.stats.decode_seconds / max(result.stats.decode_steps, 1))
    elapsed = time.perf_counter() - started
    return {"concurrency": batch, "requests": requests, "max_tokens": max_tokens, "seconds": elapsed,
            "output_tokens": tokens, "decode_tokens_per_s": tokens / elapsed,
            "ttft_p50_ms": 1000 * statistics.median(ttft), "ms_per_decode_step_p50": statistics.median(step_ms)}


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from moeprefetch.serve.app import build_app
    from moeprefetch.serve.lifecycle import freeze_loaded_objects, thaw_loaded_objects

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/serve_h200.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", choices=["full", "tiny"], default="full")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/moeprefetch-bench"))
    parser.add_argument("--budget-gib", type=float, default=12.0)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="the engine's context (default: a request's prompt and output tokens and 8); it also "
                             "bounds the prefill chunk and window, so the default's windows hold two 64-token "
                             "prompts: a served model's longer context prefills a wave of requests in one window")
    parser.add_argument("--predictor", default=None)
    parser.add_argument("--expert-dtype", default="model", help="the experts' format (model, fp8, int8, int4)")
    parser.add_argument("--routing-trace", type=Path, default=None,
                        help="decode steps route from this trace (../shared/traces; row r of a step of R rows starts "
                             "r/R of the way into it), so a batch's rows share experts as real text's do")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the server's steps always compute every row (serve --batch-invariant)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = torch.device(args.device)
    levels = [int(c) for c in args.concurrency.split(",")]
    engine = random_v2lite_engine(
        args.workdir, "v2lite_serve", args.scale, device, args.budget_gib, max_batch_size=max(levels),
        max_seq_len=args.max_seq_len or args.prompt_tokens + args.max_tokens + 8,
        expert_cache_slots=None if args.scale == "full" else 8, expert_dtype=args.expert_dtype,
        routing_trace=str(args.routing_trace) if args.routing_trace else None)
    app = build_app(engine, "bench", args.predictor, max_queue=4 * max(levels), drain_seconds=5,
                    batch_invariant=args.batch_invariant)
    freeze_loaded_objects()  # as `moeprefetch serve` does before it listens
    atexit.register(thaw_loaded_objects)  # given back however the run ends (else Triton reports 'leaked' objects)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    scheduler = app.state.server.scheduler
    prompts = prompts_for(engine.path, None, engine.args.vocab_size, 16, args.prompt_tokens, seed=3)
    report: dict[str, Any] = {"environment": environment(device), "link": link_bandwidth(device),
                              "plan": engine.plan.describe(), "rows": []}
    # client processes started fresh (spawn: the server process holds CUDA and threads), one per concurrent stream,
    # all started now (a ProcessPoolExecutor starts them on demand and, counting finished tasks as idle workers,
    # started one only: the first call of this script served its "concurrent" clients one after another)
    # each with its HTTP client made as it starts: a client process's first request would otherwise time the import
    # of httpx and its certificate bundle (the thirtieth session's int4 `serve_c1`: 3 requests 0.39 s slower in all
    # than the engine's, at the same 4.05 ms per output token)
    clients = multiprocessing.get_context("spawn").Pool(max(levels), initializer=_http_client)
    stream_request(url, prompts[0], 8)  # warm-up: compiles kernels and captures the batch's one-row step graph
    common = dict(workload="v2lite", vram_budget_gib=args.budget_gib, max_batch_size=max(levels),
                  expert_dtype=args.expert_dtype, cache_slots=engine.plan.expert_slots,
                  batch_invariant=args.batch_invariant, max_seq_len=engine.options.max_seq_len,
                  prefill_window=engine.options.prefill_window,
                  routing_trace=args.routing_trace.name if args.routing_trace else None,
                  predictor=engine.options.predictor if args.predictor is None else args.predictor)

    def emit(row: dict[str, Any]) -> None:
        report["rows"].append(row)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))

    served = {}
    for level in levels:
        run_level(clients, url, prompts, level, level, 8)  # untimed: the level's step shapes compile and capture
        before = scheduler.snapshot()
        served[level] = run_level(clients, url, prompts, level, level * args.requests_per_client, args.max_tokens)
        after = scheduler.snapshot()
        # rows per decode step: how much the server batched (the level's concurrency at most)
        steps = max(after["decode_steps"] - before["decode_steps"], 1)
        served[level]["tokens_per_decode_step"] = (after["completion_tokens"] - before["completion_tokens"]) / steps
        # where the scheduler thread's time went: each admission's prefill (every stream waits for it) and the steps
        served[level]["prefill_ms_per_request"] = 1000 * (after["prefill_seconds"] - before["prefill_seconds"]) / max(
            served[level]["requests"], 1)
        served[level]["ms_per_decode_step"] = 1000 * (after["decode_seconds"] - before["decode_seconds"]) / steps
        # how well the server gathered requests sent together: the share prefilled with others, and in how many groups
        served[level]["admitted_together_share"] = (after["admitted_together"] - before["admitted_together"]) / max(
            served[level]["requests"], 1)
        served[level]["joint_admissions"] = after["joint_admissions"] - before["joint_admissions"]
        # and their median, as the engine's rows give theirs (a mean takes in the admissions' slow first steps)
        served[level]["ms_per_decode_step_p50"] = 1000 * statistics.median(after["recent_step_seconds"][-steps:])
        emit({**served[level], **common, "system": f"serve_c{level}"})
    clients.close()
    clients.join()
    server.should_exit = True  # the engine serves one caller at a time: the server stops before the baseline
    thread.join(timeout=30)
    for level in levels:
        row = engine_level(engine, prompts, level, level * args.requests_per_client, args.max_tokens, args.predictor)
        row["server_overhead"] = row["decode_tokens_per_s"] / served[level]["decode_tokens_per_s"] - 1
        emit({**row, **common, "system": f"engine_b{level}"})
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
