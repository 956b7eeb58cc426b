"""Forward passes over blocks of new tokens: the uncached forward, prefill chunks and the MTP head over them.

Every layer is `model.block()`; blocks of tokens attend with expanded keys and compute each routed expert on all of
its tokens through `Residency.prefill_experts`. A prompt's chunks run in windows, layer by layer, so an offloaded
expert crosses once per window (see residency/prefill.py). Decode steps live in `decode.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .config import ModelArgs
from .expert_records import activation
from .kernels import INTERPRET, kernels_usable
from .kernels.gather import HostRows
from .layer_ops import FusedOps
from .model import GQAKV, LayerKV, LayerOps, Routing, attention_block, block, mtp_input, rms_norm
from .residency import Residency
from .rope import RotaryEmbedding
from .store import pin_in_place
from .weights import LayerWeights, ModelWeights

if TYPE_CHECKING:
    from .learned_predictor import HeadConfig, RoutingHead
    from .streaming import LayerStreamer
    from .traces import ForcedRouting


@dataclass
class KVCaches:
    """Caches of the main layers (and the MTP layer), [B, S_cap, ...] each: compressed MLA latents, or GQA keys and
    values."""

    layers: list[LayerKV | GQAKV]
    mtp: LayerKV | GQAKV | None
    capacity: int

    @staticmethod
    def allocate(
        args: ModelArgs, batch: int, capacity: int, dtype: torch.dtype, device: torch.device, with_mtp: bool
    ) -> "KVCaches":
        def zeros(*shape: int) -> torch.Tensor:
            # zeros, not empty: masked-out entries are multiplied by exact zeros, and garbage bits could be NaN
            return torch.zeros(batch, capacity, *shape, dtype=dtype, device=device)

        def one() -> LayerKV | GQAKV:
            if args.attention == "gqa":
                kv_heads, d = args.num_key_value_heads, args.qk_head_dim
                return GQAKV(key=zeros(kv_heads, d), value=zeros(kv_heads, d))
            return LayerKV(latent=zeros(args.kv_lora_rank), rope=zeros(args.qk_rope_head_dim))

        return KVCaches([one() for _ in range(args.num_hidden_layers)], one() if with_mtp else None, capacity)

    @staticmethod
    def bytes_per_token(args: ModelArgs, dtype: torch.dtype, with_mtp: bool) -> int:
        if args.attention == "gqa":
            per_layer = 2 * args.num_key_value_heads * args.qk_head_dim
        else:
            per_layer = args.kv_lora_rank + args.qk_rope_head_dim
        per_layer *= torch.tensor([], dtype=dtype).element_size()
        return per_layer * (args.num_hidden_layers + (1 if with_mtp else 0))

    def first_rows(self, rows: int) -> "KVCaches":
        """Views of the first `rows` batch rows of every cache (the same memory: a step over fewer rows)."""
        def view(kv: LayerKV | GQAKV) -> LayerKV | GQAKV:
            return type(kv)(**{name: tensor[:rows] for name, tensor in vars(kv).items()})

        return KVCaches([view(kv) for kv in self.layers], view(self.mtp) if self.mtp is not None else None,
                        self.capacity)

    def zero_(self, row: int | None = None) -> None:
        """Zero every cache (or one batch row of each)."""
        for kv in self.layers + ([self.mtp] if self.mtp is not None else []):
            for tensor in vars(kv).values():
                (tensor if row is None else tensor[row]).zero_()


@dataclass(frozen=True)
class FusedDecodeShape:
    """What the fused decode kernels are sized for: the KV capacity and the rows of one step (exact + extra)."""

    capacity: int
    max_rows: int


class ModelRunner:
    def __init__(
        self,
        args: ModelArgs,
        weights: ModelWeights,
        residency: Residency,
        device: torch.device,
        streamer: "LayerStreamer | None" = None,
        fused_decode: FusedDecodeShape | None = None,
        forced_routing: "ForcedRouting | None" = None,
    ):
        self.args = args
        self.weights = weights
        self.residency = residency
        self.streamer = streamer
        self.forced_routing = forced_routing  # routing_trace (benchmarks only): decode steps route from a trace
        self.learned_head: "RoutingHead | None" = None  # predictor='learned' (predictor_path=)
        self.device = device
        # an embedding table the plan left in host memory is read row by row over PCIe (kernels/gather.py)
        self.host_embed = (HostRows(weights.embed, device, kernels_usable(device.type) or INTERPRET,
                                    pin_in_place(weights.embed) if device.type == "cuda" else None)
                           if weights.embed.device != device else None)
        self.rope = RotaryEmbedding(args.rope, args.qk_rope_head_dim, device)
        self.act = activation(args.hidden_act)
        self.ops = LayerOps(args, self.act, self.rope)
        # decode steps on CUDA run fused kernels; the CPU (and fused_kernels=False) runs the definitions
        self.decode_ops = self.ops
        if fused_decode is not None and kernels_usable(device.type):
            self.decode_ops = FusedOps(args, self.act, args.hidden_act, self.rope, fused_decode.capacity,
                                       fused_decode.max_rows, device,
                                       fuse=weights.layers + ([weights.mtp.layer] if weights.mtp is not None else []),
                                       streamed=frozenset(streamer.order) if streamer is not None else frozenset())

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [...] -> the main embedding's rows [..., H]."""
        if self.host_embed is not None:
            return self.host_embed(tokens)
        return F.embedding(tokens, self.weights.embed)

    def embed_mtp(self, tokens: torch.Tensor) -> torch.Tensor:
        """The MTP layer's embedding (its own table, or the main one)."""
        mtp = self.weights.mtp
        assert mtp is not None
        return self.embed(tokens) if mtp.embed is None else F.embedding(tokens, mtp.embed)

    @property
    def learned_config(self) -> "HeadConfig | None":
        return self.learned_head.config if self.learned_head is not None else None

    def logits(self, hidden_normed: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_normed, self.weights.lm_head).float()

    def mtp_logits(self, y: torch.Tensor) -> torch.Tensor:
        mtp = self.weights.mtp
        return F.linear(rms_norm(y, mtp.head_norm, self.args.rms_norm_eps), self.weights.mtp_head()).float()

    # ---- layers streamed from host RAM ------------------------------------------------------------------------------
    def enter(self, layer: int) -> None:
        """Before a layer's kernels: a streamed layer's weights must have landed."""
        if self.streamer is not None and self.streamer.streams(layer):
            self.streamer.begin(layer)

    def leave(self, layer: int) -> None:
        if self.streamer is not None and self.streamer.streams(layer):
            self.streamer.end(layer)

    # ---- blocks of new tokens (prefill chunks, uncached forward) ---------------------------------------------------
    def _routed(self, layer: int, flat: list[torch.Tensor], routings: list[Routing]) -> list[torch.Tensor]:
        return self.residency.prefill_experts(layer, flat, [r.ids for r in routings], [r.weights for r in routings])

    def layer_block(self, lw: LayerWeights, xs: list[torch.Tensor], positions: list[torch.Tensor],
                    kv: LayerKV | GQAKV | None, rows: int | list[int], starts: list[int]) -> list[torch.Tensor]:
        """One decoder layer over a window of chunks xs[c] [B, T_c, H] at starts[c] of cache row rows[c] (one int:
        every chunk's row; in order: a chunk attends to the keys its row's earlier chunks wrote), each routed expert
        on all of the window's tokens that use it, whichever rows they belong to."""
        rows = rows if isinstance(rows, list) else [rows] * len(xs)

        def attend(c: int, normed: torch.Tensor) -> torch.Tensor:
            return attention_block(self.args, lw.attn, self.rope, normed, positions[c], kv, rows[c], starts[c])

        return block(self.ops, lw, xs, attend, self._routed)

    def forward_window(self, pieces: list[torch.Tensor], positions: list[torch.Tensor], caches: KVCaches | None,
                       rows: int | list[int], starts: list[int]) -> list[torch.Tensor]:
        """Main layers over a window of chunks pieces[c] [B, T_c] (each prompt's consecutive, in order; of one cache
        row or of `rows[c]`), layer by layer (every chunk through a layer before the next layer) -> final-normed
        hidden per chunk. Each chunk's kernels have the shapes they would have alone, so a window computes the bits
        of its chunks run one by one."""
        xs = [self.embed(tokens) for tokens in pieces]
        for lw in self.weights.layers:
            kv = caches.layers[lw.index] if caches is not None else None
            self.enter(lw.index)
            xs = self.layer_block(lw, xs, positions, kv, rows, starts)
            self.leave(lw.index)
        return [rms_norm(x, self.weights.final_norm, self.args.rms_norm_eps) for x in xs]

    def forward_block(
        self, tokens: torch.Tensor, positions: torch.Tensor, caches: KVCaches | None, row: int, start: int
    ) -> torch.Tensor:
        """Main layers over tokens [B, T] -> final-normed hidden [B, T, H] (a window of one chunk)."""
        return self.forward_window([tokens], [positions], caches, row, [start])[0]

    def mtp_window(self, next_pieces: list[torch.Tensor], hiddens: list[torch.Tensor], positions: list[torch.Tensor],
                   kv: LayerKV | GQAKV | None, row: int, starts: list[int]) -> list[torch.Tensor]:
        """MTP over a window of chunks of pairs: next_pieces[c] [B, T_c] (token i+1), hiddens[c] [B, T_c, H] (main
        final hidden at i), positions of token i+1 -> the MTP block's output [B, T_c, H] per chunk, before its head
        (`mtp_logits`; prefill needs the logits of one position only, and [T, vocab] per chunk is large)."""
        mtp = self.weights.mtp
        assert mtp is not None
        xs = [mtp_input(self.args, mtp, self.embed_mtp(t), h) for t, h in zip(next_pieces, hiddens)]
        return self.layer_block(mtp.layer, xs, positions, kv, row, starts)

    def mtp_block(self, next_tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                  kv: LayerKV | None, row: int, start: int) -> torch.Tensor:
        """MTP over pairs of one block -> logits [B, T, V] predicting token i+2 (see `mtp_window`)."""
        return self.mtp_logits(self.mtp_window([next_tokens], [hidden], [positions], kv, row, [start])[0])
