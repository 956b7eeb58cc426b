"""Replay a routing trace through the residency's own plans on the CPU: hits, misses and bytes per token.

`replay()` builds a residency table of the given size on the CPU and runs, for every token of a trace, the very step
start, layer plans and step end that a decode step runs on the GPU (`residency/plan.py`, the definition the plan
kernel is tested against), with predictions taken from the trace itself:

| predictor | what it knows at step t | victims |
|---|---|---|
| `none` | nothing | the policy's |
| `previous` | token t-1's experts, as the guess for token t (the `previous` predictor) | the policy's |
| `oracle_next` | tokens t and t+1 | the policy's |
| `ahead:K` | tokens t .. t+K | the policy's |
| `oracle` | tokens t and t+1, and Belady's order (the whole future) | Belady's |

Predictions protect the experts they name from eviction; with `fills`, they are also prefetched (fills land at once
here: the replay counts bytes, not time). Without fills, `oracle_next` and `ahead:K` give the residency's k-tokens-
ahead lines, which `floors()` checks against plain references (`analysis.py`), beside Belady's floor.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch

from .accounting import LayerCounters
from .analysis import ahead_misses, belady_bypass_misses, belady_misses
from .errors import RequestError
from .options import check_halflife
from .residency import plan as table
from .residency.state import E_ACTIVE, POLICIES, ResidencyConfig, TableState, effective_spare_recent
from .traces import DecodeTrace

V2LITE_EXPERT_BYTES = 3 * 2048 * 1408 * 2  # one DeepSeek-V2-Lite routed expert in bf16 (17.3 MB)
REPLAY_PREDICTORS = ("none", "previous", "oracle_next", "oracle", "ahead:K")


@dataclass(frozen=True)
class ReplaySetup:
    slots: int
    policy: str = "lrfu"
    predictor: str = "none"
    fills: bool = False  # predictions are also prefetched (else they only protect)
    halflife: float = ResidencyConfig.frequency_halflife
    spare_recent: int = ResidencyConfig.spare_recent
    prefetch_budget: float = 1.5  # fills per (step, layer), a multiple of top-k
    expert_bytes: int = V2LITE_EXPERT_BYTES

    def check(self, trace: DecodeTrace) -> None:
        keys = len(trace.layers) * trace.n_experts
        # a token needs its top-k experts of a layer at once, as the engine's cache does (it refuses fewer slots)
        if not isinstance(self.slots, int) or not trace.top_k <= self.slots <= keys:
            raise RequestError(f"slots must be an integer from the trace's top-k ({trace.top_k}: a token's experts "
                               f"of one layer at once) to its {keys} experts, got {self.slots!r}")
        if self.policy not in POLICIES:
            raise RequestError(f"unknown cache policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.policy == "static":
            raise RequestError("policy static pins a hot set, and a replay has none (it would replay LRU): choose "
                               "lrfu, lru or lfu")
        check_halflife("the LRFU half-life (--lrfu-halflife)", self.halflife)
        self.ahead  # noqa: B018 (validates the predictor's name)

    @property
    def ahead(self) -> int:
        """Tokens after the current one that the predictor knows (0: none)."""
        name = self.predictor
        if name == "none":
            return 0
        if name in ("previous", "oracle_next", "oracle"):
            return 1
        if name.startswith("ahead:"):
            try:
                steps = int(name.split(":", 1)[1])
            except ValueError:
                steps = 0
            if 1 <= steps <= 8:
                return steps
            raise RequestError(f"predictor {name!r}: ahead:K needs K from 1 to 8 tokens")
        raise RequestError(f"unknown replay predictor {name!r}; choose from {', '.join(REPLAY_PREDICTORS)}")


@dataclass
class ReplayResult:
    setup: ReplaySetup
    tokens: int
    uses: int
    hits: int  # cache hits, prefetched ones included
    misses: int
    prefetch_issued: int
    prefetch_useful: int
    prefetch_wasted: int
    zero_copy_bytes: int
    fill_bytes: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.uses if self.uses else 0.0

    @property
    def bytes_per_token(self) -> float:
        return (self.zero_copy_bytes + self.fill_bytes) / max(self.tokens, 1)

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(hit_rate=self.hit_rate, misses_per_token=self.misses / max(self.tokens, 1),
                   bytes_per_token=self.bytes_per_token)
        return out


def replay(trace: DecodeTrace, setup: ReplaySetup) -> ReplayResult:
    """Every token of `trace` through one residency table of `setup.slots` slots, cold at the start."""
    setup.check(trace)
    positions, experts, k = len(trace.layers), trace.n_experts, trace.top_k
    ahead = setup.ahead
    budget = math.ceil(setup.prefetch_budget * k) if setup.fills else 0
    # predictions read from the trace are exact; only `previous` guesses
    spare = effective_spare_recent(setup.spare_recent, setup.predictor != "previous", setup.policy)
    cfg = ResidencyConfig(positions=positions, main_positions=positions, n_experts=experts, n_slots=setup.slots,
                          record_bytes=setup.expert_bytes, ring=ahead + 1, entries=64, max_inflight=32,
                          budget_per_target=budget, spare_recent=spare, policy=setup.policy,
                          frequency_halflife=float(setup.halflife))
    st = TableState.allocate(cfg, max(k, experts), torch.device("cpu"))
    st.decode_step.fill_(-1)
    needed = trace.needed()  # [T, P, E]
    next_use = None
    if setup.predictor == "oracle":
        next_use = torch.empty(trace.tokens, positions * experts, dtype=torch.int64)
        table.next_use_table(needed, next_use)
    buffers = _Buffers(k, max(k, experts))
    active = ahead > 0
    for t in range(trace.tokens):
        table.step_start(st, cfg, decode=True, next_use=next_use)
        if setup.predictor != "previous":
            for lead in range(ahead + 1):  # the oracles' ring: tokens t .. t + ahead
                if t + lead < trace.tokens:
                    st.pred[(t + lead) % cfg.ring] = torch.maximum(st.pred[(t + lead) % cfg.ring],
                                                                   needed[t + lead].float())
        if active:
            _plan(st, cfg, -1, None, buffers, reserve=True)
            _land_fills(st, cfg)
        for p in range(positions):
            row = trace.experts[t, p][None]
            _plan(st, cfg, p, row, buffers, reserve=active)
            if setup.predictor == "previous" and t + 1 < trace.tokens:
                st.pred[(t + 1) % cfg.ring, p, row[0]] = 1.0 / k
            _land_fills(st, cfg)
        table.step_end(st, cfg)
    table.finish_call(st, cfg)
    total = LayerCounters()
    for row in st.counters.tolist():
        total = total + LayerCounters.from_row(row, setup.expert_bytes, cfg.chunk_bytes)
    return ReplayResult(setup, trace.tokens, total.uses, total.hit + total.prefetched + total.late, total.miss,
                        total.prefetch_issued, total.prefetched, total.prefetch_wasted, total.zero_copy_bytes,
                        total.fill_bytes)


class _Buffers:
    def __init__(self, k: int, unique: int):
        self.assign = torch.full((1, k), -1, dtype=torch.int32)
        self.u_key, self.u_slot, self.u_dst, self.u_wait = (torch.full((unique,), -1, dtype=torch.int32)
                                                            for _ in range(4))
        self.no_rows = torch.zeros(0, k, dtype=torch.int64)
        self.no_assign = torch.zeros(0, k, dtype=torch.int32)
        self.no_act = torch.zeros(0, dtype=torch.bool)
        self.one_act = torch.ones(1, dtype=torch.bool)


def _plan(st: TableState, cfg: ResidencyConfig, position: int, row: torch.Tensor | None, b: _Buffers,
          reserve: bool) -> None:
    if row is None:
        table.plan_layer(st, cfg, position, b.no_rows, b.no_act, None, None, b.no_assign, b.u_key, b.u_slot,
                         b.u_dst, reserve=reserve, count_recall=False, u_wait=b.u_wait)
    else:
        table.plan_layer(st, cfg, position, row, b.one_act, None, None, b.assign, b.u_key, b.u_slot, b.u_dst,
                         reserve=reserve, count_recall=True, u_wait=b.u_wait)


def _land_fills(st: TableState, cfg: ResidencyConfig) -> None:
    """Every reserved fill whose need is still ahead lands now (the replay counts bytes; the fill kernel's
    definition, `residency/fill.fill_reference`, without the bytes)."""
    live = (st.e_state == E_ACTIVE) & (st.e_ready == 0) & (st.e_deadline > st.progress)
    st.e_next[live] = cfg.chunks
    st.e_done[live] = cfg.chunks
    st.e_ready[live] = 1


@dataclass
class Floors:
    tokens: int
    slots: int
    lru_misses: int  # plain LRU (the reference the residency's LRU replay must equal)
    ahead_misses: dict[int, int]  # LRU protecting what the next K tokens need, per K
    belady_misses: int  # Belady's replacement, every miss admitted
    belady_bypass_misses: int  # Belady's, a miss read in place when everything cached is needed sooner: the floor


def floors(trace: DecodeTrace, slots: int, aheads: tuple[int, ...] = (1, 4)) -> Floors:
    steps = trace.steps()
    uses = [key for step in steps for key in step]
    return Floors(trace.tokens, slots, ahead_misses(steps, slots, 0),
                  {a: ahead_misses(steps, slots, a) for a in aheads}, belady_misses(uses, slots),
                  belady_bypass_misses(steps, slots))


def result_rows(results: list[ReplayResult], bounds: Floors | None, uses: int) -> list[dict]:
    """One printable row per replay and per bound: hits, misses and MB per token."""
    rows = []
    for r in results:
        s = r.setup
        label = f"{s.policy} / {s.predictor}" + (" + fills" if s.fills else "")
        rows.append({"row": label, "hit_rate": r.hit_rate, "misses_per_token": r.misses / r.tokens,
                     "mb_per_token": r.bytes_per_token / 1e6, "wasted_fills": r.prefetch_wasted,
                     "fills": r.prefetch_issued})
    if bounds is not None:
        expert_bytes = results[0].setup.expert_bytes if results else V2LITE_EXPERT_BYTES
        lines = [("reference LRU", bounds.lru_misses)]
        lines += [(f"reference LRU, {a} token{'s' * (a > 1)} ahead protected", m)
                  for a, m in bounds.ahead_misses.items()]
        lines += [("Belady", bounds.belady_misses), ("Belady with bypass (floor)", bounds.belady_bypass_misses)]
        for label, misses in lines:
            rows.append({"row": label, "hit_rate": 1 - misses / uses, "misses_per_token": misses / bounds.tokens,
                         "mb_per_token": misses * expert_bytes / bounds.tokens / 1e6, "wasted_fills": None,
                         "fills": None})
    return rows


def setups(slots: int, policies: list[str], predictors: list[str], fills: bool, **common) -> list[ReplaySetup]:
    """Every (policy, predictor) pair, fills on where asked and there is a predictor."""
    base = ReplaySetup(slots=slots, **common)
    return [replace(base, policy=p.strip(), predictor=q.strip(), fills=fills and q.strip() != "none")
            for p in policies for q in predictors]


__all__ = ["Floors", "ReplayResult", "ReplaySetup", "floors", "replay", "result_rows", "setups",
           "V2LITE_EXPERT_BYTES"]
