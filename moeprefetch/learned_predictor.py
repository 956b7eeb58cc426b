"""A learned routing predictor: a tiny head that, at decode step t, guesses every MoE layer's experts for tokens
t+1 .. t+leads, trained offline from the checkpoint's own teacher-forced routing (`predictor_training.py`).

Inputs are what a decode step already holds when it ends: the final hidden state of token t *after* the final norm
(decode.py's `hidden`, the lm_head's input) and, when the checkpoint has one, the MTP block's output for the draft
(its input is token t+1, sampled at step t). The head is a shared low-rank projection, a GELU, and one linear to
leads x L x E logits: fixed shapes and pure tensor ops, so a decode graph can capture it.

Saved as safetensors with a JSON config in the metadata, including the checkpoint's fingerprint (config.json and the
routers' bytes): a predictor never steers the prefetches of routers it did not learn.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .errors import CheckpointError, RequestError
from .checkpoint import checkpoint_fingerprint

if TYPE_CHECKING:
    from .engine import MoEPrefetchEngine

logger = logging.getLogger(__name__)

FORMAT = "moeprefetch.learned_predictor/1"
MAX_RANK = 256
# the head may take at most this share of the checkpoint's non-expert bytes (it sits in VRAM next to them)
BYTE_SHARE = 0.05


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    layers: tuple[int, ...]  # the main MoE layer ids, in the order of the logits' L axis
    n_experts: int
    top_k: int
    leads: int = 1
    rank: int = MAX_RANK
    use_mtp: bool = False
    fingerprint: str = ""
    # > 0: one more block of logits, each expert's chance of being needed by any of the next `horizon` tokens (what
    # victims are ranked by, `reuse_weight`); 0: that chance comes from the leads' own probabilities
    horizon: int = 0
    hidden_input: str = "final hidden after the final norm"

    @property
    def blocks(self) -> int:
        return logit_blocks(self.leads, self.horizon)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)})

    @staticmethod
    def from_json(text: str) -> "HeadConfig":
        data = json.loads(text)
        if data.pop("format", None) != FORMAT:
            raise CheckpointError(f"this file is not a {FORMAT} predictor")
        data["layers"] = tuple(data["layers"])
        return HeadConfig(**data)


def logit_blocks(leads: int, horizon: int) -> int:
    """Blocks of logits a head puts out: one per lead, and one for its horizon if it has one."""
    return leads + (1 if horizon else 0)


def fitting_rank(in_features: int, outputs: int, budget_bytes: int, bytes_per_param: int = 2) -> int:
    """The largest power-of-two rank <= MAX_RANK whose head fits `budget_bytes` (at least 8: a head that small is
    still far below any checkpoint's non-expert bytes)."""
    rank = MAX_RANK
    while rank > 8 and (in_features * rank + rank + rank * outputs + outputs) * bytes_per_param > budget_bytes:
        rank //= 2
    return rank


class RoutingHead(torch.nn.Module):
    """hidden [B, H] (and the MTP output [B, H]) -> logits [B, blocks, L, E]: blocks 0..leads-1 over the experts of
    tokens t+1..t+leads, then (with a horizon) one over "needed by any of tokens t+1..t+horizon"."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        inputs = config.hidden_size * (2 if config.use_mtp else 1)
        self.down = torch.nn.Linear(inputs, config.rank)
        self.up = torch.nn.Linear(config.rank, config.blocks * len(config.layers) * config.n_experts)

    def forward(self, hidden: torch.Tensor, mtp_hidden: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        x = hidden.to(self.down.weight.dtype)
        if c.use_mtp:
            if mtp_hidden is None:
                raise RequestError("this predictor was trained on the MTP output and needs mtp_hidden")
            # the MTP output is un-normed (its head norms it): a weightless RMS norm puts both on one scale
            m = mtp_hidden.to(x.dtype)
            x = torch.cat((x, m * torch.rsqrt(m.pow(2).mean(-1, keepdim=True) + 1e-6)), -1)
        logits = self.up(F.gelu(self.down(x)))
        return logits.view(-1, c.blocks, len(c.layers), c.n_experts)

    def predict(self, hidden: torch.Tensor, mtp_hidden: torch.Tensor | None = None, k: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top-k expert ids [B, leads, L, k], their sigmoid probabilities [B, leads, L, k] in (0, 1], and every
        expert's probability of being needed soon [B, L, E]: by one of the next `horizon` tokens, from the horizon
        block; without one, by one of the next two tokens (the next one for a one-lead head), from the leads'
        probabilities)."""
        everything = self.forward(hidden, mtp_hidden)
        logits = everything[:, : self.config.leads]
        top = logits.topk(k or self.config.top_k, dim=-1)
        if self.config.horizon:
            soon = torch.sigmoid(everything[:, -1].float())
        else:
            soon = 1 - (1 - torch.sigmoid(logits[:, :2].float())).prod(1)
        # clamp: a very negative logit's sigmoid underflows to 0, which the prediction ring reads as "no guess"
        return top.indices, torch.sigmoid(top.values).clamp(min=1e-6), soon


# ---- saving and loading -------------------------------------------------------------------------------------------


def save_predictor(head: RoutingHead, path: str | Path, extra: dict[str, Any] | None = None) -> None:
    from safetensors.torch import save_file

    metadata = {"config": head.config.to_json()}
    if extra:
        metadata["training"] = json.dumps(extra)
    # bf16 as stored and as the engine holds it on the GPU: the byte share (`fitting_rank`) counts 2 bytes a parameter
    save_file({k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in head.state_dict().items()}, str(path),
              metadata)


def load_predictor(path: str | Path, engine_or_checkpoint: "MoEPrefetchEngine | str | Path") -> RoutingHead:
    """A saved predictor, refused unless it was trained on this checkpoint's routers."""
    from safetensors import safe_open

    path = Path(path).expanduser()
    if not path.is_file():
        raise RequestError(f"predictor {path} is not a file")
    try:
        with safe_open(str(path), "pt") as handle:
            metadata = handle.metadata() or {}
            state = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as exc:  # safetensors' own errors (a header it cannot read) name no file
        raise CheckpointError(f"predictor {path} is not a safetensors file this engine can read "
                              f"({type(exc).__name__})") from None
    if "config" not in metadata:
        raise CheckpointError(f"{path} holds no predictor config in its metadata")
    try:
        config = HeadConfig.from_json(metadata["config"])
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"predictor {path}'s config cannot be read by this version ({exc})") from None
    checkpoint = getattr(engine_or_checkpoint, "path", engine_or_checkpoint)
    if checkpoint_fingerprint(checkpoint) != config.fingerprint:
        raise CheckpointError(f"predictor {path} was trained on another checkpoint (its fingerprint differs from "
                              f"{checkpoint}'s config and routers)")
    head = RoutingHead(config)
    try:
        head.load_state_dict(state)
    except RuntimeError as exc:  # tensors missing or of other shapes than the config says
        raise CheckpointError(f"predictor {path}'s weights do not match its config: "
                              f"{str(exc).splitlines()[0]}") from None
    broken = [name for name, tensor in state.items() if tensor.is_floating_point() and not tensor.isfinite().all()]
    if broken:  # a diverged or damaged training: its guesses would be noise, silently
        raise CheckpointError(f"predictor {path} holds NaN or infinite weights ({', '.join(broken)}): train it again")
    return head.eval()
