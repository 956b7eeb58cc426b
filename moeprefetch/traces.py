"""Routing traces on disk: which experts every MoE layer chose for each decode token.

The format is the one of the real traces in `../shared/traces` (recorded from DeepSeek-V2-Lite and OLMoE with a
llama.cpp collector): a JSON Lines file, one line per generated token, each line an array of `[layer, expert]` pairs
in layer order, a layer's top-k in router order. There are no router weights, token ids or hidden states.

A `DecodeTrace` is such a file as a tensor `[tokens, MoE layers, k]`. Replays (`replay.py`) run the residency's own
victim code over it; `routing_trace=` (benchmarks only) forces a model's routing to follow it, so a random-weight
checkpoint of a real shape sees the cache behaviour of real routing. `write_trace` writes a generation's routing in
the same format (`moeprefetch replay` reads what the engine records).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .errors import RequestError

if TYPE_CHECKING:
    from .kernels.router import RouterShape


class TraceError(RequestError):
    """A routing trace file is missing, malformed or does not fit the model it is used with."""


@dataclass(frozen=True)
class DecodeTrace:
    layers: tuple[int, ...]  # the MoE layer ids as the file names them, in order
    experts: torch.Tensor  # [tokens, len(layers), k] int64, each layer's top-k in router order
    n_experts: int
    source: str = ""

    @property
    def tokens(self) -> int:
        return self.experts.shape[0]

    @property
    def top_k(self) -> int:
        return self.experts.shape[2]

    def needed(self) -> torch.Tensor:
        """[tokens, layers, n_experts] uint8: 1 where a token's layer uses the expert (the oracle's trace layout)."""
        out = torch.zeros(self.tokens, len(self.layers), self.n_experts, dtype=torch.uint8)
        out.scatter_(2, self.experts, 1)
        return out

    def steps(self) -> list[list[tuple[int, int]]]:
        """Per token, its distinct (MoE position, expert) keys in execution order (layer by layer, router order)."""
        rows = self.experts.tolist()
        return [list(dict.fromkeys((p, e) for p, chosen in enumerate(token) for e in chosen)) for token in rows]

    def head(self, tokens: int) -> "DecodeTrace":
        return DecodeTrace(self.layers, self.experts[:tokens], self.n_experts, self.source)


MAX_EXPERTS = 1 << 16  # experts per layer a trace may name (DeepSeek-V3 has 256, the largest MoE models ~512)


def load_trace(path: str | Path, n_experts: int | None = None) -> DecodeTrace:
    """Read a trace file; `n_experts` (default: the largest id + 1) bounds the expert ids."""
    if n_experts is not None and not 1 <= n_experts <= MAX_EXPERTS:
        raise TraceError(f"the experts per layer must be from 1 to {MAX_EXPERTS}, got {n_experts}")
    path = Path(path).expanduser()
    if not path.is_file():
        raise TraceError(f"routing trace {path} is not a file")
    tokens: list[list[list[int]]] = []
    layers: list[int] | None = None
    try:
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                layers = _read_line(path, number, line, layers, tokens)
    except UnicodeDecodeError as exc:
        raise TraceError(f"routing trace {path} is not UTF-8 text (byte {exc.start} of a block): a trace is JSON "
                         f"lines") from None
    if not tokens or layers is None:
        raise TraceError(f"routing trace {path} holds no tokens")
    experts = torch.tensor(tokens, dtype=torch.int64)
    largest = int(experts.max())
    if int(experts.min()) < 0:
        raise TraceError(f"{path} names a negative expert id")
    if largest >= MAX_EXPERTS:  # the replay's tables are layers x experts: an id like this is a broken trace
        raise TraceError(f"{path} names expert {largest}; a layer has at most {MAX_EXPERTS} experts here")
    if n_experts is None:
        n_experts = largest + 1
    elif largest >= n_experts:
        raise TraceError(f"{path} names expert {largest}, but the layers have {n_experts} experts")
    return DecodeTrace(tuple(layers), experts, n_experts, str(path))


def _read_line(path: Path, number: int, line: str, layers: list[int] | None, tokens: list) -> list[int] | None:
    """One line of a trace appended to `tokens` (a blank one skipped) -> the layers every line must route."""
    if not line.strip():
        return layers
    token_layers, chosen = _parse_line(path, number, line)
    if layers is None:
        layers = token_layers
    elif token_layers != layers:
        raise TraceError(f"{path} line {number} routes layers {_span(token_layers)}, but line 1 routes "
                         f"{_span(layers)}: every token must route the same MoE layers")
    if any(len(c) != len(chosen[0]) for c in chosen) or (tokens and len(chosen[0]) != len(tokens[0][0])):
        raise TraceError(f"{path} line {number} does not choose the same number of experts in every layer")
    tokens.append(chosen)
    return layers


def _parse_line(path: Path, number: int, line: str) -> tuple[list[int], list[list[int]]]:
    """One token's line -> (its layers in order, each layer's experts)."""
    try:
        pairs = json.loads(line)
    except json.JSONDecodeError:
        raise TraceError(f"{path} line {number} is not JSON: each line must be an array of [layer, expert] pairs") \
            from None
    if not isinstance(pairs, list) or not pairs or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in p)
            for p in pairs):
        raise TraceError(f"{path} line {number} must be a non-empty array of [layer, expert] integer pairs")
    layers: list[int] = []
    chosen: list[list[int]] = []
    for layer, expert in pairs:
        if not layers or layer != layers[-1]:
            if layer in layers:
                raise TraceError(f"{path} line {number} routes layer {layer} in two places: pairs must come in layer "
                                 f"order")
            layers.append(layer)
            chosen.append([])
        chosen[-1].append(expert)
    if any(len(set(c)) != len(c) for c in chosen):
        raise TraceError(f"{path} line {number} chooses an expert twice in one layer")
    return layers, chosen


def _span(layers: list[int]) -> str:
    return f"{layers[0]}..{layers[-1]} ({len(layers)} layers)"


def write_trace(path: str | Path, layers: list[int] | tuple[int, ...], experts: torch.Tensor) -> None:
    """experts [tokens, len(layers), k] -> a trace file in the format `load_trace` reads."""
    with Path(path).open("w") as handle:
        for token in experts.tolist():
            handle.write(json.dumps([[layer, e] for layer, chosen in zip(layers, token) for e in chosen]) + "\n")


class ForcedRouting:
    """`routing_trace=` (benchmarks only): each main MoE layer of a decode step takes its experts from a trace
    instead of its router's top-k, with the router's own combination weights for those experts. Row b of a batch
    reads token (decode step + b * tokens / batch) of the trace, wrapping, so the rows of a batch differ. Prefill
    and the MTP layer route as the model does (the traces hold decode tokens of main layers only)."""

    def __init__(self, trace: DecodeTrace, shape: "RouterShape", device: torch.device):
        self.trace, self.shape = trace, shape
        self.ids = trace.experts.to(device)  # [T, P, k]

    @staticmethod
    def load(path: str | Path, main_layers: int, n_experts: int, top_k: int, shape: "RouterShape",
             device: torch.device) -> "ForcedRouting":
        trace = load_trace(path, n_experts)
        if len(trace.layers) != main_layers or trace.top_k != top_k:
            raise TraceError(f"routing trace {path} routes {len(trace.layers)} MoE layers top-{trace.top_k}, but the "
                             f"model has {main_layers} main MoE layers top-{top_k}")
        return ForcedRouting(trace, shape, device)

    def route(self, position: int, logits: torch.Tensor, decode_step: torch.Tensor) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
        """The forced (ids [B, k], weights [B, k]) of main MoE position `position` for a decode step's rows, from the
        router's fp32 logits [B, E] and the step's index ([1] on the device; device ops only, capturable)."""
        from .kernels.router import combine_weights_reference, router_scores

        rows, tokens = logits.shape[0], self.ids.shape[0]
        token = (decode_step.clamp(min=0) + torch.arange(rows, device=logits.device) * (tokens // rows)) % tokens
        ids = self.ids[:, position].index_select(0, token)  # [B, k]
        return ids, combine_weights_reference(self.shape, router_scores(self.shape, logits), ids)


def trace_from_needed(needed: torch.Tensor, layers: list[int] | tuple[int, ...]) -> torch.Tensor:
    """The oracle's recorded layout [tokens, P, E] (1 = used) -> [tokens, P, k] expert ids in ascending order (the
    recording keeps no router order). Every (token, layer) must use the same number of experts."""
    counts = needed.sum(-1)
    if needed.numel() and not bool((counts == counts.flatten()[0]).all()):
        raise TraceError("the recorded routing uses a different number of experts at some (token, layer): record a "
                         "batch of one sequence")
    k = int(counts.flatten()[0]) if needed.numel() else 0
    return (needed > 0).nonzero()[:, 2].reshape(needed.shape[0], len(layers), k)


__all__ = ["DecodeTrace", "ForcedRouting", "TraceError", "load_trace", "trace_from_needed", "write_trace"]
