"""Which rank owns which routed expert (expert parallelism over several GPUs).

Each MoE layer's routed experts are split over the ranks; a rank keeps only its own in its host arena and VRAM cache,
numbered 0..local-1 per layer (its *local* experts). Every rank computes the routing itself (dense weights are
replicated), maps the selected experts to local numbers (-1 for another rank's) and computes its own; the outputs are
summed across ranks (`distributed.py`).

Placement balances each rank's expected link traffic: with a routing profile (uses per (layer, expert)), experts are
dealt heaviest first to the rank with the least traffic that still has room; without one, round-robin. Every rank
computes the same placement from the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

ExpertKey = tuple[int, int]


@dataclass(frozen=True)
class ExpertPlacement:
    rank: int
    world: int
    owner: tuple[tuple[int, ...], ...]  # [position][expert] -> owning rank

    @property
    def positions(self) -> int:
        return len(self.owner)

    @property
    def n_experts(self) -> int:
        return len(self.owner[0]) if self.owner else 0

    @cached_property
    def local(self) -> int:
        """Local experts per layer on every rank: the most any rank owns in any layer (others pad)."""
        return max((sum(1 for o in row if o == r) for row in self.owner for r in range(self.world)), default=0)

    @cached_property
    def _owned(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(e for e, o in enumerate(row) if o == self.rank) for row in self.owner)

    def owned(self, position: int) -> tuple[int, ...]:
        """This rank's experts of one layer, in expert order: local number i is owned(position)[i]."""
        return self._owned[position]

    def owns(self, position: int, expert: int) -> bool:
        return self.owner[position][expert] == self.rank

    def global_expert(self, position: int, local: int) -> int:
        """The checkpoint's expert number of a local one, or -1 for a padding entry."""
        owned = self.owned(position)
        return owned[local] if local < len(owned) else -1

    def local_table(self, device: torch.device) -> torch.Tensor:
        """[P, E] int64: each expert's local number on this rank, -1 where another rank owns it."""
        table = torch.full((self.positions, self.n_experts), -1, dtype=torch.int64)
        for p in range(self.positions):
            for i, e in enumerate(self.owned(p)):
                table[p, e] = i
        return table.to(device)

    @staticmethod
    def round_robin(positions: int, n_experts: int, world: int, rank: int) -> "ExpertPlacement":
        return ExpertPlacement(rank, world, tuple(tuple(e % world for e in range(n_experts)) for _ in range(positions)))

    @staticmethod
    def balanced(profile: list[list[float]], world: int, rank: int) -> "ExpertPlacement":
        """profile[position][expert]: expected uses (link traffic) of each expert. Per layer, experts go heaviest first
        (ties by number) to the rank with the least traffic so far among those with room (ceil(E / world) each)."""
        owner = []
        for uses in profile:
            room = -(-len(uses) // world)
            load, count, row = [0.0] * world, [0] * world, [0] * len(uses)
            for e in sorted(range(len(uses)), key=lambda i: (-uses[i], i)):
                r = min((r for r in range(world) if count[r] < room), key=lambda r: (load[r], count[r], r))
                row[e] = r
                load[r] += uses[e]
                count[r] += 1
            owner.append(tuple(row))
        return ExpertPlacement(rank, world, tuple(owner))

    @staticmethod
    def build(layers: list[int], n_experts: int, world: int, rank: int,
              profile: dict[ExpertKey, float] | None = None) -> "ExpertPlacement":
        """The placement of `layers` (checkpoint layer numbers, in position order): balanced over a profile keyed by
        (checkpoint layer, expert) when one is given, else round-robin."""
        if not profile:
            return ExpertPlacement.round_robin(len(layers), n_experts, world, rank)
        table = [[float(profile.get((layer, e), 0.0)) for e in range(n_experts)] for layer in layers]
        return ExpertPlacement.balanced(table, world, rank)

    def traffic(self, profile: list[list[float]]) -> list[float]:
        """Each rank's share of a profile's uses under this placement."""
        totals = [0.0] * self.world
        for p, uses in enumerate(profile):
            for e, u in enumerate(uses):
                totals[self.owner[p][e]] += u
        return totals
