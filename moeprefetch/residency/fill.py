"""Prefetch fills: host records copied into reserved VRAM slots by a small persistent grid on a side stream.

After each plan, the main stream records an event and the side stream launches one fill kernel over that plan's
deadline-ordered list of unfinished fills (`order[launch]`). Its programs claim 64 KiB chunks with an atomic counter
per fill, so all of them work on the most urgent fill first and a fill completes as fast as the link allows. The
program that lands a fill's last chunk sets its `ready` flag (release); the main stream's next plan publishes the
slot. The kernel never writes the table itself: one writer, no races on the table.

A launch stops claiming when the main stream has moved past the plan that launched it (the next launch has a fresher
list) and skips fills whose need has already been planned (the layer read that expert from host; copying it now
would only cross the link twice). A small grid keeps most multiprocessors free for the compute it hides behind.

With `fill_idle_link`, a fill whose need lies beyond the next MoE layer claims no chunk while the current layer
reads missed experts from host memory (`demand`, set by the layer's plan, cleared after its experts): the two would
share one link, so a prefetch for later would slow the read that the step is waiting for. Such fills take only
the link time that would otherwise idle (attention, routers, experts read from VRAM).
"""

from __future__ import annotations

import torch

from .state import COUNTERS, C, E_ACTIVE, ResidencyConfig, TableState
from ..kernels import HAS_TRITON, Launch

if HAS_TRITON:
    import triton
    import triton.language as tl

FILL_PROGRAMS = 16  # link-saturating yet small (h200.md 5: 16 programs copy at 51 GB/s beside compute)
FILL_WARPS = 8  # per program
FILL_BLOCK = 2048  # int32 elements per load (8 KiB)
# Polls of the ready flags before a late expert is read from host instead. Only a safety net: a late expert's fill
# is first in line, so it lands within one expert's link time, and rereading it from host crosses the link twice.
# H200, V2-Lite shape at 12 GiB, oracle: 2048 polls gave up on ~18 experts a token (22.3 ms/token); 65536 on ~1
# (17.9 ms/token) (scripts/tune_fills.py).
AWAIT_SPINS = 1 << 16
# In Triton's CPU interpreter (tests) nothing runs beside the await launch, so a flag that is not set never will be:
# a few polls decide the same outcome without interpreting 65,536 of them.
INTERPRETER_AWAIT_SPINS = 4
# Polls of the demand flag before a yielding fill goes ahead anyway (a safety net: the flag is cleared after every
# layer's experts, within a few expert reads' time)
YIELD_SPINS = 1 << 20


def launch_clock(st: TableState, cfg: ResidencyConfig, position: int) -> int:
    """The plan clock a fill launch belongs to (position -1 = the step start)."""
    step = int(st.step[0])
    return 2 * step * cfg.positions - 1 if position < 0 else 2 * (step * cfg.positions + position)


def fill_reference(st: TableState, cfg: ResidencyConfig, pool: torch.Tensor, host: torch.Tensor,
                   position: int) -> None:
    """The definition (and the CPU path): every listed fill whose need is still ahead is copied whole, in order."""
    progress = int(st.progress[0])
    for j in st.order[position + 1].tolist():
        if j < 0:
            break
        if int(st.e_state[j]) != E_ACTIVE or int(st.e_deadline[j]) <= progress or int(st.e_ready[j]):
            continue
        pool[int(st.e_slot[j])].copy_(host[int(st.e_key[j])].to(pool.device))
        st.e_next[j] = st.e_done[j] = cfg.chunks
        st.e_ready[j] = 1


def await_reference(st: TableState, position: int, u_wait: torch.Tensor, u_slot: torch.Tensor) -> None:
    """With `wait_late`: a late expert whose fill has landed keeps its fill's slot; otherwise it is read from host
    (u_slot -1) and counted as zero-copy. On the CPU every listed fill has landed by now."""
    ready = st.e_ready.tolist()
    for u, j in enumerate(u_wait.tolist()):
        if j >= 0 and not ready[j]:
            u_slot[u] = -1
            st.counters[position, C["zero_copy"]] += 1


if HAS_TRITON:

    @triton.jit(do_not_specialize=("position",))  # one variant for every layer
    def _await_kernel(u_wait_ptr, u_slot_ptr, e_ready_ptr, counters_ptr, position, A: tl.constexpr,
                      A_PAD: tl.constexpr, NC: tl.constexpr, ZERO_COPY: tl.constexpr, SPINS: tl.constexpr):
        """Poll the ready flags of this layer's late experts' fills (acquire), a bounded number of times: a fill that
        has not landed by then is read from host by the expert kernel, as without waiting (nothing can hang)."""
        ua = tl.arange(0, A_PAD)
        j = tl.load(u_wait_ptr + ua, mask=ua < A, other=-1)
        waiting = j >= 0
        ready = tl.zeros([A_PAD], dtype=tl.int32)
        pending = tl.sum(waiting.to(tl.int32), axis=0)
        spins = 0
        while (pending > 0) & (spins < SPINS):
            poll = waiting & (ready == 0)
            ready = tl.where(poll, tl.atomic_add(e_ready_ptr + j, 0, mask=poll, sem="acquire"), ready)
            pending = tl.sum((waiting & (ready == 0)).to(tl.int32), axis=0)
            spins += 1
        failed = waiting & (ready == 0)
        tl.store(u_slot_ptr + ua, -1, mask=failed)
        tl.atomic_add(counters_ptr + position * NC + ZERO_COPY, tl.sum(failed.to(tl.int64), axis=0))

    @triton.jit
    def _read_shared(ptr):
        """One value of a word the main stream changes, the same for every warp of the program: a scalar atomic is
        made by one thread and handed to the others through shared memory. A plain volatile load is made by each warp
        on its own, and warps that read different clocks took different branches: some gave up a fill while the
        others claimed its next chunk, copied their part of it alone and counted it as landed, so a published slot
        kept its previous expert's words in the rest (`scripts/table_stress.py`, BENCHMARKS "The fill kernel's torn
        chunks")."""
        return tl.atomic_add(ptr, 0, sem="relaxed")

    @triton.jit
    def _yield_link(demand_ptr, progress_ptr, launch, deadline, SPINS: tl.constexpr):
        """Wait while this layer reads experts from host, unless the fill is needed by the next MoE layer (its clock
        is at most two after the launch's) or the main stream has moved on (the next launch takes over). Why the
        next layer's fills go ahead: the window between a layer's reads and the next layer's plan is short, so a
        yielding next-layer fill mostly lands late and is waited for. Measured with them yielding too (H200, deep
        model at 30 % cached, BENCHMARKS "Fills and protection on sampled text", twentieth session):
        `next_layer_gate` 27.45 ms/token against 26.91 sharing the link, `oracle_next` 22.76 against 22.45."""
        if deadline > launch + 2:
            spins = 0
            busy = _read_shared(demand_ptr)
            while (busy != 0) & (spins < SPINS):
                busy = _read_shared(demand_ptr)
                busy = tl.where(_read_shared(progress_ptr) > launch, 0, busy)
                spins += 1

    @triton.jit
    def _claim(e_next_ptr, progress_ptr, demand_ptr, j, launch, deadline, N_CHUNKS: tl.constexpr, IDLE: tl.constexpr,
               SPINS: tl.constexpr):
        """(the next chunk of fill j for this program, or N_CHUNKS for none; 0 once the main stream has moved past
        this launch, else 1). A fill whose layer has been planned gets no more chunks: that layer read the expert from
        host, and copying it now would only cross the link twice."""
        progress = _read_shared(progress_ptr)
        if IDLE:
            if (progress <= launch) & (deadline > progress):
                _yield_link(demand_ptr, progress_ptr, launch, deadline, SPINS)
                progress = _read_shared(progress_ptr)  # the wait may have outlasted this launch
        chunk = N_CHUNKS
        running = 1
        if progress > launch:
            running = 0
        elif deadline > progress:
            chunk = tl.atomic_add(e_next_ptr + j, 1)
        return chunk, running

    @triton.jit(do_not_specialize=("position",))  # one variant for every layer
    def _fill_kernel(order_ptr, e_key_ptr, e_slot_ptr, e_deadline_ptr, e_next_ptr, e_done_ptr, e_ready_ptr,
                     progress_ptr, step_ptr, pool_ptr, delta_ptr, demand_ptr, position, P: tl.constexpr,
                     M: tl.constexpr, REC: tl.constexpr, CHUNK: tl.constexpr, N_CHUNKS: tl.constexpr,
                     BLOCK: tl.constexpr, IDLE: tl.constexpr, SPINS: tl.constexpr):
        step = tl.load(step_ptr)
        launch = tl.where(position < 0, 2 * step * P - 1, 2 * (step * P + position))  # the plan it follows
        delta = tl.load(delta_ptr)  # host arena - pool, in int32 elements
        lanes = tl.arange(0, BLOCK)
        i = 0
        running = 1
        while (i < M) & (running == 1):
            j = tl.load(order_ptr + i)
            if j < 0:
                running = 0
            else:
                deadline = _read_shared(e_deadline_ptr + j)  # a late need's plan may raise it meanwhile
                src = delta + tl.load(e_key_ptr + j).to(tl.int64) * REC
                dst = tl.load(e_slot_ptr + j).to(tl.int64) * REC
                chunk, running = _claim(e_next_ptr, progress_ptr, demand_ptr, j, launch, deadline, N_CHUNKS, IDLE,
                                        SPINS)
                while chunk < N_CHUNKS:
                    for start in range(0, CHUNK, BLOCK):
                        offs = chunk * CHUNK + start + lanes
                        mask = offs < REC
                        words = tl.load(pool_ptr + src + offs, mask=mask, other=0)
                        tl.store(pool_ptr + dst + offs, words, mask=mask)
                    tl.debug_barrier()  # every warp's stores of the chunk before the one thread's count (release)
                    landed = tl.atomic_add(e_done_ptr + j, 1, sem="acq_rel")
                    if landed == N_CHUNKS - 1:
                        tl.atomic_xchg(e_ready_ptr + j, 1, sem="release")
                    chunk, running = _claim(e_next_ptr, progress_ptr, demand_ptr, j, launch, deadline, N_CHUNKS,
                                            IDLE, SPINS)
            i += 1


class Filler:
    """Fill launches over one pool and host arena: the Triton kernel on the GPU, the reference elsewhere."""

    def __init__(self, st: TableState, cfg: ResidencyConfig, pool: torch.Tensor, host: torch.Tensor | None,
                 use_kernel: bool, programs: int = FILL_PROGRAMS, num_warps: int = FILL_WARPS):
        self.st, self.cfg, self.pool, self.host = st, cfg, pool, host
        self.num_warps = num_warps
        self.use_kernel = use_kernel and host is not None and cfg.record_bytes % 4 == 0
        self.programs = programs
        if self.use_kernel:
            assert cfg.chunk_bytes % (4 * FILL_BLOCK) == 0
            self._words = pool.view(torch.int32)
            delta = host.data_ptr() - pool.data_ptr()  # type: ignore[union-attr]
            self._delta = torch.tensor([delta // 4], dtype=torch.int64, device=pool.device)

    def __call__(self, position: int) -> None:
        """Run the fill launch that follows the plan at `position` (-1: the step start)."""
        if self.host is None:
            return
        if not self.use_kernel:
            fill_reference(self.st, self.cfg, self.pool, self.host, position)
            return
        self.launch(position)()

    def await_fills(self, position: int, u_wait: torch.Tensor, u_slot: torch.Tensor) -> None:
        """On the main stream, between a layer's plan (and fill launch) and its expert kernel (`wait_late`)."""
        if self.host is not None:
            await_fills(self.st, position, u_wait, u_slot, self.use_kernel)

    def launch(self, position: int) -> Launch:
        st, cfg = self.st, self.cfg
        return Launch(
            _fill_kernel, (self.programs,), num_warps=self.num_warps, num_stages=1, order_ptr=st.order[position + 1],
            e_key_ptr=st.e_key, e_slot_ptr=st.e_slot, e_deadline_ptr=st.e_deadline, e_next_ptr=st.e_next,
            e_done_ptr=st.e_done, e_ready_ptr=st.e_ready, progress_ptr=st.progress, step_ptr=st.step,
            pool_ptr=self._words, delta_ptr=self._delta, demand_ptr=st.demand, position=position, P=cfg.positions,
            M=cfg.entries, REC=cfg.record_bytes // 4, CHUNK=cfg.chunk_bytes // 4, N_CHUNKS=cfg.chunks,
            BLOCK=FILL_BLOCK, IDLE=bool(cfg.fill_idle_link),
            SPINS=YIELD_SPINS if self.pool.is_cuda else INTERPRETER_AWAIT_SPINS)


def await_fills(st: TableState, position: int, u_wait: torch.Tensor, u_slot: torch.Tensor, use_kernel: bool) -> None:
    """The await step of `wait_late` (see `_await_kernel`): the kernel on the GPU, the reference elsewhere."""
    if not use_kernel:
        await_reference(st, position, u_wait, u_slot)
        return
    await_launch(st, position, u_wait, u_slot)()


def await_launch(st: TableState, position: int, u_wait: torch.Tensor, u_slot: torch.Tensor) -> Launch:
    a = u_wait.shape[0]
    return Launch(_await_kernel, (1,), num_warps=4, num_stages=1, u_wait_ptr=u_wait, u_slot_ptr=u_slot,
                  e_ready_ptr=st.e_ready, counters_ptr=st.counters, position=position, A=a,
                  A_PAD=1 << max(a - 1, 0).bit_length(), NC=len(COUNTERS), ZERO_COPY=C["zero_copy"],
                  SPINS=AWAIT_SPINS if u_wait.is_cuda else INTERPRETER_AWAIT_SPINS)
