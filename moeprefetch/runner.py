"""Forward passes over blocks of new tokens: the uncached forward, prefill chunks and the MTP head over them.

The runner composes `model.py`'s blocks layer by layer and hands each MoE layer's routed experts to the
`ExpertRuntime`. Decode steps live in `decode.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .config import ModelArgs
from .experts import activation
from .model import LayerKV, attention_expanded, linear, mlp, rms_norm, route
from .rope import RotaryEmbedding
from .runtime import ExpertRuntime, RowBlock
from .weights import LayerWeights, ModelWeights

if TYPE_CHECKING:
    from .streaming import LayerStreamer


@dataclass
class KVCaches:
    """Compressed MLA caches of the main layers (and the MTP layer), [B, S_cap, ...] each."""

    layers: list[LayerKV]
    mtp: LayerKV | None
    capacity: int

    @staticmethod
    def allocate(
        args: ModelArgs, batch: int, capacity: int, dtype: torch.dtype, device: torch.device, with_mtp: bool
    ) -> "KVCaches":
        def one() -> LayerKV:
            # zeros, not empty: masked-out entries are multiplied by exact zeros, and garbage bits could be NaN
            return LayerKV(
                latent=torch.zeros(batch, capacity, args.kv_lora_rank, dtype=dtype, device=device),
                rope=torch.zeros(batch, capacity, args.qk_rope_head_dim, dtype=dtype, device=device),
            )

        return KVCaches([one() for _ in range(args.num_hidden_layers)], one() if with_mtp else None, capacity)

    @staticmethod
    def bytes_per_token(args: ModelArgs, dtype: torch.dtype, with_mtp: bool) -> int:
        per_layer = (args.kv_lora_rank + args.qk_rope_head_dim) * torch.tensor([], dtype=dtype).element_size()
        return per_layer * (args.num_hidden_layers + (1 if with_mtp else 0))


@dataclass
class DecodeOutput:
    logits: torch.Tensor  # [B, V] fp32, real rows
    hidden: torch.Tensor  # [B, H] final-normed hidden of the real rows (the MTP head's input)
    draft_logits: torch.Tensor | None  # [B, V] when drafts were verified
    draft_hidden: torch.Tensor | None  # [B, H]


class ModelRunner:
    def __init__(
        self,
        args: ModelArgs,
        weights: ModelWeights,
        runtime: ExpertRuntime,
        device: torch.device,
        streamer: "LayerStreamer | None" = None,
    ):
        self.args = args
        self.weights = weights
        self.runtime = runtime
        self.streamer = streamer
        self.device = device
        self.rope = RotaryEmbedding(args.rope, args.qk_rope_head_dim, device)
        self.act = activation(args.hidden_act)
        self._routers = {lw.index: lw.router for lw in weights.layers if lw.router is not None}
        if weights.mtp is not None:
            self._routers[weights.mtp.layer.index] = weights.mtp.layer.router

    # ---- pieces ---------------------------------------------------------------------------------------------------
    def score_layer(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Router selection scores of `layer` applied to `hidden` [N, H] (look-ahead predictors)."""
        return route(self.args, self._routers[layer], hidden.reshape(-1, hidden.shape[-1])).scores

    def logits(self, hidden_normed: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_normed, self.weights.lm_head).float()

    def _ffn(self, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        """The MLP half of a layer over h [N, H] (prefill / uncached: each expert on all of its tokens)."""
        if lw.mlp is not None:
            return mlp(lw.mlp, h, self.act)
        (routed,) = self.runtime.run_layer(lw.index, [RowBlock(h, route(self.args, lw.router, h))])
        if lw.shared is not None:
            routed = routed + mlp(lw.shared, h, self.act).float()
        return routed.to(h.dtype)

    # ---- blocks of new tokens (prefill chunks, uncached forward) ---------------------------------------------------
    def layer_block(
        self, lw: LayerWeights, x: torch.Tensor, positions: torch.Tensor, kv: LayerKV | None, row: int, start: int
    ) -> torch.Tensor:
        """One decoder layer over x [B, T, H] (expanded attention, per-expert MoE)."""
        eps = self.args.rms_norm_eps
        x = x + attention_expanded(
            self.args, lw.attn, self.rope, rms_norm(x, lw.input_norm, eps), positions, kv, row, start
        )
        h = rms_norm(x, lw.post_attention_norm, eps)
        b, t, hidden = h.shape
        out = self._ffn(lw, h.reshape(b * t, hidden))
        return x + out.view(b, t, hidden)

    def forward_block(
        self, tokens: torch.Tensor, positions: torch.Tensor, caches: KVCaches | None, row: int, start: int
    ) -> torch.Tensor:
        """Main layers over tokens [B, T] -> final-normed hidden [B, T, H]."""
        x = F.embedding(tokens, self.weights.embed)
        for lw in self.weights.layers:
            kv = caches.layers[lw.index] if caches is not None else None
            self.enter(lw.index)
            x = self.layer_block(lw, x, positions, kv, row, start)
            self.leave(lw.index)
        return rms_norm(x, self.weights.final_norm, self.args.rms_norm_eps)

    def enter(self, layer: int) -> None:
        """Before a layer's kernels: a streamed layer's weights must have landed."""
        if self.streamer is not None and self.streamer.streams(layer):
            self.streamer.begin(layer)

    def leave(self, layer: int) -> None:
        if self.streamer is not None and self.streamer.streams(layer):
            self.streamer.end(layer)

    def mtp_block(
        self,
        next_tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv: LayerKV | None,
        row: int,
        start: int,
    ) -> torch.Tensor:
        """MTP over pairs: next_tokens [B, T] (token i+1), hidden [B, T, H] (main final hidden at i), positions of
        token i+1 -> logits [B, T, V] predicting token i+2."""
        mtp = self.weights.mtp
        assert mtp is not None
        x = self._mtp_input(next_tokens, hidden)
        x = self.layer_block(mtp.layer, x, positions, kv, row, start)
        return self.mtp_logits(x)

    def _mtp_input(self, next_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        mtp = self.weights.mtp
        eps = self.args.rms_norm_eps
        embedded = F.embedding(next_tokens, self.weights.mtp_embed())
        # embedding first, then the hidden state: what vLLM, SGLang and transformers do with DeepSeek checkpoints
        return linear(torch.cat((rms_norm(embedded, mtp.enorm, eps), rms_norm(hidden, mtp.hnorm, eps)), -1), mtp.eh_proj)

    def mtp_logits(self, y: torch.Tensor) -> torch.Tensor:
        mtp = self.weights.mtp
        return F.linear(rms_norm(y, mtp.head_norm, self.args.rms_norm_eps), self.weights.mtp_head()).float()
