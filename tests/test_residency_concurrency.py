"""The residency table's protocol under the GPU's concurrency, model-checked on the CPU with real bytes.

On the GPU, fills run on a side stream beside the plans, waits and expert kernels of the main stream: a fill
program may claim a chunk before a plan and land it after the next one, and 16 programs share the fills. The
engine's other tests run the reference plans with every fill landed whole between two plans, which cannot show a
protocol that publishes a slot before its bytes are there or lets two writers meet in one slot. Here the side
stream is a set of program state machines that follow the fill kernel's code (`residency/fill.py`: progress and
deadline checks, chunk claims, the last chunk's ready flag), stepped in a random order between and inside the main
stream's operations (`residency/plan.py`'s plans, the await, the expert kernel's reads and admissions); every slot
the expert kernel reads as a hit or after a wait must hold its expert's record, and every published slot must at
the end. The H200's slot probe found published slots without their records (BENCHMARKS "4-bit and FP8 experts");
this checks the protocol itself, not the GPU's memory model, nor a program's warps (one thread stands for a
program here: a race between warps that decided on different reads of the clock tore chunks on the GPU, BENCHMARKS
"The fill kernel's torn chunks").
"""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch

from moeprefetch.residency.fill import launch_clock
from moeprefetch.residency.plan import plan_layer, step_end, step_start
from moeprefetch.residency.state import C, E_ACTIVE, RESIDENT, ResidencyConfig, TableState

PROGRAMS = 16  # the fill kernel's grid


def fill_program(st: TableState, cfg: ResidencyConfig, pool: torch.Tensor, host: torch.Tensor, order: list[int],
                 launch: int):
    """One fill program, as `_fill_kernel` runs it, yielding wherever another stream may act."""
    n, chunk_bytes = cfg.chunks, cfg.chunk_bytes
    for j in order:
        if j < 0:
            return
        deadline = int(st.e_deadline[j])
        src, dst = int(st.e_key[j]), int(st.e_slot[j])
        yield
        progress = int(st.progress[0])
        if progress > launch:
            return
        chunk = n
        if deadline > progress:
            chunk = int(st.e_next[j])
            st.e_next[j] += 1
        while chunk < n:
            lo, hi = chunk * chunk_bytes, min((chunk + 1) * chunk_bytes, cfg.record_bytes)
            half = (lo + hi) // 2
            yield
            pool[dst, lo:half] = host[src, lo:half]  # a chunk's stores land in no particular order
            yield
            pool[dst, half:hi] = host[src, half:hi]
            yield
            landed = int(st.e_done[j])
            st.e_done[j] += 1
            if landed == n - 1:
                st.e_ready[j] = 1
            yield
            progress = int(st.progress[0])
            if progress > launch:
                return
            if deadline <= progress:
                break
            chunk = int(st.e_next[j])
            st.e_next[j] += 1


class SideStream:
    """Fill launches in stream order; each launch's programs interleave at random."""

    def __init__(self, st: TableState, cfg: ResidencyConfig, pool: torch.Tensor, host: torch.Tensor,
                 rng: random.Random):
        self.st, self.cfg, self.pool, self.host, self.rng = st, cfg, pool, host, rng
        self.queue: deque = deque()
        self.programs: list = []

    def launch(self, position: int) -> None:
        self.queue.append((self.st.order[position + 1].tolist(), launch_clock(self.st, self.cfg, position)))

    @property
    def idle(self) -> bool:
        return not self.programs and not self.queue

    def tick(self) -> None:
        if not self.programs:
            if not self.queue:
                return
            order, clock = self.queue.popleft()
            self.programs = [fill_program(self.st, self.cfg, self.pool, self.host, order, clock)
                             for _ in range(PROGRAMS)]
        program = self.rng.choice(self.programs)
        try:
            next(program)
        except StopIteration:
            self.programs.remove(program)

    def run(self, ticks: int) -> None:
        for _ in range(ticks):
            self.tick()

    def drain(self) -> None:
        while not self.idle:
            self.tick()


def await_late(st: TableState, side: "SideStream", position: int, u_wait: torch.Tensor, u_slot: torch.Tensor,
               count: int, wait_spins: int, found: dict[str, int]) -> None:
    """The await launch: bounded polls of each late expert's ready flag while the side stream runs; one that has not
    landed by then is read from host (counted as zero-copy, as `_await_kernel` does)."""
    for u in range(count):
        j = int(u_wait[u])
        if j < 0:
            continue
        spins = 0
        while not int(st.e_ready[j]) and spins < wait_spins:
            side.tick()
            spins += 1
        if not int(st.e_ready[j]):
            u_slot[u] = -1
            st.counters[position, C["zero_copy"]] += 1
            found["gave_up"] += 1


def read_experts(cfg: ResidencyConfig, pool: torch.Tensor, host: torch.Tensor, u_key: torch.Tensor,
                 u_slot: torch.Tensor, u_dst: torch.Tensor, u_wait: torch.Tensor, count: int, busy,
                 found: dict[str, int]) -> None:
    """The expert kernel: every slot it reads must hold its record (a stale read otherwise); an admission streams into
    its victim slot in two halves, with the side stream running between them."""
    for u in range(count):
        busy()
        key, slot, dst = int(u_key[u]), int(u_slot[u]), int(u_dst[u])
        if key < 0:
            continue
        if slot >= 0:
            found["waited_reads" if int(u_wait[u]) >= 0 else "hit_reads"] += 1
            found["stale_reads"] += int(not torch.equal(pool[slot], host[key]))
        if dst >= 0:
            half = cfg.record_bytes // 2
            pool[dst, :half] = host[key, :half]
            busy()
            pool[dst, half:] = host[key, half:]


def torn_published(st: TableState, pool: torch.Tensor, host: torch.Tensor) -> int:
    """Published slots whose bytes are not their expert's record (streams idle)."""
    published = (st.slot_state == RESIDENT) & (st.key_of >= 0)
    return sum(int(not torch.equal(pool[s], host[int(st.key_of[s])])) for s in range(pool.shape[0]) if published[s])


def run_decode(seed: int, slots: int, spare: int, steps: int = 24, positions: int = 4, experts: int = 8,
               k: int = 2, side_speed: int = 40, wait_spins: int = 60) -> dict[str, int]:
    """Decode steps with the one-token oracle's predictions (every step's routing known one step ahead); returns
    what the reads found. `side_speed`: the most side-stream steps between two main-stream operations."""
    rng = random.Random(seed)
    cfg = ResidencyConfig(positions=positions, main_positions=positions, n_experts=experts, n_slots=slots,
                          record_bytes=256, chunk_bytes=64, ring=2, entries=16, max_inflight=6, budget_per_target=3,
                          policy="lrfu", spare_recent=spare, wait_late=True)
    u_size = k
    st = TableState.allocate(cfg, max(u_size, experts), torch.device("cpu"))
    st.decode_step.fill_(-1)
    g = torch.Generator().manual_seed(seed)
    host = torch.randint(0, 256, (positions * experts, cfg.record_bytes), dtype=torch.uint8, generator=g)
    pool = torch.zeros(slots, cfg.record_bytes, dtype=torch.uint8)
    side = SideStream(st, cfg, pool, host, rng)
    popular = torch.tensor([4.0, 3.0, 2.0, 1.5, 1.0, 1.0, 0.5, 0.5][:experts])
    routing = [[torch.multinomial(popular, k, generator=g) for _ in range(positions)] for _ in range(steps + 2)]
    found = {"hit_reads": 0, "stale_reads": 0, "waited_reads": 0, "gave_up": 0}

    def busy() -> None:
        side.run(rng.randrange(side_speed))

    for step in range(steps):
        assert side.idle  # joined at the last step's end
        step_start(st, cfg, decode=True)
        dstep = int(st.decode_step[0])
        for ahead in range(cfg.ring):  # the oracle writes this step's and the next step's routing
            row = st.pred[(dstep + ahead) % cfg.ring]
            row.zero_()
            for p in range(positions):
                row[p, routing[step + ahead][p]] = 1.0
        buffers = [torch.full((max(u_size, experts),), -1, dtype=torch.int32) for _ in range(4)]
        u_key, u_slot, u_dst, u_wait = buffers
        no_rows = torch.zeros(0, k, dtype=torch.int64)
        plan_layer(st, cfg, -1, no_rows, torch.zeros(0, dtype=torch.bool), None, None,
                   torch.zeros(0, k, dtype=torch.int32), u_key, u_slot, u_dst, True, False, u_wait=u_wait)
        side.launch(-1)
        for p in range(positions):
            busy()
            ids = routing[step][p][None, :]
            plan_layer(st, cfg, p, ids, torch.ones(1, dtype=torch.bool), None, None,
                       torch.zeros(1, k, dtype=torch.int32), u_key, u_slot, u_dst, True, True, u_wait=u_wait)
            side.launch(p)
            busy()
            await_late(st, side, p, u_wait, u_slot, k, wait_spins, found)
            read_experts(cfg, pool, host, u_key, u_slot, u_dst, u_wait, k, busy, found)
        busy()
        step_end(st, cfg)
        side.drain()
    found["torn_at_end"] = torn_published(st, pool, host)
    found["fills"] = int(st.counters[:, C["prefetch_issued"]].sum())
    found["active_at_end"] = int((st.e_state == E_ACTIVE).sum())
    return found


@pytest.mark.parametrize("seed,slots,spare", [(0, 5, 0), (1, 6, 0), (2, 7, 0), (3, 6, 1), (4, 9, 0)])
def test_every_read_slot_holds_its_record_under_interleaved_fills(seed, slots, spare):
    found = run_decode(seed, slots, spare)
    assert found["fills"] > 0 and found["hit_reads"] > 0
    assert found["stale_reads"] == 0 and found["torn_at_end"] == 0, found
