"""The plan kernel against the reference on the states that interleaved fills leave, plan by plan.

`test_residency_concurrency.py` model-checks the protocol with the reference plans: fill programs that follow the
fill kernel's code run between and inside the main stream's operations, so plans meet fills that landed in part,
chunks claimed and not landed, ready flags not yet published, needs planned while their fill is in flight and
deadlines passed mid-fill. The GPU runs the plan kernel, and `test_kernels.py` compares it with the reference only
on states where fills landed whole between plans. Here the same interleaved model runs on the kernel's table, and
every plan and step start is run twice, on copies of one state: the kernel (Triton's interpreter on the CPU, the
compiled kernel on a GPU) and the reference; every table tensor and every plan output must agree. The run goes on
from the kernel's state (the GPU's truth): every slot the expert kernel reads as a hit or after a wait must hold its
record, and every published slot must at the end.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import full_only
from moeprefetch.residency.plan import next_use_table, plan_layer, step_end, step_start
from moeprefetch.residency.plan_kernel import LayerPlanner
from moeprefetch.residency.state import C, E_ACTIVE, E_FREE, ResidencyConfig, TableState
from test_residency_concurrency import SideStream, await_late, read_experts, torn_published

ENTRY_FIELDS = ("e_state", "e_key", "e_slot", "e_deadline", "e_made", "e_next", "e_done", "e_ready")
SLOT_FIELDS = ("slot_state", "key_of", "last_use", "protect", "prefetched_at")
OUTPUTS = ("assign", "u_key", "u_slot", "u_dst", "u_wait")
# what the runs must have met (counted on the state each plan or step start is given)
CONCURRENT = ("partial", "claimed_unlanded", "next_exhausted", "ready_unpublished", "deadline_passed_mid",
              "released_partial", "late", "gave_up")


class DevicePlanner:
    """A `LayerPlanner` whose kernel runs compiled on a GPU over a device copy of a CPU table: the model's fills
    and reads stay on the CPU, each plan or step start copies the table in and out around one launch."""

    def __init__(self, st: TableState, cfg: ResidencyConfig, top_k: int, max_exact_rows: int, max_shadow_rows: int,
                 use_kernel: bool = True):
        self.host, self.cfg = st, cfg
        self.dev = TableState.allocate(cfg, st.adm_key.shape[0], torch.device("cuda"))
        self.planner = LayerPlanner(self.dev, cfg, top_k, max_exact_rows, max_shadow_rows, use_kernel=True)

    def _run(self, work) -> None:
        self.dev.load(self.host.snapshot())
        work()
        torch.cuda.synchronize()
        self.host.load(self.dev.snapshot())

    def step_start(self, decode: bool, next_use: torch.Tensor | None = None) -> None:
        self._run(lambda: self.planner.step_start(decode, None if next_use is None else next_use.cuda()))

    def __call__(self, position, ids_x, act_x, ids_s, act_s, assign, u_key, u_slot, u_dst, reserve, count_recall,
                 trace=None, u_wait=None) -> None:
        cuda = lambda t: None if t is None else t.cuda()  # noqa: E731
        outs = [assign, u_key, u_slot, u_dst, trace, u_wait]
        dev = [cuda(t) for t in outs]
        self._run(lambda: self.planner(position, cuda(ids_x), cuda(act_x), cuda(ids_s), cuda(act_s), dev[0], dev[1],
                                       dev[2], dev[3], reserve, count_recall, dev[4], u_wait=dev[5]))
        for host, d in zip(outs, dev):
            if host is not None:
                host.copy_(d)


def _describe(where: str, before: dict[str, torch.Tensor], cfg: ResidencyConfig, diffs: list) -> str:
    """The differing tensors and indices, then the state the plan was given: its fill entries and slots."""
    s = before
    lines = [f"kernel != reference at {where}"]
    lines += [f"  {name}{index}: reference {r}, kernel {k}" for name, index, r, k in diffs]
    lines.append("  given: step %d, decode step %d, step base %d, progress %d, cursor %d" % tuple(
        int(s[n][0]) for n in ("step", "decode_step", "step_base", "progress", "cursor")))
    for j in range(cfg.entries):
        if int(s["e_state"][j]) != E_FREE:
            lines.append(f"  entry {j}: " + " ".join(f"{n[2:]}={int(s[n][j])}" for n in ENTRY_FIELDS))
    for slot in range(cfg.n_slots):
        key = int(s["key_of"][slot])
        tail = (f" slot_of[key]={int(s['slot_of'][key])} inflight_of[key]={int(s['inflight_of'][key])}"
                if key >= 0 else "")
        lines.append(f"  slot {slot}: " + " ".join(f"{n}={int(s[n][slot])}" for n in SLOT_FIELDS) + tail)
    lines.append(f"  victims {s['victims'].tolist()}, adm_key {s['adm_key'].tolist()}, "
                 f"adm_slot {s['adm_slot'].tolist()}")
    return "\n".join(lines)


def _differences(reference: dict[str, torch.Tensor], kernel: dict[str, torch.Tensor]) -> list:
    diffs = []
    for name, a in reference.items():
        b = kernel[name]
        if not torch.equal(a, b):
            diffs += [(name, i, a[tuple(i)].item(), b[tuple(i)].item()) for i in (a != b).nonzero().tolist()[:8]]
    return diffs


def run_checked(seed: int, slots: int = 6, spare: int = 0, wait: bool = True, ring: int = 2, policy: str = "lrfu",
                belady: bool = False, steps: int = 12, positions: int = 4, experts: int = 8, k: int = 2,
                side_speed: int = 40, wait_spins: int = 60, noise: float = 0.0, max_inflight: int = 6,
                budget: int = 3, lead: int = 0, nx: int = 1, ns: int = 0, foreign: float = 0.0,
                min_conf: float = 0.0, fill_conf: float = 0.0, conf_noise: bool = False, mtp: bool = False,
                bypass: bool = False, idle: bool = False, planner_cls=LayerPlanner) -> dict:
    """Decode steps as in `test_residency_concurrency.run_decode` (the oracle's routing known `ring - 1` steps
    ahead; `noise`: some predictions wrong or missing; `belady`: victims by the known future), every plan and step
    start checked kernel against reference. Returns what the reads found, the concurrent states met, and the first
    mismatch (None if none)."""
    rng = random.Random(seed)
    cfg = ResidencyConfig(positions=positions, main_positions=positions - int(mtp), n_experts=experts, n_slots=slots,
                          record_bytes=256, chunk_bytes=64, ring=ring, entries=16, max_inflight=max_inflight,
                          budget_per_target=budget, policy=policy, spare_recent=spare, wait_late=wait,
                          prefetch_lead=lead, min_confidence=min_conf, fill_confidence=fill_conf, bypass=bypass,
                          fill_idle_link=idle)
    u_size = max((nx + ns) * k, experts)
    st = TableState.allocate(cfg, u_size, torch.device("cpu"))  # the kernel's table: the truth the run goes on from
    ref = TableState.allocate(cfg, u_size, torch.device("cpu"))  # the reference's copy, reloaded at every check
    st.decode_step.fill_(-1)
    if policy == "static":
        st.pinned[[3, experts + 1]] = 1
    planner = planner_cls(st, cfg, k, nx, ns, use_kernel=True)
    g = torch.Generator().manual_seed(seed)
    host = torch.randint(0, 256, (positions * experts, cfg.record_bytes), dtype=torch.uint8, generator=g)
    pool = torch.zeros(slots, cfg.record_bytes, dtype=torch.uint8)
    side = SideStream(st, cfg, pool, host, rng)
    popular = torch.tensor([4.0, 3.0, 2.0, 1.5, 1.0, 1.0, 0.5, 0.5][:experts])
    horizon = steps + ring + 1
    routing = [[torch.stack([torch.multinomial(popular, k, generator=g) for _ in range(nx)])
                for _ in range(positions)] for _ in range(horizon)]
    st.reuse.copy_(torch.rand(cfg.keys, generator=g) * (torch.rand(cfg.keys, generator=g) < 0.6))
    next_use = None
    if belady:  # as the oracle's victims: the decode step of each key's next need
        trace = torch.zeros(horizon, positions, experts)
        for s, layers in enumerate(routing):
            for p, ids in enumerate(layers):
                trace[s, p, ids.flatten()] = 1
        next_use = torch.empty(horizon, cfg.keys, dtype=torch.int64)
        next_use_table(trace, next_use)
    found = dict.fromkeys(("plans", "starts", "mismatches", "hit_reads", "waited_reads", "stale_reads") + CONCURRENT, 0)
    found["first_mismatch"] = None
    traces = [torch.zeros(horizon, positions, experts, dtype=torch.uint8) for _ in range(2)]

    def busy() -> None:
        side.run(rng.randrange(side_speed))

    def observe(s: dict[str, torch.Tensor], now: int, at_start: bool) -> None:
        active, done, ready = s["e_state"] == E_ACTIVE, s["e_done"], s["e_ready"]
        unfinished = active & (done < cfg.chunks)
        found["partial"] += int((unfinished & (done > 0)).sum())
        found["claimed_unlanded"] += int((unfinished & (s["e_next"] > done)).sum())
        found["next_exhausted"] += int((unfinished & (s["e_next"] >= cfg.chunks)).sum())
        found["ready_unpublished"] += int((active & (ready == 1)).sum())
        passed = int((active & (s["e_deadline"] <= now) & (ready == 0) & (done > 0)).sum())
        found["released_partial" if at_start else "deadline_passed_mid"] += passed

    def check(where: str, now: int, kernel_call, reference_call, outs=None, at_start: bool = False) -> None:
        before = st.snapshot()
        observe(before, now, at_start)
        ref.load(before)
        reference_call()
        kernel_call()
        diffs = _differences(ref.tensors(), st.tensors())
        if outs is not None:
            diffs += _differences(*outs)
        if diffs:
            found["mismatches"] += 1
            if found["first_mismatch"] is None:
                found["first_mismatch"] = _describe(where, before, cfg, diffs)

    def outputs(rows: int) -> dict[str, torch.Tensor]:
        out = {name: torch.full((u_size,), -7, dtype=torch.int32) for name in OUTPUTS}
        out["assign"] = torch.full((rows, k), -7, dtype=torch.int32)
        if not wait:
            del out["u_wait"]
        return out

    for step in range(steps):
        assert side.idle  # joined at the last step's end
        check(f"the start of step {step}", 2 * (int(st.step[0]) + 1) * positions - 1,
              lambda: planner.step_start(True, next_use), lambda: step_start(ref, cfg, True, next_use), at_start=True)
        found["starts"] += 1
        dstep = int(st.decode_step[0])
        for ahead in range(cfg.ring):  # the oracle writes this step's and the next steps' routing
            row = st.pred[(dstep + ahead) % cfg.ring]
            row.zero_()
            for p in range(cfg.main_positions):
                for e in routing[step + ahead][p].flatten().tolist():
                    row[p, e] = rng.uniform(0.05, 1.0) if conf_noise else 1.0
                if noise and rng.random() < noise:  # a wrong prediction
                    row[p, rng.randrange(experts)] = rng.uniform(0.05 if conf_noise else 0.3, 1.0)
                if noise and rng.random() < noise:  # a missed one
                    row[p, int(routing[step + ahead][p][0, 0])] = 0.0
        for p in range(-1, positions):  # -1: the step start's own plan
            rows = 0 if p < 0 else nx
            ids_x = routing[step][max(p, 0)][:rows]
            act_x = torch.tensor([nx == 1 or rng.random() < 0.85 for _ in range(rows)], dtype=torch.bool)
            ids_s = act_s = None
            if p >= 0 and ns:  # shadow rows (a draft): published experts only
                ids_s = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(ns)])
                act_s = torch.ones(ns, dtype=torch.bool)
            if p >= 0 and foreign:  # expert parallelism: another rank's experts are -1
                ids_x = torch.where(torch.rand(ids_x.shape, generator=g) < foreign, -1, ids_x)
                if ids_s is not None:
                    ids_s = torch.where(torch.rand(ids_s.shape, generator=g) < foreign, -1, ids_s)
            n_rows = rows + (ns if ids_s is not None else 0)
            out_k, out_r = outputs(n_rows), outputs(n_rows)
            recall = 0 <= p < cfg.main_positions
            if p >= 0:
                busy()

            def plan_args(out, trace):
                return (p, ids_x, act_x, ids_s, act_s, out["assign"], out["u_key"], out["u_slot"], out["u_dst"],
                        True, recall, trace if p >= 0 else None)

            late = int(st.counters[:, C["late"]].sum())
            now = 2 * int(st.step[0]) * positions - 1 if p < 0 else 2 * (int(st.step[0]) * positions + p)
            check(f"the plan of step {step}, position {p}", now,
                  lambda: planner(*plan_args(out_k, traces[1]), u_wait=out_k.get("u_wait")),
                  lambda: plan_layer(ref, cfg, *plan_args(out_r, traces[0]), u_wait=out_r.get("u_wait")),
                  (out_r, out_k))
            found["plans"] += 1
            found["late"] += int(st.counters[:, C["late"]].sum()) - late
            side.launch(p)
            if p < 0:
                continue
            u_key, u_slot, u_dst = out_k["u_key"], out_k["u_slot"], out_k["u_dst"]
            u_wait = out_k.get("u_wait", torch.full((u_size,), -1, dtype=torch.int32))
            busy()
            await_late(st, side, p, u_wait, u_slot, u_size, wait_spins, found)
            read_experts(cfg, pool, host, u_key, u_slot, u_dst, u_wait, u_size, busy, found)
            if idle:
                st.demand.zero_()  # the layer's host reads are over
        busy()
        step_end(st, cfg)
        side.drain()
    found["torn_at_end"] = torn_published(st, pool, host)
    found["fills"] = int(st.counters[:, C["prefetch_issued"]].sum())
    if not torch.equal(traces[0], traces[1]):
        found["mismatches"] += 1
        found["first_mismatch"] = found["first_mismatch"] or "the routing traces differ"
    return found


def _check(found: dict, needs: tuple[str, ...]) -> None:
    assert found["mismatches"] == 0, found["first_mismatch"]
    assert found["stale_reads"] == 0 and found["torn_at_end"] == 0, found
    assert found["fills"] > 0 and found["hit_reads"] > 0, found
    missing = [name for name in needs if found[name] == 0]
    assert not missing, f"the run met no {missing}: {found}"


interpreter_only = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="runs the kernel on CPU tensors (interpreter); see the GPU case below")

# (seed, configuration, the concurrent states the run must meet); ~8 s a case in the interpreter (16 steps: ~11 s)
CASES = [
    (0, dict(slots=6, spare=0, wait=True, ring=2, policy="lrfu", side_speed=20),
     ("partial", "claimed_unlanded", "late", "waited_reads")),
    full_only(1, dict(slots=5, spare=1, wait=False, ring=3, policy="lru", belady=True, lead=1),
              ("partial", "deadline_passed_mid", "released_partial", "late")),
    full_only(2, dict(slots=7, spare=0, wait=True, ring=3, policy="lru", belady=True, wait_spins=3, side_speed=8),
              ("claimed_unlanded", "ready_unpublished", "late", "gave_up")),
    full_only(3, dict(slots=9, spare=1, wait=True, ring=2, policy="static", nx=2, ns=1, foreign=0.2, min_conf=0.2,
                      fill_conf=0.55, conf_noise=True, noise=0.3, mtp=True, bypass=True, idle=True),
              ("claimed_unlanded", "next_exhausted", "late")),
    full_only(4, dict(slots=8, spare=0, wait=False, ring=2, policy="lfu", noise=0.3, side_speed=120, steps=16),
              ("partial", "late")),
    full_only(5, dict(slots=6, spare=1, wait=True, ring=3, policy="lrfu", nx=2, ns=1, lead=2, steps=16),
              ("partial", "late")),
]


@interpreter_only
@pytest.mark.parametrize("seed,config,needs", CASES)
def test_plan_kernel_matches_the_reference_under_interleaved_fills(seed, config, needs):
    """Every plan and step start of an interleaved run: the kernel's tables and outputs equal the reference's on
    the same state, and every slot read holds its record."""
    _check(run_checked(seed, **config), needs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seed,config,needs", CASES)
def test_compiled_plan_kernel_matches_the_reference_under_interleaved_fills(seed, config, needs):
    """The same with the compiled kernel on the GPU (one launch per plan over a device copy of the table): what the
    interpreter cannot show, such as a race between the kernel's own threads, shows here as a mismatch."""
    _check(run_checked(seed, planner_cls=DevicePlanner, **config), needs)


@interpreter_only
def test_plan_kernel_cuts_confidences_as_the_reference_at_the_threshold():
    """A confidence equal to the cut (0.7 as stored in fp32, 0.699999988) is fetched by the kernel and the reference
    alike: the cuts are held as fp32 values (`ResidencyConfig`)."""
    cfg = ResidencyConfig(positions=2, main_positions=2, n_experts=4, n_slots=4, record_bytes=256, chunk_bytes=64,
                          entries=16, min_confidence=0.7, wait_late=False)
    issued = []
    for use_kernel in (False, True):
        st = TableState.allocate(cfg, 4, torch.device("cpu"))
        planner = LayerPlanner(st, cfg, 2, 1, 0, use_kernel=use_kernel)
        planner.step_start(True)
        st.pred[0, 1, 2] = 0.7  # stored as fp32: 0.699999988
        out = [torch.full((4,), -7, dtype=torch.int32) for _ in range(3)]
        planner(-1, torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, dtype=torch.bool), None, None,
                torch.zeros(0, 2, dtype=torch.int32), *out, True, False)
        issued.append(int(st.counters[:, C["prefetch_issued"]].sum()))
    assert issued == [1, 1], f"reference issued {issued[0]} fills, kernel {issued[1]}"
