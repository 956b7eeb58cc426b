"""Forward passes over the whole model: uncached forward, prefill chunks, decode steps and the MTP head.

The runner composes `model.py`'s blocks layer by layer and hands each MoE layer's routed experts to the
`ExpertRuntime`. In a decode step the exact rows (real tokens) and the extra rows (MTP shadow rows for the `mtp`
predictor, or drafts being verified under speculative decoding) travel through the same layers in the same pass, but
in separate kernel calls: the real rows then have exactly the shapes they would have alone, so neither a predictor nor
speculation can change a single bit of their results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import ModelArgs
from .experts import activation
from .model import LayerKV, Routing, attention_absorbed, attention_expanded, linear, mlp, rms_norm, route
from .rope import RotaryEmbedding
from .runtime import ExpertRuntime, RowBlock
from .weights import LayerWeights, ModelWeights


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
    def __init__(self, args: ModelArgs, weights: ModelWeights, runtime: ExpertRuntime, device: torch.device):
        self.args = args
        self.weights = weights
        self.runtime = runtime
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

    def _ffn(
        self,
        lw: LayerWeights,
        h_exact: list[torch.Tensor],
        h_shadow: torch.Tensor | None,
        active: torch.Tensor | None,
        decode: bool,
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The MLP half of a layer for each exact block [N, H] and the optional shadow block."""
        if lw.mlp is not None:
            return [mlp(lw.mlp, h, self.act) for h in h_exact], (
                mlp(lw.mlp, h_shadow, self.act) if h_shadow is not None else None
            )
        blocks = [RowBlock(h, route(self.args, lw.router, h), active) for h in h_exact]
        shadow = RowBlock(h_shadow, route(self.args, lw.router, h_shadow), active) if h_shadow is not None else None
        routed, routed_shadow = self.runtime.run_layer(lw.index, blocks, shadow, decode=decode)
        outs = []
        for h, r in zip(h_exact, routed):
            total = r + mlp(lw.shared, h, self.act).float() if lw.shared is not None else r
            outs.append(total.to(h.dtype))
        out_shadow = None
        if h_shadow is not None:
            total = routed_shadow
            if lw.shared is not None:
                total = total + mlp(lw.shared, h_shadow, self.act).float()
            out_shadow = total.to(h_shadow.dtype)
        return outs, out_shadow

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
        (out,), _ = self._ffn(lw, [h.reshape(b * t, hidden)], None, None, decode=False)
        return x + out.view(b, t, hidden)

    def forward_block(
        self, tokens: torch.Tensor, positions: torch.Tensor, caches: KVCaches | None, row: int, start: int
    ) -> torch.Tensor:
        """Main layers over tokens [B, T] -> final-normed hidden [B, T, H]."""
        x = F.embedding(tokens, self.weights.embed)
        for lw in self.weights.layers:
            kv = caches.layers[lw.index] if caches is not None else None
            x = self.layer_block(lw, x, positions, kv, row, start)
        return rms_norm(x, self.weights.final_norm, self.args.rms_norm_eps)

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

    # ---- decode steps ---------------------------------------------------------------------------------------------
    def decode_step(
        self,
        caches: KVCaches,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        active: torch.Tensor,
        extra_tokens: torch.Tensor | None = None,
        extra_mode: str | None = None,
    ) -> DecodeOutput:
        """One token per sequence: tokens [B] at positions [B]; `active` [B] host bool.

        extra_tokens [B, L] ride along at positions +1..+L: `extra_mode="shadow"` runs them with resident experts
        only (MTP prediction; their results are discarded), `"verify"` (L == 1) runs them exactly, for speculative
        decoding, and returns their logits.
        """
        eps = self.args.rms_norm_eps
        b = tokens.shape[0]
        x = F.embedding(tokens[:, None], self.weights.embed)  # [B, 1, H]
        pos = positions[:, None]
        xe = pe = None
        if extra_tokens is not None:
            xe = F.embedding(extra_tokens, self.weights.embed)  # [B, L, H]
            pe = positions[:, None] + torch.arange(1, extra_tokens.shape[1] + 1, device=positions.device)
        verify = extra_mode == "verify"
        for lw in self.weights.layers:
            kv = caches.layers[lw.index]
            x = x + attention_absorbed(self.args, lw.attn, self.rope, rms_norm(x, lw.input_norm, eps), pos, kv)
            if xe is not None:
                xe = xe + attention_absorbed(self.args, lw.attn, self.rope, rms_norm(xe, lw.input_norm, eps), pe, kv)
            h = rms_norm(x, lw.post_attention_norm, eps).view(b, -1)
            he = rms_norm(xe, lw.post_attention_norm, eps).reshape(-1, xe.shape[-1]) if xe is not None else None
            if verify:
                outs, _ = self._ffn(lw, [h, he], None, active, decode=True)
                x = x + outs[0].view(b, 1, -1)
                xe = xe + outs[1].view(xe.shape)
            else:
                shadow_active = active.repeat_interleave(xe.shape[1]) if xe is not None else None
                outs, out_e = self._ffn_with_shadow(lw, h, he, active, shadow_active)
                x = x + outs.view(b, 1, -1)
                if xe is not None:
                    xe = xe + out_e.view(xe.shape)
        hidden = rms_norm(x[:, 0], self.weights.final_norm, eps)
        out = DecodeOutput(self.logits(hidden), hidden, None, None)
        if verify:
            draft_hidden = rms_norm(xe[:, 0], self.weights.final_norm, eps)
            out.draft_logits, out.draft_hidden = self.logits(draft_hidden), draft_hidden
        return out

    def _ffn_with_shadow(
        self,
        lw: LayerWeights,
        h: torch.Tensor,
        he: torch.Tensor | None,
        active: torch.Tensor,
        shadow_active: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if lw.mlp is not None:
            return mlp(lw.mlp, h, self.act), (mlp(lw.mlp, he, self.act) if he is not None else None)
        block = RowBlock(h, route(self.args, lw.router, h), active)
        shadow = RowBlock(he, route(self.args, lw.router, he), shadow_active) if he is not None else None
        (routed,), routed_shadow = self.runtime.run_layer(lw.index, [block], shadow, decode=True)
        if lw.shared is not None:
            routed = routed + mlp(lw.shared, h, self.act).float()
        out = routed.to(h.dtype)
        out_e = None
        if he is not None:
            if lw.shared is not None:
                routed_shadow = routed_shadow + mlp(lw.shared, he, self.act).float()
            out_e = routed_shadow.to(he.dtype)
        return out, out_e

    def mtp_decode(
        self,
        caches: KVCaches,
        next_tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        active: torch.Tensor,
    ) -> torch.Tensor:
        """MTP over M pairs per sequence: next_tokens [B, M] (token at `positions` [B, M]), hidden [B, M, H] (main
        final hidden one position earlier) -> logits [B, M, V]. Cache index = position - 1."""
        mtp = self.weights.mtp
        assert mtp is not None and caches.mtp is not None
        eps = self.args.rms_norm_eps
        lw = mtp.layer
        b, m = next_tokens.shape
        x = self._mtp_input(next_tokens, hidden)
        x = x + attention_absorbed(
            self.args, lw.attn, self.rope, rms_norm(x, lw.input_norm, eps), positions, caches.mtp, positions - 1
        )
        h = rms_norm(x, lw.post_attention_norm, eps).reshape(b * m, -1)
        outs, _ = self._ffn(lw, [h], None, active.repeat_interleave(m), decode=True)
        x = x + outs[0].view(b, m, -1)
        return self.mtp_logits(x)
