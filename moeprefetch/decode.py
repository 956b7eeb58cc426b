"""Decode steps as static-buffer segments, replayed as CUDA graphs on the GPU.

A step is cut at every MoE layer's router. Segment j computes the experts of MoE layer m(j-1) from slot ids that
the host planned, then everything up to and including the router of MoE layer m(j). Between two segments the host
hook plans layer m(j): it reads the routing (the step's one synchronisation per MoE layer), fetches misses, pumps
prefetches and writes the slot ids. When every expert is resident no hook is needed: slot ids are derived on the
device and the whole step is a single segment — a single graph.

All tensors that cross a segment boundary live in `StepBuffers`, allocated once per (batch, extra rows, mode), so a
captured graph can be replayed step after step. On the CPU the same segments simply run eagerly.

Extra rows ride along with the real ones in separate kernel calls (so the real rows' shapes never change):
`shadow` rows carry the MTP draft with resident experts only (the `mtp` predictor), `verify` rows carry the draft
exactly (speculative decoding).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .model import attention_absorbed, mlp, rms_norm, route
from .runner import DecodeOutput, KVCaches, ModelRunner
from .weights import LayerWeights

logger = logging.getLogger(__name__)

MODES = ("none", "shadow", "verify")


class GraphRunner:
    """Runs segment callables eagerly, or captures each as a CUDA graph on its second use and replays it.

    The first use runs eagerly: it is a real step (its results count) and it warms up cuBLAS and the allocator, which
    capture requires. Capture itself executes nothing, so a freshly captured graph is replayed at once."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and torch.cuda.is_available()
        self._graphs: dict[object, torch.cuda.CUDAGraph] = {}
        self._seen: set[object] = set()
        self._pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.failed = False

    def clear(self) -> None:
        """Drop every captured graph (their buffers are about to be freed)."""
        self._graphs.clear()
        self._seen.clear()

    def run(self, key: object, fn: Callable[[], None]) -> None:
        if not self.enabled or self.failed:
            fn()
            return
        graph = self._graphs.get(key)
        if graph is None:
            if key not in self._seen:
                self._seen.add(key)
                fn()
                return
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self._pool):
                    fn()
            except Exception as exc:  # capture is an optimisation; eager execution stays correct
                logger.warning("CUDA graph capture failed (%s); continuing without graphs", exc)
                self.failed = True
                torch.cuda.synchronize()
                fn()
                return
            self._graphs[key] = graph
        graph.replay()

    @property
    def captured(self) -> int:
        return len(self._graphs)


@dataclass
class StepBuffers:
    tokens: torch.Tensor  # [B] next input token per sequence
    positions: torch.Tensor  # [B]
    active: torch.Tensor  # [B] bool
    extra_tokens: torch.Tensor | None  # [B, L]
    x: torch.Tensor  # [B, 1, H] residual stream of the real rows
    xe: torch.Tensor | None  # [B, L, H] residual stream of the extra rows
    h: dict[int, torch.Tensor]  # layer -> [B, H] router input (post-attention norm)
    he: dict[int, torch.Tensor]  # layer -> [B*L, H]
    ids: dict[int, torch.Tensor]  # layer -> [B, k]
    weights: dict[int, torch.Tensor]  # layer -> [B, k] fp32
    scores: dict[int, torch.Tensor]  # layer -> [B, E] fp32 (only when a predictor ranks by them)
    ids_e: dict[int, torch.Tensor]
    weights_e: dict[int, torch.Tensor]
    scores_e: dict[int, torch.Tensor]
    slots: dict[int, torch.Tensor]  # layer -> [B, k] slot of each (row, k) entry
    valid: dict[int, torch.Tensor]  # layer -> [B, k] bool
    slots_e: dict[int, torch.Tensor]
    valid_e: dict[int, torch.Tensor]
    logits: torch.Tensor  # [B, V] fp32
    hidden: torch.Tensor  # [B, H]
    draft_logits: torch.Tensor | None
    draft_hidden: torch.Tensor | None


def _buffers(runner: ModelRunner, layers: list[LayerWeights], batch: int, extra: int, dtype: torch.dtype) -> StepBuffers:
    args, dev = runner.args, runner.device
    h, k, e, v = args.hidden_size, args.num_experts_per_tok, args.n_routed_experts, args.vocab_size
    rows_e = batch * extra

    def per_layer(shape: tuple[int, ...], kind: torch.dtype, when: bool = True) -> dict[int, torch.Tensor]:
        if not when:
            return {}
        return {lw.index: torch.zeros(shape, dtype=kind, device=dev) for lw in layers if lw.router is not None}

    return StepBuffers(
        tokens=torch.zeros(batch, dtype=torch.long, device=dev),
        positions=torch.zeros(batch, dtype=torch.long, device=dev),
        active=torch.zeros(batch, dtype=torch.bool, device=dev),
        extra_tokens=torch.zeros(batch, extra, dtype=torch.long, device=dev) if extra else None,
        x=torch.zeros(batch, 1, h, dtype=dtype, device=dev),
        xe=torch.zeros(batch, extra, h, dtype=dtype, device=dev) if extra else None,
        h=per_layer((batch, h), dtype),
        he=per_layer((rows_e, h), dtype, bool(extra)),
        ids=per_layer((batch, k), torch.long),
        weights=per_layer((batch, k), torch.float32),
        scores=per_layer((batch, e), torch.float32),
        ids_e=per_layer((rows_e, k), torch.long, bool(extra)),
        weights_e=per_layer((rows_e, k), torch.float32, bool(extra)),
        scores_e=per_layer((rows_e, e), torch.float32, bool(extra)),
        slots=per_layer((batch, k), torch.long),
        valid=per_layer((batch, k), torch.bool),
        slots_e=per_layer((rows_e, k), torch.long, bool(extra)),
        valid_e=per_layer((rows_e, k), torch.bool, bool(extra)),
        logits=torch.zeros(batch, v, dtype=torch.float32, device=dev),
        hidden=torch.zeros(batch, h, dtype=dtype, device=dev),
        draft_logits=torch.zeros(batch, v, dtype=torch.float32, device=dev) if extra else None,
        draft_hidden=torch.zeros(batch, h, dtype=dtype, device=dev) if extra else None,
    )


_STEP_IDS = itertools.count()  # graph keys must never be reused while a graph with that key exists


class _Segments:
    """Shared machinery: building segments, running them with hooks, computing experts from slot buffers."""

    def __init__(self, runner: ModelRunner, graphs: GraphRunner, key: object):
        key = (key, next(_STEP_IDS))
        self.runner = runner
        self.runtime = runner.runtime
        self.args = runner.args
        self.eps = runner.args.rms_norm_eps
        self.graphs = graphs
        self.key = key
        self.preloaded = runner.runtime.preloaded
        self.segments: list[tuple[Callable[[], None], int | None]] = []

    def _run_segments(self, hook: Callable[[int], None]) -> None:
        for index, (fn, hook_layer) in enumerate(self.segments):
            self.graphs.run((self.key, index), fn)
            if hook_layer is not None:
                hook(hook_layer)
        self.runtime.release_layer()

    def _build(self, ops: list[tuple[Callable[[], None], int | None]]) -> None:
        """Group ops into segments ending at each hook point; with every expert resident, one segment."""
        current: list[Callable[[], None]] = []
        for op, hook_layer in ops:
            current.append(op)
            if hook_layer is not None and not self.preloaded:
                self.segments.append((_chain(current), hook_layer))
                current = []
        self.segments.append((_chain(current), None))

    def _routed(self, x: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.runtime.compute_gathered(x, slots, valid, weights)

    def _ffn_out(self, lw: LayerWeights, h: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        if lw.shared is not None:
            routed = routed + mlp(lw.shared, h, self.runner.act).float()
        return routed.to(h.dtype)

    def _device_slots(self, layer: int, ids: torch.Tensor, active: torch.Tensor, slots: torch.Tensor,
                      valid: torch.Tensor) -> None:
        """All-resident: expert e of `layer` sits in slot base + e, always."""
        slots.copy_(ids + self.runtime.preloaded_base(layer))
        valid.copy_(active[:, None].expand_as(valid))


def _chain(ops: list[Callable[[], None]]) -> Callable[[], None]:
    def run() -> None:
        for op in ops:
            op()

    return run


class DecodeStep(_Segments):
    """One decode step of the main layers for `batch` sequences (+ `extra` rows each, in `mode`)."""

    def __init__(
        self,
        runner: ModelRunner,
        caches: KVCaches,
        batch: int,
        extra: int,
        mode: str,
        graphs: GraphRunner,
        gate_targets: dict[int, list[int]] | None = None,
        gate_width: int = 0,
    ):
        assert mode in MODES and (mode == "none") == (extra == 0)
        super().__init__(runner, graphs, ("decode", batch, extra, mode))
        self.caches = caches
        self.batch, self.extra, self.mode = batch, extra, mode
        self.layers = runner.weights.layers
        self.buf = _buffers(runner, self.layers, batch, extra, caches.layers[0].latent.dtype)
        # next_layer_gate: layer -> the MoE layers whose routers score this layer's router input, inside the graph
        self.gate_targets = gate_targets or {}
        self.gate_width = min(gate_width, runner.args.n_routed_experts)
        self.gate_ids = {
            layer: torch.zeros(len(targets), batch, self.gate_width, dtype=torch.long, device=runner.device)
            for layer, targets in self.gate_targets.items() if targets and self.gate_width
        }
        self._routers = {lw.index: lw.router for lw in self.layers if lw.router is not None}
        ops: list[tuple[Callable[[], None], int | None]] = [(self._embed, None)]
        for lw in self.layers:
            ops.append((lambda lw=lw: runner.enter(lw.index), None))  # streamed layers: weights land first
            ops.append((lambda lw=lw: self._attention(lw), None))
            if lw.router is None:
                ops.append((lambda lw=lw: self._dense(lw), None))
            else:
                ops.append((lambda lw=lw: self._route(lw), lw.index))
                ops.append((lambda lw=lw: self._experts(lw), None))
            ops.append((lambda lw=lw: runner.leave(lw.index), None))
        ops.append((self._head, None))
        self._build(ops)
        self._active_host = torch.zeros(batch, dtype=torch.bool)

    # ---- segment ops (device only: capturable) --------------------------------------------------------------------
    def _embed(self) -> None:
        b = self.buf
        b.x.copy_(F.embedding(b.tokens[:, None], self.runner.weights.embed))
        if b.xe is not None:
            b.xe.copy_(F.embedding(b.extra_tokens, self.runner.weights.embed))

    def _attention(self, lw: LayerWeights) -> None:
        b, args, rope = self.buf, self.args, self.runner.rope
        kv = self.caches.layers[lw.index]
        pos = b.positions[:, None]
        b.x.add_(attention_absorbed(args, lw.attn, rope, rms_norm(b.x, lw.input_norm, self.eps), pos, kv))
        if b.xe is not None:
            pos_e = pos + torch.arange(1, self.extra + 1, device=pos.device)
            b.xe.add_(attention_absorbed(args, lw.attn, rope, rms_norm(b.xe, lw.input_norm, self.eps), pos_e, kv))

    def _dense(self, lw: LayerWeights) -> None:
        b, act = self.buf, self.runner.act
        b.x.add_(mlp(lw.mlp, rms_norm(b.x, lw.post_attention_norm, self.eps), act))
        if b.xe is not None:
            b.xe.add_(mlp(lw.mlp, rms_norm(b.xe, lw.post_attention_norm, self.eps), act))

    def _route(self, lw: LayerWeights) -> None:
        b, layer = self.buf, lw.index
        h = rms_norm(b.x, lw.post_attention_norm, self.eps).view(self.batch, -1)
        b.h[layer].copy_(h)
        r = route(self.args, lw.router, h)
        b.ids[layer].copy_(r.ids)
        b.weights[layer].copy_(r.weights)
        b.scores[layer].copy_(r.scores)
        if layer in self.gate_ids:
            for i, target in enumerate(self.gate_targets[layer]):
                scores = route(self.args, self._routers[target], h).scores
                self.gate_ids[layer][i].copy_(scores.topk(self.gate_width, dim=-1).indices)
        if b.xe is not None:
            he = rms_norm(b.xe, lw.post_attention_norm, self.eps).reshape(self.batch * self.extra, -1)
            b.he[layer].copy_(he)
            re = route(self.args, lw.router, he)
            b.ids_e[layer].copy_(re.ids)
            b.weights_e[layer].copy_(re.weights)
            b.scores_e[layer].copy_(re.scores)
        if self.preloaded:
            self._device_slots(layer, b.ids[layer], b.active, b.slots[layer], b.valid[layer])
            if b.xe is not None:
                active_e = b.active.repeat_interleave(self.extra)
                self._device_slots(layer, b.ids_e[layer], active_e, b.slots_e[layer], b.valid_e[layer])

    def _experts(self, lw: LayerWeights) -> None:
        b, layer = self.buf, lw.index
        h = b.h[layer]
        routed = self._routed(h, b.slots[layer], b.valid[layer], b.weights[layer])
        b.x.add_(self._ffn_out(lw, h, routed).view_as(b.x))
        if b.xe is not None:
            he, weights = b.he[layer], b.weights_e[layer]
            if self.mode == "shadow":
                weights = _renormalise(weights, b.valid_e[layer])
            routed_e = self._routed(he, b.slots_e[layer], b.valid_e[layer], weights)
            b.xe.add_(self._ffn_out(lw, he, routed_e).view_as(b.xe))

    def _head(self) -> None:
        b, runner = self.buf, self.runner
        hidden = rms_norm(b.x[:, 0], runner.weights.final_norm, self.eps)
        b.hidden.copy_(hidden)
        b.logits.copy_(runner.logits(hidden))
        if self.mode == "verify":
            draft_hidden = rms_norm(b.xe[:, 0], runner.weights.final_norm, self.eps)
            b.draft_hidden.copy_(draft_hidden)
            b.draft_logits.copy_(runner.logits(draft_hidden))

    # ---- host side ------------------------------------------------------------------------------------------------
    def _hook(self, layer: int) -> None:
        b, runtime = self.buf, self.runtime
        ids = b.ids[layer].cpu().tolist()  # the per-layer synchronisation: which experts does this layer need?
        exact = [(ids, self._active_host)]
        shadow = None
        if self.mode == "verify":
            exact.append((b.ids_e[layer].cpu().tolist(), self._active_extra))
        elif self.mode == "shadow":
            shadow = (b.ids_e[layer].cpu().tolist(), self._active_extra, b.scores_e[layer].cpu())
        real_scores = b.scores[layer].cpu() if runtime.predictor_wants_scores else None
        gate_ranked = None
        if layer in self.gate_ids:
            ranked = self.gate_ids[layer].cpu().tolist()  # [targets][B][width]
            live = [r for r, active in enumerate(self._active_host) if active]  # finished rows predict nothing
            gate_ranked = {t: rank_merge([rows[r] for r in live]) for t, rows in zip(self.gate_targets[layer], ranked)}
        plans, shadow_plan = runtime.decode_layer(layer, exact, shadow, b.h[layer], real_scores, gate_ranked)
        _upload(plans[0], b.slots[layer], b.valid[layer])
        if self.mode == "verify":
            _upload(plans[1], b.slots_e[layer], b.valid_e[layer])
        elif shadow_plan is not None:
            _upload(shadow_plan, b.slots_e[layer], b.valid_e[layer])

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        active: torch.Tensor,
        extra_tokens: torch.Tensor | None = None,
    ) -> DecodeOutput:
        """tokens [B], positions [B] and active [B] (host tensors); extra_tokens [B, L] when the step has extra rows."""
        b = self.buf
        self._active_host = active.tolist()
        self._active_extra = active.repeat_interleave(self.extra).tolist() if self.extra else self._active_host
        b.tokens.copy_(tokens, non_blocking=True)
        b.positions.copy_(positions, non_blocking=True)
        b.active.copy_(active, non_blocking=True)
        if self.extra:
            b.extra_tokens.copy_(extra_tokens, non_blocking=True)
        self._run_segments(self._hook)
        if self.preloaded:
            self.runtime.record_resident_step({layer: ids.cpu().tolist() for layer, ids in b.ids.items()}, self._active_host)
        out = DecodeOutput(b.logits.clone(), b.hidden.clone(), None, None)
        if self.mode == "verify":
            out.draft_logits, out.draft_hidden = b.draft_logits.clone(), b.draft_hidden.clone()
        return out


class MTPStep(_Segments):
    """The MTP head over `rows` (token, hidden) pairs per sequence: draft logits for the token after each pair."""

    def __init__(
        self, runner: ModelRunner, caches: KVCaches, batch: int, rows: int, graphs: GraphRunner, router_width: int = 0
    ):
        super().__init__(runner, graphs, ("mtp", batch, rows))
        mtp = runner.weights.mtp
        assert mtp is not None and caches.mtp is not None
        self.caches, self.batch, self.rows = caches, batch, rows
        self.lw = mtp.layer
        args, dev = runner.args, runner.device
        dtype = caches.mtp.latent.dtype
        n, h, k = batch * rows, args.hidden_size, args.num_experts_per_tok
        self.tokens = torch.zeros(batch, rows, dtype=torch.long, device=dev)
        self.hidden_in = torch.zeros(batch, rows, h, dtype=dtype, device=dev)
        self.positions = torch.zeros(batch, rows, dtype=torch.long, device=dev)
        self.active = torch.zeros(n, dtype=torch.bool, device=dev)
        self.x = torch.zeros(batch, rows, h, dtype=dtype, device=dev)
        self.h = torch.zeros(n, h, dtype=dtype, device=dev)
        self.ids = torch.zeros(n, k, dtype=torch.long, device=dev)
        self.weights = torch.zeros(n, k, dtype=torch.float32, device=dev)
        self.slots = torch.zeros(n, k, dtype=torch.long, device=dev)
        self.valid = torch.zeros(n, k, dtype=torch.bool, device=dev)
        self.logits = torch.zeros(batch, rows, args.vocab_size, dtype=torch.float32, device=dev)
        # mtp_router: every main MoE layer's router on the MTP output -> top-`router_width` experts per layer
        self.router_layers = [lw for lw in runner.weights.layers if lw.router is not None] if router_width else []
        self.router_width = min(router_width, args.n_routed_experts)
        self.router_ids = torch.zeros(len(self.router_layers), n, max(self.router_width, 1), dtype=torch.long,
                                      device=dev)
        self._build([(self._front, self.lw.index), (self._back, None)])
        self._active_host = torch.zeros(n, dtype=torch.bool)

    def _front(self) -> None:
        runner, lw = self.runner, self.lw
        x = runner._mtp_input(self.tokens, self.hidden_in)
        x = x + attention_absorbed(
            self.args, lw.attn, runner.rope, rms_norm(x, lw.input_norm, self.eps), self.positions, self.caches.mtp,
            self.positions - 1,
        )
        self.x.copy_(x)
        h = rms_norm(x, lw.post_attention_norm, self.eps).reshape(self.batch * self.rows, -1)
        self.h.copy_(h)
        r = route(self.args, lw.router, h)
        self.ids.copy_(r.ids)
        self.weights.copy_(r.weights)
        if self.preloaded:
            self._device_slots(lw.index, self.ids, self.active, self.slots, self.valid)

    def _back(self) -> None:
        routed = self._routed(self.h, self.slots, self.valid, self.weights)
        self.x.add_(self._ffn_out(self.lw, self.h, routed).view_as(self.x))
        self.logits.copy_(self.runner.mtp_logits(self.x))
        flat = self.x.reshape(self.batch * self.rows, -1)
        for i, lw in enumerate(self.router_layers):
            scores = route(self.args, lw.router, rms_norm(flat, lw.post_attention_norm, self.eps)).scores
            self.router_ids[i].copy_(scores.topk(self.router_width, dim=-1).indices)

    def _hook(self, layer: int) -> None:
        plans, _ = self.runtime.decode_layer(layer, [(self.ids.cpu().tolist(), self._active_host)], None, self.h, None)
        _upload(plans[0], self.slots, self.valid)

    def __call__(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, active: torch.Tensor
    ) -> torch.Tensor:
        """tokens [B, M] (host), hidden [B, M, H] (device), positions [B, M] (host), active [B] (host) ->
        logits [B, M, V]."""
        active_rows = active.repeat_interleave(self.rows)
        self._active_host = active_rows.tolist()
        self.tokens.copy_(tokens, non_blocking=True)
        self.hidden_in.copy_(hidden)
        self.positions.copy_(positions, non_blocking=True)
        self.active.copy_(active_rows, non_blocking=True)
        self._run_segments(self._hook)
        if self.preloaded:
            self.runtime.record_resident_step({self.lw.index: self.ids.cpu().tolist()}, self._active_host)
        if self.router_layers:
            ranked = self.router_ids.cpu().tolist()  # [layers][rows][width]
            keep = [r for r, a in enumerate(self._active_host) if a]
            self.runtime.observe_mtp_output(
                {lw.index: rank_merge([ranked[i][r] for r in keep]) for i, lw in enumerate(self.router_layers)}
            )
        return self.logits.clone()


def rank_merge(rows: list[list[int]]) -> tuple[int, ...]:
    """Rows' ranked expert lists merged by rank: every row's first choice, then every row's second, ..."""
    merged: dict[int, None] = {}
    for rank in range(max((len(r) for r in rows), default=0)):
        for row in rows:
            if rank < len(row):
                merged.setdefault(row[rank], None)
    return tuple(merged)


def _renormalise(weights: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Shadow rows skip missing experts: rescale the kept weights to the full weight mass, at most k-fold (a lone
    low-weight expert must not be blown up into values that overflow fp16)."""
    kept = torch.where(valid, weights, torch.zeros_like(weights)).sum(-1, keepdim=True)
    total = weights.sum(-1, keepdim=True)
    scale = torch.where(kept > 0, total / kept.clamp(min=1e-20), torch.zeros_like(kept))
    return weights * scale.clamp(max=float(weights.shape[-1]))


def _upload(plan: tuple[list[list[int]], list[list[bool]]], slots: torch.Tensor, valid: torch.Tensor) -> None:
    """Host plan -> device slot buffers, in stream order before the segment that reads them."""
    slots.copy_(torch.tensor(plan[0], dtype=torch.long).pin_memory() if slots.is_cuda else torch.tensor(plan[0]),
                non_blocking=True)
    valid.copy_(torch.tensor(plan[1], dtype=torch.bool), non_blocking=slots.is_cuda)
