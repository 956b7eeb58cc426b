"""The host expert store: every routed expert, packed, in one page-locked arena of exactly the bytes needed.

PyTorch's pinned allocator rounds each allocation up to a power of two (a 16.5 MiB V2-Lite expert becomes 32 MiB),
so the store allocates one ordinary arena of the exact size, fills it, and registers it with `cudaHostRegister`.
If registration is refused the store stays pageable, with a warning: copies still work, only ~4x slower.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from .errors import ResourceError
from .expert_records import ExpertFormat

logger = logging.getLogger(__name__)

GiB = 1024**3
# Keep this much host RAM free beyond the store, for the OS, Python and the resident weights' staging copies.
HOST_RAM_HEADROOM = 1 * GiB


def available_host_ram() -> int:
    """Bytes of host RAM this process can still use: MemAvailable, capped by a cgroup limit if one is set."""
    available = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit_text = Path(limit_file).read_text().strip()
            if limit_text != "max" and int(limit_text) < 1 << 60:
                available = min(available, int(limit_text) - int(Path(usage_file).read_text().strip()))
            break
        except (OSError, ValueError):
            continue
    return max(available, 0)


def check_host_ram(needed: int, what: str, available: int | None = None) -> None:
    available = available_host_ram() if available is None else available
    if needed + HOST_RAM_HEADROOM > available:
        raise ResourceError(
            f"host RAM is too small: {what} needs {needed / GiB:.2f} GiB (+{HOST_RAM_HEADROOM / GiB:.0f} GiB "
            f"headroom) but only {available / GiB:.2f} GiB is available"
        )


@dataclass
class PinResult:
    pinned: bool
    seconds: float
    message: str = ""


def register_pinned(tensor: torch.Tensor) -> PinResult:
    """Page-lock an existing CPU tensor in place with cudaHostRegister (exact size, no rounding)."""
    start = time.perf_counter()
    if not torch.cuda.is_available():
        return PinResult(False, 0.0, "CUDA is not available")
    cudart = torch.cuda.cudart()
    code = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    ok = int(code) == 0 if not hasattr(code, "value") else code.value == 0
    if not ok:
        _clear_last_cuda_error()
        return PinResult(False, time.perf_counter() - start, f"cudaHostRegister returned {code}")
    return PinResult(True, time.perf_counter() - start)


def unpin_when_freed(tensor: torch.Tensor) -> Callable[[], None]:
    """The undo of a successful `register_pinned`: call it to unpin now; it also runs (once) when the tensor is
    collected, so an owner dropped without close() never leaves registered pages behind for the allocator to hand
    out again (CUDA would refuse to register them for the next owner)."""
    return weakref.finalize(tensor, _unregister, tensor.data_ptr())


def pin_in_place(tensor: torch.Tensor) -> Callable[[], None] | None:
    """Page-lock a host tensor where it lies -> its unpin (`unpin_when_freed`), or None when it could not be pinned
    (no CUDA, or the driver refused)."""
    return unpin_when_freed(tensor) if register_pinned(tensor).pinned else None


def _unregister(ptr: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(ptr)


def _clear_last_cuda_error() -> None:
    """A refused cudaHostRegister leaves its code as the runtime's last error, and PyTorch's next kernel-launch check
    would raise it as if that kernel had failed. torch's cudart bindings have no cudaGetLastError, so call it from
    the libcudart this process already loaded (dlopen of a loaded library returns that same instance)."""
    import ctypes

    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[5] for line in fh if "libcudart.so" in line and len(line.split()) == 6}
    except OSError:
        paths = set()
    cleared = False
    for path in paths:
        try:
            ctypes.CDLL(path).cudaGetLastError()
            cleared = True
        except (OSError, AttributeError):
            continue
    if not cleared:
        logger.warning("could not clear the CUDA runtime's error after the refused registration; if the next CUDA call "
                       "fails with 'cudaErrorHostMemoryAlreadyRegistered', that is its origin")


class HostExpertStore:
    """All routed experts as rows of one uint8 arena `[n_experts_total, record_bytes]` in host memory."""

    def __init__(
        self,
        fmt: ExpertFormat,
        layers: list[int],
        n_experts: int,
        pin: bool,
        pin_fn: Callable[[torch.Tensor], PinResult] = register_pinned,
        available_ram: int | None = None,
    ):
        self.fmt = fmt
        self.layers = list(layers)
        self.n_experts = n_experts
        self._row_base = {layer: i * n_experts for i, layer in enumerate(self.layers)}
        self.nbytes = len(self.layers) * n_experts * fmt.record_bytes
        check_host_ram(self.nbytes, f"the expert store ({len(self.layers)} layers x {n_experts} experts)", available_ram)
        self.arena = torch.empty((len(self.layers) * n_experts, fmt.record_bytes), dtype=torch.uint8)
        self.pinned = False
        self._pin_requested = pin
        self._pin_fn = pin_fn
        self.load_seconds = 0.0
        self.pin_seconds = 0.0

    def row(self, layer: int, expert: int) -> int:
        return self._row_base[layer] + expert

    def record(self, layer: int, expert: int) -> torch.Tensor:
        return self.arena[self.row(layer, expert)]

    @property
    def pinned_bytes(self) -> int:
        return self.nbytes if self.pinned else 0

    def fill(self, pack: Callable[[int, int, torch.Tensor], None], progress: bool = True) -> None:
        """Pack every expert with `pack(layer, expert, out_record)`, then page-lock the arena."""
        from tqdm.auto import tqdm

        start = time.perf_counter()
        keys: Iterable[tuple[int, int]] = [(l, e) for l in self.layers for e in range(self.n_experts)]
        for layer, expert in tqdm(keys, desc="expert store", unit="expert", disable=not progress, leave=False):
            pack(layer, expert, self.record(layer, expert))
        self.load_seconds = time.perf_counter() - start
        logger.info(
            "expert store: %d experts, %.2f GiB in %.1f s (%.2f GB/s)",
            len(self.arena),
            self.nbytes / GiB,
            self.load_seconds,
            self.nbytes / max(self.load_seconds, 1e-9) / 1e9,
        )
        if self._pin_requested:
            result = self._pin_fn(self.arena)
            self.pin_seconds = result.seconds
            self.pinned = result.pinned
            if result.pinned:
                self._unpin = unpin_when_freed(self.arena)
                logger.info("expert store page-locked (%.2f GiB) in %.2f s", self.nbytes / GiB, result.seconds)
            else:
                logger.warning(
                    "page-locking the expert store failed (%s): falling back to pageable memory; expect host->device "
                    "copies at roughly 10-15 GB/s instead of ~55 GB/s (about 4x slower misses and prefetches)",
                    result.message,
                )

    def close(self) -> None:
        if self.pinned:
            self._unpin()
            self.pinned = False
