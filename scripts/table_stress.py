#!/usr/bin/env python
"""The residency table alone under decode's concurrency: every expert product checked bit for bit (an investigation).

The H200 runs showed published slots without their records when many fills are late (BENCHMARKS "4-bit and FP8
experts", "V2-Lite's shape with the real routing trace forced"), and the engine-level probes either changed the
timing enough to hide it or could not say which read went wrong. This drives a `Residency` the way a decode step
does (step start, the oracle's predictions, the step's own plan, then per MoE layer: plan, fill launch, await,
routed-expert kernel; the step's end), captured as one CUDA graph per step, with no model around it: each layer's
input rows, routing and weights are fixed random tensors indexed by the decode step, so no output feeds another and
every layer is checked on its own. The same inputs through an all-resident table give the expected products (the
expert kernel computes a product with the same program and tiles whether its bytes come from a slot or from host
memory); each distinct expert's product of every layer (`RoutedExperts._y`) is compared, so a wrong one names its
expert, the slot it was read from, and whether it was a hit, a waited-for fill or a host read. A dummy GEMV per
layer stands in for attention and the shared experts (`--compute-mb` of weights read).

    python scripts/table_stress.py --out OUT/table_stress.json --tokens 128 --slots 544 \
        --runs oracle,oracle_next:spare0,oracle:reread,oracle:eager --repeats 2
    python scripts/table_stress.py --device cpu --tiny      # the script itself, on the CPU (reference plans)

A run is `predictor[:modifier...]`: predictor `none`, `oracle` (whole future: Belady's victims and the next step's
routing) or `oracle_next` (the next step's routing only); modifiers `spare0`/`spare1` (prefetches may evict the
last step's experts), `reread` (late fills read from host instead of waited for), `eager` (no CUDA graph),
`idle` (fills for later layers yield the link to a layer's host reads),
`inflightN`, `budgetN`, `programsN` and `warpsN` (the fill kernel's grid and warps).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moeprefetch.expert_records import ExpertFormat  # noqa: E402
from moeprefetch.predictors import PredictionRing  # noqa: E402
from moeprefetch.residency import PlanBuffers, Residency  # noqa: E402
from moeprefetch.residency.fill import FILL_PROGRAMS, FILL_WARPS  # noqa: E402
from moeprefetch.residency.state import C, COUNTERS, ResidencyConfig  # noqa: E402
from moeprefetch.store import HostExpertStore  # noqa: E402
from moeprefetch.traces import load_trace  # noqa: E402

logger = logging.getLogger("table_stress")

DEFAULT_TRACE = ROOT / ".device-data" / "traces" / "nvmoe-dsv2lite-a.tokens.jsonl"
ENTRY_FIELDS = ("e_state", "e_key", "e_slot", "e_ready", "e_done", "e_next")


@dataclass
class Run:
    """One row: a predictor and the table settings it changes."""

    name: str
    predictor: str = "none"
    spare: int | None = None  # None: 0 for the full oracle (Belady needs no sparing), else 1 (the engine's)
    wait_late: bool = True
    graphs: bool = True
    inflight: int | None = None
    budget: int | None = None
    programs: int | None = None  # the fill kernel's grid (None: the engine's)
    warps: int | None = None  # its warps per program (None: the engine's)
    idle_link: bool = False  # fills for later layers yield the link to a layer's host reads (fill_link="idle")

    @staticmethod
    def parse(text: str) -> "Run":
        predictor, *mods = text.split(":")
        if predictor not in ("none", "oracle", "oracle_next"):
            raise SystemExit(f"unknown predictor {predictor!r} in {text!r}")
        run = Run(text, predictor)
        for mod in mods:
            if mod.startswith("spare"):
                run.spare = int(mod[5:])
            elif mod == "reread":
                run.wait_late = False
            elif mod == "eager":
                run.graphs = False
            elif mod == "idle":
                run.idle_link = True
            elif mod.startswith("inflight"):
                run.inflight = int(mod[8:])
            elif mod.startswith("budget"):
                run.budget = int(mod[6:])
            elif mod.startswith("programs"):
                run.programs = int(mod[8:])
            elif mod.startswith("warps"):
                run.warps = int(mod[5:])
            else:
                raise SystemExit(f"unknown modifier {mod!r} in {text!r}")
        return run


@dataclass
class Inputs:
    """Per decode step and MoE position: the routed rows' inputs, experts and weights (device tensors)."""

    x: torch.Tensor  # [T, P, H] compute dtype
    ids: torch.Tensor  # [T, P, k] int64
    weights: torch.Tensor  # [T, P, k] fp32
    needed: torch.Tensor  # [T, P, E] uint8 (the oracle's trace)


@dataclass
class Log:
    """What each layer of each step did (device tensors, written inside the captured step)."""

    out: torch.Tensor  # [T, P, H] fp32: the layer's routed output
    y: torch.Tensor  # [T, P, k, H] fp32: each distinct expert's product (u order; the GPU kernel's only)
    u: torch.Tensor  # [T, P, 4, k] int32: u_key, u_slot (after the await), u_dst, u_wait
    entries: torch.Tensor  # [T, P, len(ENTRY_FIELDS), M] int32 after the layer's plan
    sums: torch.Tensor | None = None  # [T, P, k, chunks] int64: each read slot's 64 KiB chunk sums (`--read-sums`)
    steps: int = 0
    extra: dict = field(default_factory=dict)


def make_inputs(trace_path: Path | None, tokens: int, hidden: int, n_experts: int, positions: int, top_k: int,
                dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    g = torch.Generator(device="cpu").manual_seed(seed)
    if trace_path is not None:
        trace = load_trace(trace_path)
        ids = trace.experts[:tokens]
        tokens = ids.shape[0]
    else:  # skewed random routing: a few popular experts per layer
        weights = 1.0 / torch.arange(1, n_experts + 1, dtype=torch.float64)
        ids = torch.stack([torch.stack([torch.multinomial(weights, top_k, generator=g) for _ in range(positions)])
                           for _ in range(tokens)])
    x = (torch.randn(tokens, ids.shape[1], hidden, generator=g) * 0.5).to(dtype)
    w = torch.rand(tokens, ids.shape[1], top_k, generator=g).float()
    w = w / w.sum(-1, keepdim=True)
    needed = torch.zeros(tokens, ids.shape[1], n_experts, dtype=torch.uint8)
    needed.scatter_(2, ids, 1)
    return Inputs(x.to(device), ids.to(device), w.to(device), needed.to(device))


def build_store(fmt: ExpertFormat, positions: int, n_experts: int, device: torch.device, pin: bool,
                seed: int) -> HostExpertStore:
    """Random experts (generated on the device, packed there, copied into the host arena)."""
    store = HostExpertStore(fmt, list(range(positions)), n_experts, pin=pin)
    g = torch.Generator(device=device).manual_seed(seed)
    staging = torch.zeros(fmt.record_bytes, dtype=torch.uint8, device=device)
    i, h = fmt.intermediate, fmt.hidden

    def pack(layer: int, expert: int, out: torch.Tensor) -> None:
        parts = [torch.randn(shape, generator=g, device=device, dtype=torch.float32) * 0.05
                 for shape in ((i, h), (i, h), (h, i))]
        staging.zero_()
        fmt.pack(*parts, staging)
        out.copy_(staging.cpu() if device.type != "cpu" else staging)

    store.fill(pack, progress=True)
    return store


def make_residency(fmt: ExpertFormat, positions: int, n_experts: int, top_k: int, slots: int | None,
                   store: HostExpertStore, device: torch.device) -> Residency:
    if slots is None:  # every expert resident, preloaded from the same records
        res = Residency(fmt, list(range(positions)), positions, n_experts, top_k, positions * n_experts, device,
                        "silu", None, max_rows=1)
        res.preload(lambda layer, expert, out: out.copy_(store.record(layer, expert)), progress=False)
        return res
    return Residency(fmt, list(range(positions)), positions, n_experts, top_k, slots, device, "silu", store,
                     max_rows=1, stage_rows=2)


class Stepper:
    """One decode step of the table, as `decode.DecodeStep._body` runs it, with its log."""

    def __init__(self, res: Residency, inputs: Inputs, run: Run, top_k: int, compute_mb: float, log: Log):
        self.res, self.inputs, self.run, self.log = res, inputs, run, log
        dev = res.device
        self.buffers = PlanBuffers(1, res.max_experts, top_k, res.fmt.hidden, dev, step_rows=1)
        self.act = torch.ones(1, dtype=torch.bool, device=dev)
        self.k = top_k
        self.oracle = run.predictor in ("oracle", "oracle_next") and not res.preloaded
        self.belady = run.predictor == "oracle" and not res.preloaded
        cols = max(int(compute_mb * 2**20 / 2 / res.fmt.hidden), 1)
        self.dummy_w = torch.randn(res.fmt.hidden, cols, device=dev, dtype=res.fmt.compute_dtype) * 0.01
        self.sink = torch.zeros(1, cols, device=dev, dtype=res.fmt.compute_dtype)
        torch.matmul(inputs.x[0, :1], self.dummy_w, out=self.sink)  # cuBLAS initialises outside the capture
        self.graph = None

    def configure(self) -> None:
        res, run, k = self.res, self.run, self.k
        if res.preloaded:
            res.configure()
            return
        belady = run.predictor == "oracle"
        spare = run.spare if run.spare is not None else (0 if belady else 1)
        budget = run.budget if run.budget is not None else math.ceil(1.5 * k)
        inflight = run.inflight if run.inflight is not None else max(2 * k, 4)
        res.configure(ring=2, budget_per_target=budget if self.oracle else 0, max_inflight=inflight,
                      spare_recent=spare, wait_late=run.wait_late, fill_idle_link=run.idle_link)
        if belady:
            res.know_future(self.inputs.needed)
        res.filler.programs = run.programs or FILL_PROGRAMS
        res.filler.num_warps = run.warps or FILL_WARPS

    def body(self) -> None:
        res, b, inp, log = self.res, self.buffers, self.inputs, self.log
        res.begin_step(decode=True, belady=self.belady)
        if self.oracle:
            PredictionRing(res.st.pred, res.st.decode_step, res.cfg.ring).write_trace(self.inputs.needed, 2)
            res.plan_step()
        t = res.st.decode_step
        x_t = inp.x.index_select(0, t)[0]  # [P, H]
        ids_t = inp.ids.index_select(0, t)[0]
        w_t = inp.weights.index_select(0, t)[0]
        out_t = log.out.index_select(0, t)[0]  # written back below
        y_t = log.y.index_select(0, t)[0]
        u_t = log.u.index_select(0, t)[0]
        e_t = log.entries.index_select(0, t)[0]
        s_t = log.sums.index_select(0, t)[0] if log.sums is not None else None
        for p in range(len(res.layers)):
            torch.matmul(x_t[p : p + 1], self.dummy_w, out=self.sink)  # attention and shared experts' reads
            out = res.decode_experts(p, x_t[p : p + 1].contiguous(), ids_t[p : p + 1], self.act, None, None,
                                     w_t[p : p + 1].contiguous(), b, reserve=self.oracle, count_recall=self.oracle)
            out_t[p].copy_(out[0])
            if res.experts.use_kernels:  # y is [u, rows padded, H]: the one row's products
                y_t[p].copy_(res.experts.products(b.step_rows)[: self.k, 0])
            u_t[p, 0].copy_(b.u_key[: self.k])
            u_t[p, 1].copy_(b.u_slot[: self.k])
            u_t[p, 2].copy_(b.u_dst[: self.k])
            u_t[p, 3].copy_(b.u_wait[: self.k])
            for f, name in enumerate(ENTRY_FIELDS):
                e_t[p, f].copy_(getattr(res.st, name))
            if s_t is not None:  # after the expert kernel: what the read slots held (or hold by now)
                words = res.pool.view(torch.int32).index_select(0, b.u_slot[: self.k].clamp(min=0).long())
                s_t[p].copy_(chunk_sums(words))
        log.out.index_copy_(0, t, out_t[None])
        log.y.index_copy_(0, t, y_t[None])
        log.u.index_copy_(0, t, u_t[None])
        log.entries.index_copy_(0, t, e_t[None])
        if s_t is not None:
            log.sums.index_copy_(0, t, s_t[None])
        res.end_step()

    def step(self) -> None:
        if not (self.run.graphs and self.res.device.type == "cuda"):
            self.body()
            return
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.body()
        self.graph.replay()


CHUNK_WORDS = ResidencyConfig.chunk_bytes // 4  # the fill kernel's chunk, in int32 words


def chunk_sums(words: torch.Tensor) -> torch.Tensor:
    """records as int32 words [n, W] -> [n, chunks] int64 sums of each 64 KiB chunk (a fingerprint per chunk)."""
    n, w = words.shape
    chunks = -(-w // CHUNK_WORDS)
    padded = torch.nn.functional.pad(words, (0, chunks * CHUNK_WORDS - w))
    return padded.view(n, chunks, CHUNK_WORDS).sum(-1, dtype=torch.int64)


def host_chunk_sums(store: HostExpertStore, device: torch.device, batch: int = 64) -> torch.Tensor:
    arena = store.arena.view(torch.int32)
    return torch.cat([chunk_sums(arena[i : i + batch].to(device)) for i in range(0, arena.shape[0], batch)])


def new_log(tokens: int, positions: int, top_k: int, hidden: int, entries: int, device: torch.device) -> Log:
    return Log(torch.zeros(tokens, positions, hidden, dtype=torch.float32, device=device),
               torch.zeros(tokens, positions, top_k, hidden, dtype=torch.float32, device=device),
               torch.full((tokens, positions, 4, top_k), -1, dtype=torch.int32, device=device),
               torch.zeros(tokens, positions, len(ENTRY_FIELDS), entries, dtype=torch.int32, device=device))


def run_once(res: Residency, inputs: Inputs, run: Run, top_k: int, compute_mb: float, read_sums: bool = False,
             host_sums: torch.Tensor | None = None) -> tuple[Log, dict]:
    tokens, positions = inputs.ids.shape[:2]
    log = new_log(tokens, positions, top_k, res.fmt.hidden, res.st.e_state.shape[0], res.device)
    if read_sums and not res.preloaded:
        chunks = -(-res.fmt.record_bytes // 4 // CHUNK_WORDS)
        log.sums = torch.zeros(tokens, positions, top_k, chunks, dtype=torch.int64, device=res.device)
    stepper = Stepper(res, inputs, run, top_k, compute_mb, log)
    stepper.configure()
    res.reset()
    res.begin_call()
    sync = torch.cuda.synchronize if res.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(tokens):
        stepper.step()
    sync()
    seconds = time.perf_counter() - start
    counters = res.end_call()
    totals = {name: int(counters[:, C[name]].sum()) for name in COUNTERS}
    corrupt = res.corrupt_slots() if not res.preloaded else []
    stats = {"ms_per_token": 1e3 * seconds / tokens, "counters": totals, "corrupt_slots": len(corrupt),
             "problems": res.problems()[:5] if not res.preloaded else []}
    if corrupt and host_sums is not None:
        stats["corrupt_detail"] = [corrupt_detail(res, slot, host_sums) for slot in corrupt[:4]]
    return log, stats


def _ranges(values: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for v in values:
        if out and v == out[-1][1] + 1:
            out[-1][1] = v
        else:
            out.append([v, v])
    return out


def corrupt_detail(res: Residency, slot: int, host_sums: torch.Tensor) -> dict:
    """A published slot that does not hold its record: which 64 KiB chunks differ, whose chunk each one holds (any
    (key, chunk) with the same sum), and word by word which parts of a wrong chunk differ and whose words they are."""
    key = int(res.st.key_of[slot])
    have = chunk_sums(res.pool[slot : slot + 1].view(torch.int32))[0]
    want = host_sums[key]
    wrong = torch.nonzero(have != want).flatten().tolist()
    arena = res.host.view(torch.int32)
    words = res.pool[slot].view(torch.int32)
    sources = {}
    for c in wrong[:4]:
        lo, hi = c * CHUNK_WORDS, min((c + 1) * CHUNK_WORDS, words.shape[0])
        got = words[lo:hi]
        own = arena[key, lo:hi].to(got.device)
        differ = torch.nonzero(got != own).flatten()
        column = arena[:, lo:hi].to(got.device)  # every key's same chunk
        at = differ
        agree = (column[:, at] == got[at]).float().mean(1)  # per key: share of the differing words it matches
        best = torch.topk(agree, 3)
        same_sum = torch.nonzero(host_sums == have[c]).tolist()[:4]
        sources[c] = {"differing_words": int(differ.numel()), "of": hi - lo,
                      "differing_word_ranges": _ranges(differ.tolist())[:12],
                      "zero_words": int((got[at] == 0).sum()),
                      "keys_matching_the_differing_words": [[int(k), round(float(a), 3)]
                                                            for k, a in zip(best.indices, best.values)],
                      "same_sum_elsewhere": same_sum}
    return {"slot": slot, "key": key, "chunks": int(want.shape[0]), "wrong_chunks": _ranges(wrong),
            "sources": sources}


def slot_history(log: Log, slot: int, until: tuple[int, int], limit: int = 40) -> list[dict]:
    """What happened to one slot up to (step, position): the fill entries that targeted it (as each layer's plan
    left them: state, key, chunks claimed and done, ready), admissions into it and reads of it."""
    entries = log.entries.cpu()
    u = log.u.cpu()
    f = {name: i for i, name in enumerate(ENTRY_FIELDS)}
    events, last = [], None
    steps, positions = entries.shape[:2]
    for t in range(steps):
        for p in range(positions):
            if (t, p) > until:
                return events[-limit:]
            e = entries[t, p]
            on = torch.nonzero((e[f["e_slot"]] == slot) & (e[f["e_state"]] != 0)).flatten().tolist()
            state = tuple((j, *(int(e[f[n], j]) for n in ENTRY_FIELDS if n != "e_slot")) for j in on)
            if state != last:
                events.append({"at": [t, p], "entries (j, state, key, ready, done, next)": state})
                last = state
            for x in range(u.shape[3]):
                if int(u[t, p, 2, x]) == slot:
                    events.append({"at": [t, p], "admitted": int(u[t, p, 0, x])})
                if int(u[t, p, 1, x]) == slot:
                    events.append({"at": [t, p], "read": int(u[t, p, 0, x]), "waited": int(u[t, p, 3, x])})
    return events[-limit:]


def compare(log: Log, ref: Log, inputs: Inputs, host_sums: torch.Tensor | None = None, limit: int = 12) -> dict:
    """Every (step, position, u) product against all-resident's: the wrong ones, classified by where they were read."""
    same_u = torch.equal(log.u[:, :, 0], ref.u[:, :, 0])
    bad = (log.y != ref.y).any(-1)  # [T, P, k]
    valid = log.u[:, :, 0] >= 0
    bad &= valid
    slot, wait, dst = log.u[:, :, 1], log.u[:, :, 3], log.u[:, :, 2]
    kinds = {"hit": bad & (slot >= 0) & (wait < 0), "waited_fill": bad & (slot >= 0) & (wait >= 0),
             "host_read": bad & (slot < 0) & (dst < 0), "host_read_admitted": bad & (slot < 0) & (dst >= 0)}
    first = []
    for t, p, u in torch.nonzero(bad).tolist()[:limit]:
        entry = int(wait[t, p, u])
        row = {"step": t, "position": p, "u": u, "key": int(log.u[t, p, 0, u]), "slot": int(slot[t, p, u]),
               "dst": int(dst[t, p, u]), "wait_entry": entry,
               "max_abs_diff": float((log.y[t, p, u] - ref.y[t, p, u]).abs().max())}
        slot_v = int(slot[t, p, u])
        if slot_v >= 0:  # which fills (this layer's table after its plan) target the slot that was read
            e = log.entries[t, p]
            hits = torch.nonzero(e[ENTRY_FIELDS.index("e_slot")] == slot_v).flatten().tolist()
            row["entries_on_slot"] = [{name: int(e[f, j]) for f, name in enumerate(ENTRY_FIELDS)} | {"j": j}
                                      for j in hits]
        if slot_v >= 0 and len(first) < 3:
            row["history"] = slot_history(log, slot_v, (t, p))
        first.append(row)
    if log.sums is not None and host_sums is not None:
        read = (slot >= 0) & valid
        keys = log.u[:, :, 0].clamp(min=0).long()
        expected = host_sums[keys]  # [T, P, k, chunks]
        torn = (log.sums != expected).any(-1) & read
        detail = []
        for t, p, x in torch.nonzero(torn).tolist()[:6]:
            diff = torch.nonzero(log.sums[t, p, x] != expected[t, p, x]).flatten().tolist()
            c = diff[0]
            detail.append({"step": t, "position": p, "u": x, "key": int(keys[t, p, x]), "slot": int(slot[t, p, x]),
                           "waited": int(wait[t, p, x]), "wrong_chunks": _ranges(diff),
                           "first_chunk_held_by_keys": torch.nonzero(
                               host_sums[:, c] == log.sums[t, p, x, c]).flatten().tolist()[:4]})
        read_check = {"slot_reads": int(read.sum()), "torn_after_read": int(torn.sum()), "torn": detail}
    else:
        read_check = None
    wrong_outputs = (log.out != ref.out).any(-1)  # [T, P]
    first_output = torch.nonzero(wrong_outputs).tolist()[:1]
    return {"same_experts": same_u, "checked": int(valid.sum()), "wrong": int(bad.sum()),
            "wrong_layer_outputs": int(wrong_outputs.sum()),
            "first_wrong_output": first_output[0] if first_output else None,
            "wrong_by_kind": {name: int(m.sum()) for name, m in kinds.items()},
            "first_wrong_step": first[0]["step"] if first else None, "first_wrong": first,
            "read_check": read_check}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--trace", type=Path, default=None, help=f"routing trace (default {DEFAULT_TRACE})")
    parser.add_argument("--tiny", action="store_true", help="a small synthetic table (the script on the CPU)")
    parser.add_argument("--synthetic", type=int, nargs=3, metavar=("POSITIONS", "EXPERTS", "TOP_K"),
                        help="skewed random routing of this shape instead of a trace (it did not show the torn "
                        "chunks that the real trace did: BENCHMARKS \"The fill kernel's torn chunks\")")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--expert-dtype", default="model", help="model (bf16), fp8, int8 or int4")
    parser.add_argument("--slots", type=int, default=544)
    parser.add_argument("--compute-mb", type=float, default=40.0, help="weights a dummy GEMV reads per layer")
    parser.add_argument("--runs", default="none,oracle,oracle_next:spare0")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--read-sums", action="store_true",
                        help="fingerprint every slot a layer read, right after its expert kernel (slows each layer)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = torch.device(args.device)
    if args.tiny:
        hidden, inter, positions, n_experts, top_k, trace = 64, 32, 4, 8, 2, None
        slots = min(args.slots, 12)
    elif args.synthetic:
        (positions, n_experts, top_k), trace = args.synthetic, None
        hidden, inter, slots = args.hidden, args.intermediate, args.slots
    else:
        trace = args.trace or DEFAULT_TRACE
        t = load_trace(trace)
        hidden, inter = args.hidden, args.intermediate
        positions, n_experts, top_k = len(t.layers), t.n_experts, t.top_k
        slots = args.slots
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fmt = ExpertFormat.build(hidden, inter, dtype, args.expert_dtype)
    inputs = make_inputs(trace, args.tokens, hidden, n_experts, positions, top_k, dtype, device, args.seed)
    tokens = inputs.ids.shape[0]
    logger.info("%d tokens, %d positions x %d experts (top-%d), %d slots of %.1f MB", tokens, positions, n_experts,
                top_k, slots, fmt.record_bytes / 1e6)
    store = build_store(fmt, positions, n_experts, device, pin=device.type == "cuda", seed=args.seed)
    host_sums = host_chunk_sums(store, device)
    resident = make_residency(fmt, positions, n_experts, top_k, None, store, device)
    ref_log, ref_stats = run_once(resident, inputs, Run("all_resident"), top_k, args.compute_mb)
    ref_again, _ = run_once(resident, inputs, Run("all_resident"), top_k, args.compute_mb)
    rows = [{"run": "all_resident", **ref_stats, "repeats_itself": bool(torch.equal(ref_log.y, ref_again.y))}]
    del ref_again
    resident.close()
    del resident
    cached = make_residency(fmt, positions, n_experts, top_k, slots, store, device)
    for text in args.runs.split(","):
        run = Run.parse(text)
        for repeat in range(args.repeats):
            log, stats = run_once(cached, inputs, run, top_k, args.compute_mb, args.read_sums, host_sums)
            row = {"run": run.name, "repeat": repeat, **stats, **compare(log, ref_log, inputs, host_sums)}
            logger.info("%s #%d: %.2f ms/token, %d wrong of %d products %s, late %d, corrupt slots %d", run.name,
                        repeat, row["ms_per_token"], row["wrong"], row["checked"], row["wrong_by_kind"],
                        row["counters"]["late"], row["corrupt_slots"])
            rows.append(row)
            if args.out:  # after every row: a call that runs out of time keeps what it measured
                write(args.out, args, fmt, slots, rows)
    cached.close()
    if args.out:
        write(args.out, args, fmt, slots, rows)


def write(path: Path, args: argparse.Namespace, fmt: ExpertFormat, slots: int, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    setup = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    path.write_text(json.dumps({"setup": setup, "record_bytes": fmt.record_bytes, "slots": slots,
                                "environment": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
