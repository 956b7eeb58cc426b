"""One decode step, captured as one CUDA graph: all layers, the routed experts through the residency table, sampling,
the MTP head, the predictors and the prefetch fills on a side branch.

Per step the host writes the step's inputs (token, position and activity per sequence, the extra rows' tokens, and
whether a verify row checks its draft: `verify_confidence`) into a pinned buffer, launches the graph and reads the
sampled ids back: one synchronisation per token, none per layer. Every MoE layer runs `plan -> fill launch (side
stream) -> routed experts` on the device.

Extra rows ride along with the real ones (`model.block` gives them their own attention calls, so the real rows'
shapes never change): `shadow` rows carry the MTP draft and use only experts that are published or read anyway
(the `mtp` predictor); `verify` rows carry the drafts exactly (speculative decoding): one, or a chain of
`draft_tokens` drafts checked together (draft j + 1 is the MTP head chained on draft j's output, as vLLM and SGLang
reuse DeepSeek's one MTP module for several draft tokens).

On the CPU the same step runs eagerly through the reference implementations.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .model import Routing, block, mtp_input
from .predictors import PredictionRing, PredictorSpec, routing_confidence
from .residency import PlanBuffers
from .runner import KVCaches, ModelRunner
from .sampling import LOGPROBS_MAX, DeviceSampler, SamplingParams, TokenLogprob, read_logprobs, token_logprobs
from .streaming import RingStep

logger = logging.getLogger(__name__)

MODES = ("none", "shadow", "verify")


@dataclass(frozen=True)
class StepShape:
    """What a captured step depends on (a new shape gets its own graph)."""

    batch: int
    mode: str  # none | shadow | verify
    spec: PredictorSpec
    run_mtp: bool  # the MTP head runs (drafts for speculation or the shadow row, or mtp_router predictions)
    greedy: bool
    top_k: bool
    top_p: bool
    reserve: bool  # predictions become prefetches (never with every expert resident)
    record: bool = False  # the routing is recorded into the table's trace (the oracle's first pass)
    draft_cached: bool = False  # the MTP head computes with the routed experts in VRAM only and never fetches one
    # the MTP head's vocabulary head runs (drafts for speculation, the shadow row, chains and their accounting); off
    # when only the learned head reads link 1's output (at V2-Lite's vocabulary, a 420 MB GEMV a step saved)
    drafts: bool = True
    adjust: bool = False  # logit bias or penalties: rows count their tokens and every draw reads the adjuster
    logprobs: bool = False  # each sampled token's log-probability and its LOGPROBS_MAX alternatives come back
    draft_tokens: int = 1  # verify: the drafts a step checks (a chain of MTP drafts), one extra row each
    # rows per sequence the engine fixes its kernels for (1 + its draft_tokens): every step of every mode multiplies
    # the same way, so a row's bits never depend on the mode
    rows_per_sequence: int = 2
    # verify_rows="shared": every step computes its rows_per_sequence rows of a sequence as one batch (the real row,
    # the extra rows, padding rows), so a verify step reads each weight once for all its rows; a row's bits stay
    # the same in every mode because every mode's kernels see the same rows
    shared_rows: bool = False

    @property
    def extra(self) -> int:
        """Extra rows per sequence: the shadow row, or the verified drafts."""
        return {"none": 0, "shadow": 1, "verify": self.draft_tokens}[self.mode]

    @property
    def sampled(self) -> int:
        """Tokens sampled per sequence: after the real row, and after each verified draft (the MTP head runs one row
        after each)."""
        return 1 + self.draft_tokens if self.mode == "verify" else 1

    @property
    def chain(self) -> int:
        """Drafts a step puts out per sequence: the MTP row after the last token kept, chained (verify) to as many
        drafts as the next step checks."""
        return self.draft_tokens if self.mode == "verify" else 1


@dataclass
class StepOutput:
    """What the host reads back after a step (plain lists)."""

    next_tokens: list[int]  # [B] sampled after the real rows
    later_tokens: list[list[int]] | None  # [B][D] verify: sampled after each draft row
    # [B][C] the next drafts (greedy): the MTP row after the last token kept, chained C long, and the chance that
    # each is right with those before it
    drafts: list[list[int]] | None
    draft_probs: list[list[float]] | None
    logprobs: list[list[TokenLogprob]] | None = None  # [B][1 + D] the sampled tokens' (next, then the later ones)


@dataclass
class RowState:
    """The host's side of one sequence in a decode step: what a generate call (`session.Session`) and a continuous
    batch (`batching.ContinuousBatch`) both keep per row, and `run_rows` turns into a step's inputs."""

    prompt_tokens: int
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()  # ids that end the row (empty: it runs to max_new_tokens)
    # the MTP head's guesses of the tokens after the next one, in order (the extra rows' inputs), and the chance that
    # each is right with those before it (the product of the head's probabilities along the chain)
    drafts: list[int] = field(default_factory=list)
    draft_probs: list[float] = field(default_factory=list)
    active: bool = True  # a finished row of a call stays in its batch, computed but masked

    @property
    def position(self) -> int:
        """Cache position of the row's next input token (its last generated one)."""
        return self.prompt_tokens + len(self.generated) - 1

    @property
    def finished(self) -> bool:
        """It has its max_new_tokens, or its last token is a stop id."""
        return len(self.generated) >= self.max_new_tokens or (bool(self.generated)
                                                               and self.generated[-1] in self.stop_ids)

    def would_finish(self, token: int, pending: int = 0) -> bool:
        """Whether appending `token` after `pending` tokens not yet appended ends the row."""
        return token in self.stop_ids or len(self.generated) + pending + 1 >= self.max_new_tokens

    def set_drafts(self, drafts: list[int], probs: list[float]) -> None:
        self.drafts, self.draft_probs = list(drafts), list(probs)

    def draft(self, j: int) -> tuple[int, float]:
        """Draft j (0: the guess of the token after the next one) and its chance, (0, 0.0) when there is none."""
        return (self.drafts[j], self.draft_probs[j]) if j < len(self.drafts) else (0, 0.0)


def verified(state: RowState, verify_cut: float, j: int = 0) -> bool:
    """Whether a verify step checks this row's draft j: it exists and its chance (the MTP head's probabilities along
    the chain) is at least `verify_cut` (speculation's `verify_confidence`); an unchecked draft row reads none of its
    routed experts. The chances fall along a chain, so the drafts checked are always a prefix."""
    return state.active and j < len(state.drafts) and state.draft_probs[j] >= verify_cut


def run_rows(step: "DecodeStep", rows: list[RowState | None], verify_cut: float = 0.0) -> StepOutput:
    """One step over the rows' states -> what it sampled; `None` is a free row (token 0 at position 0, masked). The
    one place where host rows become a step's inputs."""
    extra = range(step.shape.extra)
    free = [(0, 0.0)] * len(extra)
    drafts = [[s.draft(j) for j in extra] if s is not None else free for s in rows]
    return step([s.generated[-1] if s is not None else 0 for s in rows],
                [s.position if s is not None else 0 for s in rows],
                [s is not None and s.active for s in rows],
                [[d for d, _ in row] for row in drafts] if extra else None,
                [[p for _, p in row] for row in drafts] if extra else None,
                [[s is not None and verified(s, verify_cut, j) for j in extra] for s in rows]
                if step.shape.mode == "verify" else None)


@dataclass
class Advance:
    """What a step gave its rows (`advance_rows`): each row's new tokens and the drafts' tallies."""

    tokens: list[list[int]]  # per row: the sampled token, then the verified later ones; [] for a free or finished row
    drafts_checked: int = 0  # rows whose MTP draft could be compared with the token sampled (the `mtp` accounting)
    drafts_correct: int = 0
    offered: int = 0  # live rows of a verify step (speculation)
    # speculation, per draft position j: drafts reached (those before them all kept) and checked (`verified`), and
    # kept (the draft was the token sampled before it, which did not end the row)
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)


def advance_rows(out: StepOutput, rows: list[RowState | None], check_drafts: bool, verify_cut: float = 0.0
                 ) -> Advance:
    """A step's output -> each active row's tokens, and the rows take their next drafts. The one place where a
    step's samples become the rows' tokens, for a generate call (`session.Session`) and a continuous batch
    (`batching.ContinuousBatch`) alike; the callers append the tokens (a call emits them one at a time).

    With verify rows (speculation) a row keeps its drafts in order while each was checked (`verified`, with the
    `verify_cut` the step ran with), is the token sampled before it and that token does not end the row; each kept
    draft adds the token sampled after its row. The next drafts are the chain of the MTP row after the last token
    kept."""
    depth = len(out.later_tokens[0]) if out.later_tokens else 0
    result = Advance([[] for _ in rows], proposed=[0] * depth, accepted=[0] * depth)
    for b, state in enumerate(rows):
        if state is None or not state.active:
            continue
        token = out.next_tokens[b]
        tokens = [token]
        if check_drafts:  # drafts exist (not when only the learned head reads the MTP head)
            result.drafts_checked += 1
            result.drafts_correct += int(state.draft(0)[0] == token)
        result.offered += out.later_tokens is not None
        for j in range(depth):
            if not verified(state, verify_cut, j):
                break
            result.proposed[j] += 1
            if state.drafts[j] != tokens[-1] or state.would_finish(tokens[-1], pending=len(tokens) - 1):
                break
            result.accepted[j] += 1
            tokens.append(out.later_tokens[b][j])
        result.tokens[b] = tokens
        if out.drafts is not None:  # drafted on the device after the drafts it kept, as here unless the row ends
            state.set_drafts(out.drafts[b], out.draft_probs[b])
    return result


def decode_rows(step: "DecodeStep", rows: list[RowState | None], check_drafts: bool, verify_cut: float = 0.0
                ) -> tuple[StepOutput, Advance]:
    """One decode step over the rows and what it gave them: the one loop body of a generate call
    (`session.Session`) and of a continuous batch (`batching.ContinuousBatch`). A row that is None, or inactive
    (finished, or masked while its prefill runs), is computed if the step's shape holds it and gets nothing."""
    out = run_rows(step, rows, verify_cut)
    return out, advance_rows(out, rows, check_drafts, verify_cut)


class DecodeStep:
    """A decode step of one shape: static buffers, an eager first run, then capture and replay."""

    def __init__(self, runner: ModelRunner, caches: KVCaches, sampler: DeviceSampler, shape: StepShape,
                 graphs: bool, oracle_trace: torch.Tensor | None = None):
        self.runner = runner
        self.args = runner.args
        self.weights = runner.weights
        self.res = runner.residency
        self.ops = runner.decode_ops
        self.caches = caches
        self.sampler = sampler
        self.shape = shape
        self.params = SamplingParams(temperature=0.0 if shape.greedy else 1.0, top_k=2 if shape.top_k else 0,
                                     top_p=0.5 if shape.top_p else 1.0)
        self.oracle_trace = oracle_trace
        self.forced = runner.forced_routing  # routing_trace (benchmarks): decode routing taken from a trace
        dev, b, h = runner.device, shape.batch, self.args.hidden_size
        # the residency's reference path plans on the host (it synchronises), which a graph cannot capture
        self.graphs = graphs and dev.type == "cuda" and self.res.use_kernels
        self._graph: torch.cuda.CUDAGraph | None = None
        self.streamer = runner.streamer
        self._ring_step: RingStep | None = None  # what the captured graph does to the streamed layers' ring
        self._runs = 0
        e, sampled = shape.extra, shape.sampled
        # per row: token, position, active, then the extra rows' tokens, then (verify) whether each draft is checked
        self.inputs = torch.zeros(b, 3 + e + (e if shape.mode == "verify" else 0), dtype=torch.int64, device=dev)
        self.draft_conf = torch.zeros(b, max(e, 1), dtype=torch.float32, device=dev)
        # verify_rows='shared': the padding rows' tokens (a step computes rows_per_sequence rows a sequence)
        self.padding = torch.zeros(b, shape.rows_per_sequence - 1 - e if shape.shared_rows else 0, dtype=torch.int64,
                                   device=dev)
        # per row: the sampled tokens, then the next drafts
        self.outputs = torch.zeros(b, sampled + shape.chain, dtype=torch.int64, device=dev)
        self.probs = torch.zeros(b, shape.chain, dtype=torch.float32, device=dev)
        self.logits = torch.zeros(b, self.args.vocab_size, dtype=torch.float32, device=dev)  # the last step's
        n = self.top_logprobs = min(LOGPROBS_MAX, self.args.vocab_size)
        self.lp_values = torch.zeros(b, sampled, 1 + n, dtype=torch.float32, device=dev)
        self.lp_ids = torch.zeros(b, sampled, n, dtype=torch.int64, device=dev)
        pin = dev.type == "cuda"
        self.lp_values_host = torch.zeros(self.lp_values.shape, dtype=torch.float32, pin_memory=pin)
        self.lp_ids_host = torch.zeros(self.lp_ids.shape, dtype=torch.int64, pin_memory=pin)
        self.inputs_host = torch.zeros(self.inputs.shape, dtype=torch.int64, pin_memory=pin)
        self.conf_host = torch.zeros(self.draft_conf.shape, dtype=torch.float32, pin_memory=pin)
        self.outputs_host = torch.zeros(self.outputs.shape, dtype=torch.int64, pin_memory=pin)
        self.probs_host = torch.zeros(self.probs.shape, dtype=torch.float32, pin_memory=pin)
        self.rows = torch.arange(b, device=dev)
        self.buffers = PlanBuffers(self.res.max_rows, self.res.max_experts, self.args.num_experts_per_tok, h, dev,
                                   step_rows=shape.rows_per_sequence * b)
        head = runner.learned_head  # its layers' positions and keys in the table (made before any capture)
        self._learned_positions = None if head is None else torch.tensor(
            [[self.res.position[layer]] for layer in head.config.layers], dtype=torch.int64, device=dev)
        self._learned_keys = None if head is None else torch.tensor(
            [self.res.position[layer] * self.res.cfg.n_experts + e for layer in head.config.layers
             for e in range(head.config.n_experts)], dtype=torch.int64, device=dev)
        self.ring = PredictionRing(self.res.st.pred, self.res.st.decode_step, shape.spec.ring,
                                   self.res.leads if shape.spec.max_lead else None, self.res.cfg.min_confidence,
                                   self.res.local_ids if self.res.local_of is not None else None)
        moe = [lw.index for lw in self.weights.layers if lw.router is not None]
        depth = shape.spec.gate_depth
        self.gate_targets = {layer: moe[i + 1 : i + 1 + depth] for i, layer in enumerate(moe)}
        self.routers = {lw.index: lw for lw in self.weights.layers if lw.router is not None}
        self._done = torch.cuda.Event() if dev.type == "cuda" else None

    # ---- host side ------------------------------------------------------------------------------------------------
    def __call__(self, tokens: list[int], positions: list[int], active: list[bool],
                 extra_tokens: list[list[int]] | None = None, draft_conf: list[list[float]] | None = None,
                 verify: list[list[bool]] | None = None) -> StepOutput:
        """One step; inputs per sequence: the extra rows' tokens and chances (`shape.extra` each), and `verify`:
        which drafts a verify step checks (default: every draft of an active row). Returns the sampled ids after one
        device->host synchronisation."""
        e, checks = self.shape.extra, self.shape.mode == "verify"
        extra = extra_tokens if extra_tokens is not None else [[t] * e for t in tokens]
        verify = verify if verify is not None else [[a] * e for a in active]
        rows = [[t, p, int(a)] + list(x[:e]) + ([int(c) for c in v[:e]] if checks else [])
                for t, p, a, x, v in zip(tokens, positions, active, extra, verify)]
        self.inputs_host.copy_(torch.tensor(rows, dtype=torch.int64).view(self.inputs_host.shape))
        self.inputs.copy_(self.inputs_host, non_blocking=True)
        if draft_conf is not None:
            self.conf_host.copy_(torch.tensor(draft_conf, dtype=torch.float32))
            self.draft_conf.copy_(self.conf_host, non_blocking=True)
        self._run()
        self.outputs_host.copy_(self.outputs, non_blocking=True)
        if self.shape.run_mtp:
            self.probs_host.copy_(self.probs, non_blocking=True)
        if self.shape.logprobs:
            self.lp_values_host.copy_(self.lp_values, non_blocking=True)
            self.lp_ids_host.copy_(self.lp_ids, non_blocking=True)
        if self._done is not None:
            self._done.record()
            self._done.synchronize()  # the step's one synchronisation
        out = self.outputs_host.tolist()
        shape = self.shape
        s = shape.sampled
        drafts = shape.run_mtp and shape.drafts
        return StepOutput(
            next_tokens=[row[0] for row in out],
            later_tokens=[row[1:s] for row in out] if shape.mode == "verify" else None,
            drafts=[row[s:] for row in out] if drafts else None,
            draft_probs=self.probs_host.tolist() if drafts else None,
            logprobs=self._read_logprobs(out) if shape.logprobs else None,
        )

    def _read_logprobs(self, out: list[list[int]]) -> list[list[TokenLogprob]]:
        """The step's log-probabilities per row: the next token's, then (verify) the later ones'."""
        values, ids = self.lp_values_host.tolist(), self.lp_ids_host.tolist()
        sampled = self.lp_values.shape[1]
        return [read_logprobs(row[:sampled], v, i) for row, v, i in zip(out, values, ids)]

    def _run(self) -> None:
        self._runs += 1
        streamer = self.streamer
        if streamer is not None:
            streamer.enter_step(self._ring_step)
        if not self.graphs or self._runs == 1:  # the first run is eager: it compiles kernels and warms up cuBLAS
            self._body()
            return
        if self._graph is None:
            self._capture()
            if self._graph is None:
                return
        self._graph.replay()
        if streamer is not None:
            streamer.replayed(self._ring_step)

    def _capture(self) -> None:
        """Capture the step (without running it); on failure run it eagerly from now on."""
        streamer = self.streamer
        ring = streamer.begin_capture() if streamer is not None else None
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self._body()
        except Exception as exc:  # capture is an optimisation; the eager step computes the same
            logger.warning("CUDA graph capture of the decode step failed (%s); running it eagerly", exc)
            self.graphs = False
            torch.cuda.synchronize()
            if streamer is not None:
                streamer.abort()  # the capture moved the host's view of the ring without copying anything
                streamer.bytes_copied = ring[1]
                streamer.enter_step()
            self._body()
            return
        if streamer is not None:
            self._ring_step = streamer.end_capture(ring)
        self._graph = graph

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def release(self) -> None:
        self._graph = None

    # ---- the device work (captured) -------------------------------------------------------------------------------
    def _body(self) -> None:
        res, shape = self.res, self.shape
        oracle = shape.spec.oracle and self.oracle_trace is not None
        res.begin_step(decode=True, belady=oracle and shape.spec.belady)
        if self.streamer is not None:
            self.streamer.fork()
        if oracle:
            self.ring.write_trace(self.oracle_trace, shape.spec.oracle_steps)
        if shape.reserve:
            res.plan_step()
        tokens, pos = self.inputs[:, 0], self.inputs[:, 1]
        self.active = self.inputs[:, 2] != 0
        e = shape.extra
        # verify: [B, D] the draft rows checked this step (the others compute without their routed experts: no bytes)
        self.checked = self.active[:, None] & (self.inputs[:, 3 + e : 3 + 2 * e] != 0) \
            if shape.mode == "verify" else None
        if shape.adjust:  # a row's input token is its latest generated one: penalties count it from now on
            self.sampler.logit_adjuster().count(tokens, self.active)
        if shape.shared_rows:  # one batch [B, rows_per_sequence]: the real row, the extra rows, padding rows
            groups = [self.runner.embed(torch.cat((tokens[:, None], self.inputs[:, 3 : 3 + e], self.padding), 1))]
            # row j of a sequence at position pos + j; padding rows never past the cache (the positions a request
            # reserves keep every real, shadow and draft row below its end: only padding clamps, and the entries it
            # writes there are written again by a real row before any row reads them)
            row_pos = (pos[:, None] + torch.arange(shape.rows_per_sequence, device=pos.device)).clamp(
                max=self.caches.capacity - 1)
        else:  # the real rows, then each extra row, each a batch of its own (one position ahead each: `_attend`)
            groups = [self.runner.embed(tokens[:, None])]
            groups += [self.runner.embed(self.inputs[:, 3 + j : 4 + j]) for j in range(e)]
            row_pos = pos
        for lw in self.weights.layers:
            self.runner.enter(lw.index)
            groups = block(self.ops, lw, groups, self._attend(lw, row_pos), self._routed)
            self.runner.leave(lw.index)
        hidden_of, logits_of = self._heads(groups)
        hidden = hidden_of(0)
        self.logits.copy_(logits_of(0, hidden))
        next_tokens = self.sampler(self.logits, self.params, self.rows, pos + 1, adjust=shape.adjust)
        self.outputs[:, 0].copy_(next_tokens)
        self._logprobs(0, self.logits, next_tokens)
        mtp_tokens, mtp_hidden = [next_tokens], [hidden]
        for j in range(1, shape.sampled):  # verify: the token after each draft row, at its own position's seed
            draft_hidden = hidden_of(j)
            draft_logits = logits_of(j, draft_hidden)
            later = self.sampler(draft_logits, self.params, self.rows, pos + 1 + j, adjust=shape.adjust)
            self.outputs[:, j].copy_(later)
            self._logprobs(j, draft_logits, later)
            mtp_tokens.append(later)
            mtp_hidden.append(draft_hidden)
        mtp_out = self._mtp(torch.stack(mtp_tokens, 1), torch.stack(mtp_hidden, 1), pos) if shape.run_mtp else None
        if shape.spec.learned:
            self._learned(hidden, mtp_out)
        if self.streamer is not None:
            self.streamer.join()
        if self.ring.leads is not None:  # this step's guesses of every lead meet the experts it used
            self.ring.leads.close_step(res.st.decode_step)
        res.end_step()

    def _heads(self, groups: list[torch.Tensor]):
        """(row j -> its final hidden state [B, H], (row j, that state) -> its logits [B, V]): j = 0 the real rows,
        j >= 1 the extra rows. Shared rows go through the final norm and the vocabulary head together, every row of
        the batch in every mode (so a row's logits have the same bits in a plain and a verify step); separate ones
        each as a batch of its own."""
        final_norm = self.weights.final_norm
        if not self.shape.shared_rows:
            return (lambda j: self.ops.norm(groups[j][:, 0], final_norm)), (lambda j, h: self.runner.logits(h))
        b, r, h = groups[0].shape
        hiddens = self.ops.norm(groups[0].reshape(b * r, h), final_norm)
        logits = self.runner.logits(hiddens).view(b, r, -1)
        hiddens = hiddens.view(b, r, h)
        return (lambda j: hiddens[:, j]), (lambda j, _: logits[:, j])

    def _logprobs(self, index: int, logits: torch.Tensor, chosen: torch.Tensor) -> None:
        if self.shape.logprobs:
            values, ids = token_logprobs(logits, chosen, self.top_logprobs)
            self.lp_values[:, index].copy_(values)
            self.lp_ids[:, index].copy_(ids)

    def _attend(self, lw, pos: torch.Tensor):
        kv = self.caches.layers[lw.index]
        if self.shape.shared_rows:  # `pos`: every row's position [B, rows_per_sequence] (else the real rows' [B])

            def attend_shared(_: int, normed: torch.Tensor) -> torch.Tensor:
                return self.ops.attend_decode(lw.attn, normed, pos, kv)

            return attend_shared

        def attend(group: int, normed: torch.Tensor) -> torch.Tensor:
            positions = pos[:, None] + group  # extra rows sit one position ahead
            return self.ops.attend_decode(lw.attn, normed, positions, kv)

        return attend

    def _routed(self, layer: int, flat: list[torch.Tensor], routings: list[Routing]) -> list[torch.Tensor]:
        """The routed experts of every group of one layer, in one plan and one expert computation."""
        if not self.shape.shared_rows:
            return self._routed_kinds(layer, flat, routings)
        # shared rows [B * rows_per_sequence]: the real rows and each extra row as the plan sees them (by kind, in
        # the order separate rows give), padding rows none of the experts (their output zero)
        b, r = self.shape.batch, self.shape.rows_per_sequence
        kinds = 1 + self.shape.extra
        x, routing = flat[0].view(b, r, -1), routings[0]

        def row(t: torch.Tensor, j: int) -> torch.Tensor:
            return t.view(b, r, *t.shape[1:])[:, j]

        # ids and weights dense (the plan and expert kernels read dense rows); the scores, which decode only passes
        # on, as views
        outs = self._routed_kinds(layer, [x[:, j] for j in range(kinds)],
                                  [Routing(ids=row(routing.ids, j).contiguous(), weights=row(routing.weights, j)
                                           .contiguous(), scores=row(routing.scores, j)) for j in range(kinds)])
        padding = [torch.zeros_like(outs[0])] * (r - kinds)
        return [torch.stack(outs + padding, 1).view(b * r, -1)]

    def _routed_kinds(self, layer: int, flat: list[torch.Tensor], routings: list[Routing]) -> list[torch.Tensor]:
        """`_routed` over the real rows (flat[0]) and each kind of extra row (flat[1:])."""
        shape, res = self.shape, self.res
        active = self.active
        position = res.position[layer]
        main = position < res.cfg.main_positions
        if main and self.forced is not None:  # routing_trace: the real rows take the trace's experts
            logits = F.linear(flat[0].float(), self.routers[layer].router.weight)
            ids, weights = self.forced.route(position, logits, res.st.decode_step)
            routings = [Routing(ids=ids, weights=weights, scores=routings[0].scores), *routings[1:]]
        real = routings[0]
        if main and shape.spec.active:
            self._predict(layer, position, flat[0], routings, active)
            if self.ring.leads is not None:  # the real rows' experts, for scoring predictions by lead
                self.ring.note(position, real.ids, active)
        if len(flat) == 1:
            ids_x, act_x, ids_s, act_s, weights = real.ids, active, None, None, real.weights
        elif shape.mode == "verify":
            ids_x = torch.cat([r.ids for r in routings])
            act_x = torch.cat((active, *self.checked.unbind(1)))
            ids_s = act_s = None
            weights = torch.cat([r.weights for r in routings])
        else:
            ids_x, act_x, ids_s, act_s = real.ids, active, routings[1].ids, active
            weights = torch.cat((real.weights, routings[1].weights))
        x = torch.cat(flat) if len(flat) > 1 else flat[0]
        out = res.decode_experts(layer, x.contiguous(), ids_x, act_x, ids_s, act_s, weights, self.buffers,
                                 shape.reserve, count_recall=main)
        return list(out.split([f.shape[0] for f in flat]))

    def _predict(self, layer: int, position: int, h: torch.Tensor, routings: list[Routing],
                 active: torch.Tensor) -> None:
        """Predictors that see this layer's router input or routing write the ring before the layer's plan."""
        spec, ring, live = self.shape.spec, self.ring, active.float()[:, None]
        if spec.previous:
            ring.write(1, position, routings[0].ids, routing_confidence(routings[0].weights) * live)
        for target in self.gate_targets.get(layer, ()):
            guess = self.ops.route(self.routers[target].router, h)
            ring.write(0, self.res.position[target], guess.ids, routing_confidence(guess.weights) * live)
        if spec.shadow and self.shape.mode == "shadow":
            conf = routing_confidence(routings[1].weights) * (live * self.draft_conf[:, :1])
            ring.write(1, position, routings[1].ids, conf)

    def _mtp(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The MTP head over (token after row, row's final hidden) pairs [B, M]: the next drafts and their chances,
        from the MTP row after the last token the step keeps (verify: found here as on the host, from the drafts
        checked and the tokens sampled), chained (link j drafts from link j-1's output and draft) to the verify
        step's `draft_tokens`, or with lookahead k > 1 chained k times, each link's output routed through the main
        routers as predictions j steps ahead (`predictors.py`)."""
        shape, spec = self.shape, self.shape.spec
        rows = tokens.shape[1]
        positions = pos[:, None] + torch.arange(1, rows + 1, device=pos.device)
        x = self._mtp_link(tokens, hidden, positions, chained=False)
        first = x  # link 1's output [B, M, H], which the learned head reads
        if not shape.drafts:
            return first
        probs, drafts = self.runner.mtp_logits(x).softmax(-1).max(-1)  # [B, M]
        if spec.mtp_router:
            self._route_ahead(x, 1, None)
        kept = self._kept(tokens) if rows > 1 else torch.zeros_like(pos)  # [B]
        x = x[self.rows, kept][:, None]  # [B, 1, H]
        draft, reach = drafts[self.rows, kept], probs[self.rows, kept]
        s = shape.sampled
        self.outputs[:, s].copy_(draft)
        self.probs[:, 0].copy_(reach)
        links = max(spec.chain if rows == 1 else 1, shape.chain)  # prefetch chains only from one MTP row
        for lead in range(2, links + 1):
            x = self._mtp_link(draft[:, None], x, (pos + kept)[:, None] + lead, chained=True)
            if spec.chain > 1:
                self._route_ahead(x, lead, reach)
            if lead < links or lead <= shape.chain:  # (the last prefetch link's draft would go unused)
                p, draft = self.runner.mtp_logits(x)[:, 0].softmax(-1).max(-1)
                reach = reach * p
                if lead <= shape.chain:
                    self.outputs[:, s + lead - 1].copy_(draft)
                    self.probs[:, lead - 1].copy_(reach)
        return first

    def _kept(self, sampled: torch.Tensor) -> torch.Tensor:
        """[B] drafts a verify step keeps per row, as `advance_rows` counts them (a row that ends keeps fewer, but
        then needs no drafts): draft j is kept while every draft up to it was checked and is the token sampled
        before it."""
        d = self.shape.extra
        drafts = self.inputs[:, 3 : 3 + d]
        right = self.checked & (drafts == sampled[:, :d])
        return right.long().cumprod(1).sum(1)

    def _learned(self, hidden: torch.Tensor, mtp_out: torch.Tensor | None) -> None:
        """The learned routing head on the real rows' final hidden state (and link 1's MTP output, when it was
        trained with it): its guesses for every main MoE layer 1..lookahead steps ahead, confidence its sigmoid."""
        head = self.runner.learned_head
        assert head is not None
        ids, conf, soon = head.predict(hidden, mtp_out[:, 0] if head.config.use_mtp and mtp_out is not None else None)
        live = self.active.float()[:, None]
        for lead in range(1, self.shape.spec.lookahead + 1):
            if self.ring.local_ids is None:  # every layer in one write: 2 launches instead of 2 per layer
                self.ring.write(lead, self._learned_positions, ids[:, lead - 1], conf[:, lead - 1] * live[:, :, None])
                continue
            for p, layer in enumerate(head.config.layers):
                self.ring.write(lead, self.res.position[layer], ids[:, lead - 1, p], conf[:, lead - 1, p] * live)
        if self.res.local_of is None:  # the next step's victims by predicted reuse (one rank's keys are its own)
            soon = (soon * live[:, :, None]).amax(0)  # [L, E]: an expert any live row may need
            self.res.st.reuse.index_copy_(0, self._learned_keys, soon.reshape(-1))

    def _mtp_link(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                  chained: bool) -> torch.Tensor:
        """One pass of the MTP block over rows at `positions` [B, M] (its cache entry at position - 1) -> its
        output [B, M, H] before the head. A chained link (a draft's continuation) only steers prefetching: its
        experts are the ones in VRAM, and it reserves nothing."""
        mtp, args = self.weights.mtp, self.args
        rows = tokens.shape[1]
        x = mtp_input(args, mtp, self.runner.embed_mtp(tokens), hidden)
        kv = self.caches.mtp

        def attend(_: int, normed: torch.Tensor) -> torch.Tensor:
            return self.ops.attend_decode(mtp.layer.attn, normed, positions, kv, positions - 1)

        def routed(layer: int, flat: list[torch.Tensor], routings: list[Routing]) -> list[torch.Tensor]:
            act = self._mtp_rows_live(rows)
            ids, weights = routings[0].ids, routings[0].weights
            if not self.shape.draft_cached and not chained:
                out = self.res.decode_experts(layer, flat[0].contiguous(), ids, act, None, None, weights,
                                              self.buffers, self.shape.reserve, count_recall=False)
                return [out]
            # Drafts only steer prefetching and speculation (which verifies them), so the head may draft with the
            # experts already in VRAM: its rows ride as shadow rows, and it never moves an expert over the link
            # (on the reference model its own misses cost more bytes than all its predictions saved).
            none = ids[:0]
            return [self.res.decode_experts(layer, flat[0].contiguous(), none, act[:0], ids, act, weights,
                                            self.buffers, self.shape.reserve and not chained, count_recall=False)]

        return block(self.ops, mtp.layer, [x], attend, routed)[0]

    def _mtp_rows_live(self, rows: int) -> torch.Tensor:
        """[B * rows] which MTP rows are live: a verify step's row after draft j follows that draft, so it is live
        only where the draft was checked (an unchecked one reads no expert and steers no prefetch)."""
        if rows > 1 and self.checked is not None:
            return torch.cat((self.active[:, None], self.checked), 1).reshape(-1)
        return self.active.repeat_interleave(rows)

    def _route_ahead(self, x: torch.Tensor, lead: int, reach: torch.Tensor | None) -> None:
        """An MTP output [B, M, H] through every main router: guesses for the step `lead` ahead, their confidence
        scaled by `reach` [B] (the chained drafts' probability)."""
        rows = x.shape[1]
        flat = x.reshape(-1, x.shape[-1])
        live = self._mtp_rows_live(rows).float()[:, None]
        if reach is not None:
            live = live * reach.repeat_interleave(rows)[:, None]
        for lw in self.routers.values():
            if self.res.position[lw.index] >= self.res.cfg.main_positions:
                continue
            guess = self.ops.route(lw.router, self.ops.norm(flat, lw.post_attention_norm))
            self.ring.write(lead, self.res.position[lw.index], guess.ids, routing_confidence(guess.weights) * live)
