"""Where the routed experts are: the device residency table, its plans, prefetch fills and the expert compute.

`Residency` owns the VRAM slot pool, the page-locked host store, the table (`state.py`) and the three kernel launchers
(plan, fill, routed experts). A decode step calls, per MoE layer and without any host decision:

    plan(position, ...)   -> which slots to read, which misses to admit, which fills to reserve
    fill(position)        -> on the side stream: the fills in deadline order, behind this layer's compute
    experts(...)          -> every selected expert, from its slot or straight from host memory

and `begin_step` / `end_step` around the step. Prefill (many tokens per expert, `prefill.py`) plans each layer of a
window of chunks with the same kernel and runs the layer's experts as grouped GEMMs: on the device's own plan when
every expert is resident; otherwise the host reads the plan once and the used experts cross once per window through
staging rows placed after the pool, in batches that copy while the previous batch computes.

Expert parallelism (`placement.py`): on each rank the table, pool and host store hold only that rank's experts,
numbered locally per layer. Selected experts are mapped to local numbers at this boundary (-1: another rank's,
skipped by the plan and the kernels), and the routed output is combined after one all-reduce of the per-(row, k)
products, so every rank gets the bits one process would.
"""

from __future__ import annotations

from .residency import (ENTRIES, PREFILL_STAGING_BYTES, PREFILL_STAGING_SHARE, RING_CAPACITY, PlanBuffers, Residency,
                        counters_by_layer, prefill_staging_rows, renormalise)

__all__ = ["ENTRIES", "PREFILL_STAGING_BYTES", "PREFILL_STAGING_SHARE", "RING_CAPACITY", "PlanBuffers", "Residency",
           "counters_by_layer", "prefill_staging_rows", "renormalise"]
