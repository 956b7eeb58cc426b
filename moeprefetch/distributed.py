"""The process group of an expert-parallel engine (`from_pretrained(..., distributed=True)`, launched by torchrun).

torch.distributed carries everything: NCCL between GPUs, gloo on the CPU (tests), the same code across hosts
(`torchrun --nnodes`). Each process is one rank; on CUDA it takes `cuda:LOCAL_RANK`. The engine sums each MoE layer's
routed outputs across ranks with one all-reduce (`Residency`), and its statistics once per call.

Every rank must issue the same collectives in the same order, so whatever decides their number is agreed at load
(`agree`: rank 0's placement; `check_same`: the plan and options) and per call (rank 0's seed and its "auto"
choices of speculation and draft experts, which its own timings decide). The group stays joined
after an engine closes (a later engine reuses it; re-joining on the same port races the old store's shutdown); the
process leaves it with `torch.distributed.destroy_process_group()` (the CLI does).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .errors import RequestError

logger = logging.getLogger(__name__)

# a rank waits this long for the others inside one collective (a stuck or interrupted peer), then fails
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass
class ProcessGroup:
    rank: int
    world: int
    local_rank: int
    backend: str
    device: torch.device  # where the collectives' tensors live (NCCL: this rank's GPU)

    @staticmethod
    def join(device: torch.device) -> "ProcessGroup":
        """Join (or reuse) the default process group: NCCL for CUDA, gloo for the CPU. The rendezvous comes from
        torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)."""
        if not dist.is_available():
            raise RequestError("distributed=True needs a torch build with torch.distributed")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
            if missing:
                raise RequestError(f"distributed=True needs a launch by torchrun (environment {', '.join(missing)} "
                                   f"not set), e.g. torchrun --nproc-per-node 2 -m moeprefetch generate ... "
                                   f"--distributed")
            if device.type == "cuda":  # before the group: NCCL binds each rank to its own GPU
                torch.cuda.set_device(local_device(device))
            dist.init_process_group(backend=backend, timeout=COLLECTIVE_TIMEOUT)
        group = ProcessGroup(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)),
                             dist.get_backend(), device if dist.get_backend() == "nccl" else torch.device("cpu"))
        logger.info("rank %d of %d (%s)", group.rank, group.world, group.backend)
        return group

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place (fp32 for 16-bit floats: the sums here add one value to zeros, so
        the widening is exact and gloo needs no 16-bit support)."""
        if self.world == 1:
            return tensor
        if tensor.dtype in (torch.bfloat16, torch.float16):
            wide = tensor.float()
            dist.all_reduce(wide)
            return tensor.copy_(wide)
        dist.all_reduce(tensor)
        return tensor

    def agree(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (a picklable object)."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def check_same(self, what: str, value: Any) -> None:
        """Raise one sentence unless every rank has the same `value` (settings that decide the collectives)."""
        if self.world == 1:
            return
        values: list[Any] = [None] * self.world
        dist.all_gather_object(values, value)
        differ = [r for r, v in enumerate(values) if v != values[0]]
        if differ:
            raise RequestError(f"the ranks disagree on {what} (rank 0: {values[0]!r}; rank {differ[0]}: "
                               f"{values[differ[0]]!r}): launch every rank with the same options and checkpoint")


def local_device(device: torch.device) -> torch.device:
    """The device of this rank: `cuda` means cuda:LOCAL_RANK; an explicit index or the CPU stays."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return device
