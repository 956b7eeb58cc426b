#!/usr/bin/env python
"""Development aid on the GPU: a tiny checkpoint through the engine step by step, timing each call, with a stack
dump every 30 s so that a hang shows where it is."""

from __future__ import annotations

import faulthandler
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
faulthandler.dump_traceback_later(30, repeat=True)

from conftest import load_script  # noqa: E402
from moeprefetch import MoEPrefetchEngine  # noqa: E402


def say(*args) -> None:
    print(f"[{time.perf_counter() - T0:7.2f}s]", *args, flush=True)


T0 = time.perf_counter()
path = load_script("make_tiny_checkpoint").make_tiny_checkpoint(Path(tempfile.mkdtemp()), "deepseek_v3")
say("checkpoint")
ref = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16)
expected = ref.generate([[3, 4, 5, 6]], max_new_tokens=8, stop_at_eos=False).sequences
say("all-resident", expected)
for graphs in (False, True):
    engine = MoEPrefetchEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, expert_cache_slots=5,
                                               cuda_graphs=graphs)
    for predictor in ("none", "next_layer_gate", "mtp", "oracle"):
        for _ in range(2):
            t = time.perf_counter()
            out = engine.generate([[3, 4, 5, 6]], max_new_tokens=8, stop_at_eos=False, predictor=predictor)
            say(f"graphs={graphs} {predictor}", out.sequences == expected, f"{time.perf_counter() - t:.2f}s",
                {k: out.stats.to_dict()[k] for k in ("hits", "misses", "prefetch_issued", "syncs_per_token")},
                "captured", [s.captured for s in engine._steps.values()])
    engine.close()
say("done")
