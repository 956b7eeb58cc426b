"""Prefill's routed experts: many tokens per expert, over a window of chunks that run each layer together.

A prefill window is a few chunks of one prompt, or of a batch's prompts (`session.prefill_rows`), that run layer by
layer together (`runner.forward_window`), so each MoE layer sees every chunk's routing at once and an expert that
several chunks use crosses the link once per window, not once per chunk. The layer's plan runs on the device over every expert (the used ones active), with the same plan
kernel as decode:

- **every expert resident**: nothing is left for the host to decide; the grouped GEMMs run on the device's own plan
  and the layer never waits for the host;
- **offloaded**: the host reads the plan once per layer (admissions and staging are copies it issues). Experts cross
  through staging rows after the slot pool, in batches: batch i+2 copies into batch i's half once batch i's GEMMs
  are done, so the copy engine streams while the GEMMs compute.

Three ways to compute a batch, chosen by the engine's format and device (never by its cache, so every cache size
gives the same bits): torch._grouped_mm over consecutive records (bf16 experts on Hopper), the Triton grouped kernel
over the record table (quantized or fp32 experts on CUDA), and a loop over experts (the CPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..kernels.definitions import expert_ffn
from ..kernels.grouped import grouped_mm_experts, plan_blocks
from ..model import combine_expert_outputs

if TYPE_CHECKING:
    from .residency import Residency


AHEAD_WHEN_USED = 0.9  # copy the next layer's experts ahead when a window used this share of the layer's experts


class LayerPlan:
    """A window's plan of one layer, read back by the host: the used experts (sorted) and where each one is."""

    def __init__(self, ids_host: list[torch.Tensor], u_of_expert: torch.Tensor, distinct: list[int],
                 slots: list[int], dsts: list[int]):
        self.ids_host, self.u_of_expert, self.distinct = ids_host, u_of_expert, distinct
        self.slots, self.dsts = slots, dsts  # per u: its slot (or -1), its admission slot (or -1)
        self.next_slots: list[int] = []  # the next layer's slot per expert (-1: not in VRAM), as read back
        self.sequence: list[int] = []  # the experts in the order they pass through staging (some maybe unused)
        self.rows: dict[int, int] = {}  # per expert: its staging row, as a slot index (the pool's rows come first)


class PrefillExperts:
    """Runs prefill's MoE layers for a `Residency` (whose pool, staging rows and launchers it uses)."""

    def __init__(self, res: "Residency", joint_tokens: int | None = None):
        self.res = res
        # every expert resident, Triton's grouped kernel: chunks run in one launch up to this many tokens (a prefill
        # chunk's, which the memory plan's workspace counts); None: each chunk alone
        self.joint_tokens = joint_tokens
        self._ahead: tuple[int, list[tuple[list[int], int]]] | None = None  # (position, [(experts, half)]) copied
        self._half = 0
        self._loop_row = 0  # the loop path's staging rows, used in turn
        self.copied_ahead = 0  # experts copied ahead of their layer's plan, this call
        self.unused_ahead = 0  # of which the layer then did not use (the bytes moved for nothing)
        self.joined_chunks = 0  # (chunk, layer)s computed in a launch with others (`_in_place_joint`), this call

    def __call__(self, layer: int, xs: list[torch.Tensor], ids: list[torch.Tensor], weights: list[torch.Tensor]
                 ) -> list[torch.Tensor]:
        """Per chunk c: xs[c] [T, H], ids/weights [T, k] -> routed output [T, H] fp32."""
        res = self.res
        position = res.position[layer]
        res.open_prefill_layer()
        out = res.host_plan
        counts = [self._pairs_per_expert(i) for i in ids]  # per chunk
        used = counts[0] if len(counts) == 1 else torch.stack(counts).sum(0)
        res.prefill_planner(position, res.every_expert, used > 0, None, None, out.assign, out.u_key, out.u_slot,
                            out.u_dst, reserve=False, count_recall=False)
        u_of_expert = out.assign[:, 0]  # u of each used expert (in expert order), -1 for the others
        if res.prefill_log is not None:
            res.prefill_log.append((layer, torch.nonzero(used).flatten().tolist()))
        if res.group is not None:  # expert parallelism: the loop's products, summed over the ranks, then combined
            return self._loop(position, xs, weights, self._read_back(position, ids, u_of_expert))
        if res.preloaded and res.grouped.use_kernels and not res.grouped_mm and self.joint_tokens:
            return self._in_place_joint(position, xs, ids, weights, u_of_expert)
        if res.preloaded and (res.grouped_mm or res.grouped.use_kernels):
            return [self._in_place(position, x, i, w, c, u_of_expert) for x, i, w, c in zip(xs, ids, weights, counts)]
        plan = self._read_back(position, ids, u_of_expert)
        if res.grouped_mm:
            return self._staged(position, xs, weights, plan, GroupedMMBatches(res))
        if res.grouped.use_kernels:
            return self._staged(position, xs, weights, plan, TritonBatches(res, position))
        return self._loop(position, xs, weights, plan)

    def _read_back(self, position: int, ids: list[torch.Tensor], u_of_expert: torch.Tensor) -> LayerPlan:
        """The layer's one host synchronisation: every chunk's routing and the plan, in one copy."""
        flat = torch.cat([i.flatten() for i in ids])
        res, out, e = self.res, self.res.host_plan, self.res.n_experts
        nxt = min(position + 1, res.cfg.positions - 1) * e  # the next layer's table entries, for copies ahead
        host = torch.cat((flat, u_of_expert.long(), out.u_slot[:e].long(), out.u_dst[:e].long(),
                          res.st.slot_of[nxt : nxt + e].long())).cpu()
        u_host, slot_host, dst_host, next_host = host[flat.shape[0] :].view(4, e)
        ids_host = list(host[: flat.shape[0]].split([i.numel() for i in ids]))
        distinct = torch.nonzero(u_host >= 0).flatten().tolist()  # sorted, so u = rank
        plan = LayerPlan([h.view(i.shape) for h, i in zip(ids_host, ids)], u_host, distinct,
                         slot_host[: len(distinct)].tolist(), dst_host[: len(distinct)].tolist())
        plan.next_slots = next_host.tolist()
        return plan

    # ---- every expert resident ----------------------------------------------------------------------------------
    def _pairs_per_expert(self, ids: torch.Tensor) -> torch.Tensor:
        """[E] int32 on the device; not bincount, whose output size would make the device wait for the host."""
        flat = ids.flatten()
        mine = flat >= 0  # < 0: another rank's expert (expert parallelism)
        return torch.zeros(self.res.n_experts, dtype=torch.int32, device=flat.device).index_add_(
            0, flat.clamp(min=0), mine.to(torch.int32))

    def _in_place_joint(self, position: int, xs: list[torch.Tensor], ids: list[torch.Tensor],
                        weights: list[torch.Tensor], u_of_expert: torch.Tensor) -> list[torch.Tensor]:
        """A window's chunks over the layer's slots with Triton's grouped kernel, those that take the same tiles
        alone in one launch (up to `joint_tokens` tokens): a product row depends only on its own token and the
        tiles (each output sums its inputs in block_k order, whichever rows share its block), so each chunk gets
        the bits it gets alone, and a window of many short prompts (a server's requests admitted together) passes
        over the experts once, not once per prompt. cuBLAS's grouped GEMM (bf16 on Hopper) makes no such promise:
        its chunks run alone."""
        res, out = self.res, [None] * len(xs)
        groups: dict = {}  # tiles -> runs of chunks as [chunks, tokens], each within joint_tokens
        for c, i in enumerate(ids):
            runs, tokens = groups.setdefault(res.grouped.tiles_for(i.numel(), res.n_experts), []), xs[c].shape[0]
            if not runs or runs[-1][1] + tokens > self.joint_tokens:
                runs.append([[], 0])
            runs[-1][0].append(c)
            runs[-1][1] += tokens
        for tiles, runs in groups.items():
            for run, _ in runs:
                self.joined_chunks += len(run) if len(run) > 1 else 0
                joined = [torch.cat([t[m] for m in run]) if len(run) > 1 else t[run[0]] for t in (xs, ids, weights)]
                y = self._in_place(position, *joined, None, u_of_expert, tiles)
                for m, part in zip(run, y.split([xs[m].shape[0] for m in run])):
                    out[m] = part
        return out  # type: ignore[return-value]

    def _in_place(self, position: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  counts: torch.Tensor | None, u_of_expert: torch.Tensor, tiles=None) -> torch.Tensor:
        """One chunk (or chunks joined: `_in_place_joint`, with the `tiles` each takes alone) over the layer's slots
        (slot = key: a layer's experts are consecutive slots), on the device's own plan: nothing here waits for the
        host."""
        res, k = self.res, ids.shape[1]
        if res.grouped_mm:
            e = res.n_experts
            order = torch.sort(ids.flatten(), stable=True).indices  # by expert, then pair
            y = grouped_mm_experts(x[order // k], counts, res.pool[position * e : (position + 1) * e], res.fmt,
                                   res.act)
        else:
            out = res.host_plan
            tiles = tiles or res.grouped.tiles_for(ids.numel(), res.n_experts)
            pair_token, order, blocks = plan_blocks(ids, u_of_expert, tiles.block_m, n_u=res.n_experts)
            y = res.grouped(x.contiguous(), pair_token, blocks, out.u_key, out.u_slot, tiles=tiles)
        products = torch.empty_like(y)
        products[order] = y  # back to (token, k) order
        return combine_expert_outputs(products.view(x.shape[0], k, -1), weights, None)

    # ---- offloaded: staged batches ------------------------------------------------------------------------------
    def _staged(self, position: int, xs: list[torch.Tensor], weights: list[torch.Tensor], plan: LayerPlan,
                compute_batch) -> list[torch.Tensor]:
        """Every used expert through consecutive staging rows, in batches of half the rows: those the previous layer
        already copied ahead, then those in host memory, then those in slots (a copy on the device). Host batches
        come before slotted ones so that the link, the bottleneck, restarts as soon as the first batch frees its
        half (slotted first kept it idle through their GEMMs: `17d537e`'s 8,192-token trace, BENCHMARKS.md); slotted
        batches cost the copy engine almost nothing at the end. Each batch runs on every chunk of the window before
        its rows are reused; once this layer's batches are all issued, the copy engine goes on with the next
        layer's (`_ahead`). An admitted expert is written into its slot from staging."""
        res = self.res
        half, e_count = res.stage_batch, res.n_experts
        where = {e: (slot, dst) for e, slot, dst in zip(plan.distinct, plan.slots, plan.dsts)}
        ahead = self._ahead[1] if self._ahead and self._ahead[0] == position else []
        if ahead:
            self._ahead = None  # taken: what this layer does not use is counted below
        self.forget_ahead()
        early = {e for batch, _ in ahead for e in batch}
        rest = sorted((e for e in plan.distinct if e not in early), key=lambda e: where[e][0] >= 0)  # host first
        batches = [(batch, half_) for batch, half_ in ahead] + [
            (rest[i : i + half], None) for i in range(0, len(rest), half)]
        batches = [(batch, self._take_half() if half_ is None else half_) for batch, half_ in batches]
        self.unused_ahead += len(early - set(plan.distinct))
        plan.sequence = [e for batch, _ in batches for e in batch]
        plan.rows = {e: res.n_slots + h * half + j for batch, h in batches for j, e in enumerate(batch)}
        chunks = [compute_batch.prepare(x, ids, plan) for x, ids in zip(xs, plan.ids_host)]
        res.staging.follow_compute()  # copies out of slots see every earlier write into them

        def stage(batch: list[int], h: int, layer_position: int, slot_of: dict[int, tuple[int, int]]) -> None:
            """Copy a batch into half h: from its slot, else from host memory (the next layer's: `slot_of` empty)."""
            for j, e in enumerate(batch):
                slot = slot_of.get(e, (-1, -1))[0]
                source = res.pool[slot] if slot >= 0 else res.host[layer_position * e_count + e]  # type: ignore
                res.staging.copy(source, res.slots_and_staging[res.n_slots + h * half + j], h * half + j, demand=True)

        issued = len(ahead)
        for i in range(len(ahead), min(2, len(batches))):
            stage(*batches[i], position, where)
            issued += 1
        upcoming = self._next_layer(position, plan)
        first = 0
        for i, (batch, h) in enumerate(batches):
            rows = [h * half + j for j in range(len(batch))]
            res.staging.wait_for(rows)
            for chunk in chunks:
                compute_batch(chunk, first, len(batch), res.n_slots + h * half)
            for j, e in enumerate(batch):
                slot, dst = where.get(e, (0, -1))
                if slot < 0 and dst >= 0:  # admitted: into its victim slot, stream-ordered before any read
                    res.pool[dst].copy_(res.slots_and_staging[res.n_slots + h * half + j])
            res.staging.release(rows)
            first += len(batch)
            if issued < len(batches):
                stage(*batches[issued], position, where)
                issued += 1
            elif upcoming:  # this layer's copies are all issued: the next layer's, while this one computes
                h = self._take_half()
                stage(upcoming[0], h, position + 1, {})
                self._ahead = (position + 1, (self._ahead[1] if self._ahead else []) + [(upcoming[0], h)])
                self.copied_ahead += len(upcoming.pop(0))
        return [compute_batch.finish(chunk, w) for chunk, w in zip(chunks, weights)]

    def _next_layer(self, position: int, plan: LayerPlan) -> list[list[int]]:
        """Batches of the next layer's experts to copy ahead of its router: those not in a slot, when this layer's
        window used nearly every expert (long prompts do, and then so will the next layer's); at most two batches
        (the staging rows this layer frees). Nothing past the main layers (the MTP head runs its own windows)."""
        res = self.res
        if position + 1 >= res.cfg.main_positions or len(plan.distinct) < AHEAD_WHEN_USED * res.n_experts:
            return []
        missing = [e for e, slot in enumerate(plan.next_slots) if slot < 0]
        half = res.stage_batch
        return [missing[i : i + half] for i in range(0, min(len(missing), 2 * half), half)]

    def _take_half(self) -> int:
        """The staging half for the next batch: halves alternate across batches and layers."""
        self._half += 1
        return (self._half - 1) % 2

    def forget_ahead(self) -> None:
        """Drop the copies ahead (their rows stay guarded by their events); any not yet taken moved for nothing."""
        if self._ahead is not None:
            self.unused_ahead += sum(len(batch) for batch, _ in self._ahead[1])
        self._ahead = None

    def begin_call(self) -> None:
        self.forget_ahead()
        self.copied_ahead = self.unused_ahead = self.joined_chunks = 0

    # ---- the CPU ------------------------------------------------------------------------------------------------
    def _loop(self, position: int, xs: list[torch.Tensor], weights: list[torch.Tensor], plan: LayerPlan
              ) -> list[torch.Tensor]:
        """Each used expert once per window (from its slot, its admission slot or staging), on every chunk."""
        res = self.res
        if res.staging is not None:  # the grouped kernels may have stopped mid-call (a compile failure): copies on
            self.forget_ahead()  # the copy stream may still be landing in the staging rows this path writes
            res.staging.wait_for(list(range(res.stage_rows)))
        products = [torch.zeros((x.shape[0], w.shape[1], x.shape[1]), dtype=x.dtype, device=x.device)
                    for x, w in zip(xs, weights)]
        for u, expert in enumerate(plan.distinct):
            record = self._record(position * res.n_experts + expert, plan.slots[u], plan.dsts[u])
            gate_up, down = res.fmt.dequantize(record.view(1, -1))
            for x, ids_host, p in zip(xs, plan.ids_host, products):
                rows, kpos = torch.nonzero(ids_host == expert, as_tuple=True)
                if rows.numel():
                    rows_d, kpos_d = rows.to(res.device), kpos.to(res.device)
                    p[rows_d, kpos_d] = expert_ffn(x[rows_d], gate_up[0], down[0], res.act).to(p.dtype)
        if res.group is not None:  # each (token, k) product comes from one rank: the sum is exact
            products = [res.group.all_reduce_(p) for p in products]
        return [combine_expert_outputs(p, w, None) for p, w in zip(products, weights)]

    def _record(self, key: int, slot: int, admit: int) -> torch.Tensor:
        """The VRAM bytes of an expert: its slot, its admission slot (copied in now) or a staging row."""
        res = self.res
        if slot >= 0:
            return res.pool[slot]
        target = res.pool[admit] if admit >= 0 else \
            res.slots_and_staging[res.n_slots + self._loop_row % res.stage_rows]
        self._loop_row += admit < 0
        assert res.host is not None
        target.copy_(res.host[key], non_blocking=True)  # stream-ordered before the compute that reads it
        return target


class GroupedMMBatches:
    """Staged batches as torch._grouped_mm: a chunk's pairs sorted by the expert's place in the staging sequence, so
    each batch's pairs are one run and its experts consecutive staging rows."""

    def __init__(self, res: "Residency"):
        self.res = res

    def prepare(self, x: torch.Tensor, ids_host: torch.Tensor, plan: LayerPlan) -> dict:
        res, k, sequence = self.res, ids_host.shape[1], plan.sequence
        rank = torch.zeros(res.n_experts, dtype=torch.int64)
        rank[sequence] = torch.arange(len(sequence))
        ranks = rank[ids_host.flatten()]
        order = torch.sort(ranks.to(torch.int16 if len(sequence) <= 1 << 15 else torch.int64), stable=True).indices
        counts = torch.bincount(ranks, minlength=len(sequence))
        ends = torch.cumsum(counts, 0).tolist()
        return dict(x=x, k=k, ends=[0] + ends, order=order.to(res.device, non_blocking=True),
                    counts=counts.to(torch.int32).to(res.device, non_blocking=True),
                    products=torch.empty(ids_host.numel(), x.shape[1], dtype=x.dtype, device=x.device))

    def __call__(self, chunk: dict, g0: int, n: int, first_row: int) -> None:
        lo, hi = chunk["ends"][g0], chunk["ends"][g0 + n]
        if hi == lo:
            return
        order = chunk["order"][lo:hi]
        chunk["products"][order] = grouped_mm_experts(
            chunk["x"][order // chunk["k"]], chunk["counts"][g0 : g0 + n],
            self.res.slots_and_staging[first_row : first_row + n], self.res.fmt, self.res.act)

    def finish(self, chunk: dict, weights: torch.Tensor) -> torch.Tensor:
        x = chunk["x"]
        return combine_expert_outputs(chunk["products"].view(x.shape[0], chunk["k"], -1), weights, None)


class TritonBatches:
    """Staged batches through the Triton grouped kernel, which reads each expert through the record table (here:
    every used expert at its staging row): per chunk, one block plan of its pairs, launched a batch at a time."""

    def __init__(self, res: "Residency", position: int):
        self.res = res
        self.position = position
        self.keys: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None

    def prepare(self, x: torch.Tensor, ids_host: torch.Tensor, plan: LayerPlan) -> dict:
        res, dev = self.res, self.res.device
        if self.keys is None:  # the layer's table, shared by its chunks
            keys = [self.position * res.n_experts + e for e in plan.distinct]
            self.keys = torch.tensor(keys, dtype=torch.int32).to(dev, non_blocking=True)
            rows = [plan.rows[e] for e in plan.distinct]
            self.rows = torch.tensor(rows, dtype=torch.int32).to(dev, non_blocking=True)
        tiles = res.grouped.tiles_for(ids_host.numel(), res.n_experts)
        pair_token, order, blocks = plan_blocks(ids_host, plan.u_of_expert, tiles.block_m, n_u=len(plan.distinct))
        blocks = blocks[blocks[:, 0] >= 0]
        index = {e: i for i, e in enumerate(plan.sequence)}
        place = torch.tensor([index[e] for e in plan.distinct], dtype=torch.int64)  # each u's place in the sequence
        return dict(x=x.contiguous(), k=ids_host.shape[1], tiles=tiles, order=order, blocks=blocks,
                    block_place=place[blocks[:, 0].long()], pair_token=pair_token.to(dev, non_blocking=True),
                    y=torch.empty(pair_token.shape[0], x.shape[1], dtype=torch.float32, device=dev),
                    mid=torch.empty(pair_token.shape[0], res.fmt.intermediate, dtype=x.dtype, device=dev))

    def __call__(self, chunk: dict, g0: int, n: int, first_row: int) -> None:
        chosen = chunk["blocks"][(chunk["block_place"] >= g0) & (chunk["block_place"] < g0 + n)]
        if chosen.shape[0]:
            self.res.grouped(chunk["x"], chunk["pair_token"], chosen.to(self.res.device, non_blocking=True),
                             self.keys, self.rows, y=chunk["y"], mid=chunk["mid"], tiles=chunk["tiles"])

    def finish(self, chunk: dict, weights: torch.Tensor) -> torch.Tensor:
        products = torch.empty_like(chunk["y"])
        products[chunk["order"].to(self.res.device, non_blocking=True)] = chunk["y"]  # back to (token, k) order
        return combine_expert_outputs(products.view(chunk["x"].shape[0], chunk["k"], -1), weights, None)
