"""Teacher-forced routing records: per token, the final hidden state, the MTP head's output and every MoE layer's
top-k, from one uncached forward of the engine per window (what a learned predictor trains on, `predictor_training.py`).

The routing is the engine's own: the forward is `ModelRunner.forward_block`, as `MoEPrefetchEngine.forward` runs it,
with the runner's `LayerOps` swapped for one that also remembers what each router chose (nothing computed changes).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch

from .errors import RequestError
from .model import LayerOps, Routing, rms_norm, route

if TYPE_CHECKING:
    from .engine import MoEPrefetchEngine


@dataclass
class RoutingRecord:
    """Per token of the recorded windows (N tokens in all, windows one after another)."""

    hidden: torch.Tensor  # [N, H] the main model's final hidden state, after the final norm (what decode has)
    mtp_hidden: torch.Tensor | None  # [N, H] the MTP block's output from (hidden at t, token t+1); 0 at a window end
    ids: torch.Tensor  # [N, L, k] int64, each main MoE layer's top-k in router order
    window: torch.Tensor  # [N] int64, the window each token came from
    mtp_router: torch.Tensor | None  # [N, L, 2k] int64: the main routers on the MTP output, their top-k first

    @property
    def tokens(self) -> int:
        return self.ids.shape[0]


class _RecordingOps(LayerOps):
    """The engine's layer ops that also remember every router's choice, by router (a layer's routers are distinct
    objects), in call order."""

    def __init__(self, base: LayerOps):
        super().__init__(base.args, base.act, base.rope)
        self.chosen: dict[int, list[torch.Tensor]] = {}

    def route(self, router, h: torch.Tensor) -> Routing:
        routing = super().route(router, h)
        self.chosen.setdefault(id(router), []).append(routing.ids)
        return routing


@contextmanager
def _recording(engine: "MoEPrefetchEngine") -> Iterator[_RecordingOps]:
    """The runner's ops swapped for recording ones, and one residency call around the forward (as `forward` does)."""
    runner, res = engine.runner, engine.residency
    engine.check_idle()
    ops, original = _RecordingOps(runner.ops), runner.ops
    res.configure(policy=engine.options.policy, frequency_halflife=engine.options.lrfu_halflife)
    res.begin_call()
    runner.ops = ops
    try:
        yield ops
    finally:
        runner.ops = original
        res.end_call()


@torch.inference_mode()
def record_window(engine: "MoEPrefetchEngine", ids: list[int], with_mtp: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """One window of token ids -> (hidden [T, H], MTP output [T, H] or None, routing [T, L, k], MTP-router
    guesses [T, L, 2k] or None) on the CPU."""
    if len(ids) < 2:
        raise RequestError("a routing window needs at least 2 tokens")
    from .requests import as_batch_tensor

    tokens = as_batch_tensor([ids], engine.args, engine.device)
    positions = torch.arange(tokens.shape[1], device=engine.device)[None]
    layers = [lw for lw in engine.weights.layers if lw.router is not None]
    with _recording(engine) as ops:
        engine.residency.begin_step(decode=False)
        hidden = engine.runner.forward_block(tokens, positions, None, 0, 0)  # final-normed [1, T, H]
        mtp = None
        if with_mtp and engine.has_mtp:
            engine.residency.begin_step(decode=False)
            mtp = engine.runner.mtp_window([tokens[:, 1:]], [hidden[:, :-1]], [positions[:, 1:]], None, 0, [0])[0]
    routing = torch.stack([ops.chosen[id(lw.router)][0] for lw in layers], 1)  # [T, L, k]
    t = tokens.shape[1]
    if mtp is None:
        return hidden[0].float().cpu(), None, routing.cpu(), None
    mtp = torch.cat((mtp[0], torch.zeros_like(mtp[0, :1])))  # the window's last token has no next token
    guesses = []
    for lw in layers:  # the `mtp_router` predictor's guess: each main router on the MTP output (decode.py)
        guess = route(engine.args, lw.router, rms_norm(mtp, lw.post_attention_norm, engine.args.rms_norm_eps))
        # its top-k as the router selects them (group limits included) first, then the next best by score
        ranked = guess.scores.scatter(1, guess.ids, float("inf"))
        guesses.append(ranked.topk(min(2 * routing.shape[2], ranked.shape[1]), dim=-1).indices)
    assert mtp.shape[0] == t
    return hidden[0].float().cpu(), mtp.float().cpu(), routing.cpu(), torch.stack(guesses, 1).cpu()


def record_routing(engine: "MoEPrefetchEngine", token_ids: list[list[int]], with_mtp: bool = True,
                   progress: bool = False, dtype: torch.dtype = torch.float32) -> RoutingRecord:
    """Windows of token ids -> their `RoutingRecord` (hidden states stored as `dtype`: bfloat16 halves a large
    record's RAM)."""
    from tqdm.auto import tqdm

    if not token_ids:
        raise RequestError("record_routing needs at least one window of token ids")
    parts: list[tuple] = []
    for window in tqdm(token_ids, desc="recording routing", unit="window", disable=not progress, leave=False):
        h, m, r, g = record_window(engine, list(window), with_mtp)
        parts.append((h.to(dtype), None if m is None else m.to(dtype), r, g))
    windows = torch.cat([torch.full((p[2].shape[0],), i, dtype=torch.long) for i, p in enumerate(parts)])
    has_mtp = parts[0][1] is not None
    return RoutingRecord(hidden=torch.cat([p[0] for p in parts]),
                         mtp_hidden=torch.cat([p[1] for p in parts]) if has_mtp else None,
                         ids=torch.cat([p[2] for p in parts]), window=windows,
                         mtp_router=torch.cat([p[3] for p in parts]) if has_mtp else None)
