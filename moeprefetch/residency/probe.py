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
  was read;
- `torn_in_table`: published slots (all of them, before and after each layer's plan) that do not hold their record,
  each counted once, the first ones logged with where and when (`table`, `torn_events`).

It costs a device copy of a sample of every record (one byte in 1,024: 14 MB for V2-Lite's shape in FP8) and
two small gathers per layer.
"""

from __future__ import annotations

import torch

from .state import E_FREE, RESIDENT, TableState

PROBE_COUNTS = ("waited_early", "stale_hit", "overwritten", "checked", "torn_in_table")
EVENTS = 64  # torn slots logged (the first ones say where the defect starts)


class SlotProbe:
    """Compares one byte in every `stride` of each read slot (and each record's last byte) with the same bytes of
    its record: a fill lands in 64 KiB chunks, so a torn read misses whole chunks, and sampling keeps the probe's
    own cost (which delays the main stream and so makes fills less often late) to microseconds per layer."""

    def __init__(self, pool: torch.Tensor, host: torch.Tensor, reads: int, stride: int = 1024):
        self.n_slots, record = pool.shape
        device = pool.device
        self.flat = pool.view(-1)  # [slots x record] uint8
        self.record = record
        self.columns = torch.cat((torch.arange(0, record, stride), torch.tensor([record - 1]))).to(device)
        self.mirror = host[:, self.columns.cpu()].to(device)  # [keys, samples] the records' sampled bytes
        self.reads = reads  # u entries a layer can read (exact and shadow rows' experts)
        self.whole_table = True  # `table` around each plan too (the residency's switch: `enable_probe`)
        self.counts = torch.zeros(len(PROBE_COUNTS), dtype=torch.int64, device=device)
        self._before = torch.zeros(reads, dtype=torch.bool, device=device)  # which reads were whole before
        self._torn = torch.zeros(self.n_slots, dtype=torch.bool, device=device)  # published slots found torn
        self.events = torch.full((EVENTS, 6), -1, dtype=torch.int64, device=device)
        self.n_events = torch.zeros(1, dtype=torch.int64, device=device)

    def clear(self) -> None:
        self.counts.zero_()
        self._torn.zero_()
        self.events.fill_(-1)
        self.n_events.zero_()

    def _whole(self, u_key: torch.Tensor, u_slot: torch.Tensor) -> torch.Tensor:
        return self._matches(u_slot[: self.reads].clamp(min=0).long(), u_key[: self.reads].clamp(min=0).long())

    def _matches(self, slot: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        sampled = self.flat.index_select(0, (slot[:, None] * self.record + self.columns[None, :]).reshape(-1))
        return (sampled.view(slot.shape[0], -1) == self.mirror.index_select(0, key)).all(dim=1)

    def table(self, st: TableState, phase: int, position: int) -> None:
        """Every published slot against its record (main stream, capturable): phase 0 before a layer's plan, 1
        after it. The first time a slot is found torn, an event is logged: [decode step, MoE position, phase, slot,
        key, the state of a fill entry that targets the slot (-1: none)]. Torn after plan L but whole before it:
        the plan published it incomplete (a fill's ready flag or an admission); torn before plan L but whole after
        plan L - 1: it was written while published (during layer L - 1's experts or its wait)."""
        slots = torch.arange(self.n_slots, device=self.flat.device)
        published = (st.slot_state == RESIDENT) & (st.key_of >= 0)
        torn = published & ~self._matches(slots, st.key_of.clamp(min=0).long())
        new = torn & ~self._torn
        # gathers with one-element index tensors throughout: indexing with a 0-d tensor reads its value on the
        # host (a synchronisation), which fails the step's capture
        first = torch.argmax(new.to(torch.int32)).view(1)
        entry = (st.e_slot == first) & (st.e_state != E_FREE)
        targeted = st.e_state.index_select(0, torch.argmax(entry.to(torch.int32)).view(1)).long()
        entry_state = torch.where(entry.any(), targeted, torch.full_like(targeted, -1))
        step = st.decode_step[:1].long()
        event = torch.cat((step, torch.full_like(step, position), torch.full_like(step, phase), first,
                           st.key_of.index_select(0, first).long(), entry_state))
        logged = new.any() & (self.n_events < self.events.shape[0])
        row = self.n_events.clamp(max=self.events.shape[0] - 1)
        self.events.index_copy_(0, row, torch.where(logged, event, self.events.index_select(0, row)[0])[None])
        self.n_events.add_(logged.long())
        self.counts[4].add_(new.sum())
        self._torn.copy_(torn)

    def torn_events(self) -> list[dict[str, int]]:
        names = ("decode_step", "position", "phase", "slot", "key", "fill_entry_state")
        return [dict(zip(names, row)) for row in self.events[: int(self.n_events[0])].tolist()]

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
        return {**dict(zip(PROBE_COUNTS, self.counts.tolist())), "torn_events": self.torn_events()}
