"""A debugging probe of what each decode layer's expert kernel reads from its slots (investigations only).

The table's invariants say that a slot the expert kernel reads holds its expert's whole record from before the
kernel starts until it ends. `Residency.corrupt_slots` checks only the end state, which a race can leave clean: a
read of a slot before its fill lands, or a fill into a slot that a kernel is still reading, is overwritten by the
right bytes later. The probe checks at the moments that matter, inside the decode step (captured with it): right
before a layer's expert kernel and right after it, every slot it reads is compared with a device copy of the host
records. Its counts say which invariant broke:

- `waited_early`: a late expert's slot, after its wait (`late_prefetch="wait"`), is not yet its record: the wait
  let the kernel read a fill that had not landed;
- `stale_hit`: a slot read as a hit does not hold its record before the kernel;
- `overwritten`: a slot that held its record before the kernel no longer does after it: something wrote it while it
  was read.

It costs a device copy of a sample of every record (one byte in 1,024: 14 MB for V2-Lite's shape in FP8) and
two small gathers per layer.
"""

from __future__ import annotations

import torch

PROBE_COUNTS = ("waited_early", "stale_hit", "overwritten", "checked")


class SlotProbe:
    """Compares one byte in every `stride` of each read slot (and each record's last byte) with the same bytes of
    its record: a fill lands in 64 KiB chunks, so a torn read misses whole chunks, and sampling keeps the probe's
    own cost (which delays the main stream and so makes fills less often late) to microseconds per layer."""

    def __init__(self, pool: torch.Tensor, host: torch.Tensor, reads: int, stride: int = 1024):
        record = pool.shape[1]
        device = pool.device
        self.flat = pool.view(-1)  # [slots x record] uint8
        self.record = record
        self.columns = torch.cat((torch.arange(0, record, stride), torch.tensor([record - 1]))).to(device)
        self.mirror = host[:, self.columns.cpu()].to(device)  # [keys, samples] the records' sampled bytes
        self.reads = reads  # u entries a layer can read (exact and shadow rows' experts)
        self.counts = torch.zeros(len(PROBE_COUNTS), dtype=torch.int64, device=device)
        self._before = torch.zeros(reads, dtype=torch.bool, device=device)  # which reads were whole before

    def _whole(self, u_key: torch.Tensor, u_slot: torch.Tensor) -> torch.Tensor:
        slot, key = u_slot[: self.reads].clamp(min=0).long(), u_key[: self.reads].clamp(min=0).long()
        sampled = self.flat.index_select(0, (slot[:, None] * self.record + self.columns[None, :]).reshape(-1))
        return (sampled.view(self.reads, -1) == self.mirror.index_select(0, key)).all(dim=1)
    def before(self, u_key: torch.Tensor, u_slot: torch.Tensor, u_wait: torch.Tensor) -> None:
        """After the layer's plan (and wait), before its expert kernel (main stream, capturable)."""
        read = u_slot[: self.reads] >= 0
        whole = self._whole(u_key, u_slot)
        waited = u_wait[: self.reads] >= 0
        self.counts[0].add_((read & waited & ~whole).sum())
        self.counts[1].add_((read & ~waited & ~whole).sum())
        self.counts[3].add_(read.sum())
        self._before.copy_(read & whole)

    def after(self, u_key: torch.Tensor, u_slot: torch.Tensor) -> None:
        """After the layer's expert kernel (main stream, capturable)."""
        self.counts[2].add_((self._before & ~self._whole(u_key, u_slot)).sum())

    def report(self) -> dict[str, int]:
        return dict(zip(PROBE_COUNTS, self.counts.tolist()))
