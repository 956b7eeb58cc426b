"""`speculative="auto"` and `draft_experts="auto"`: MTP speculation on for a call, and the MTP head's experts read from
VRAM only or from wherever they are, when this engine's own measurements say it is faster.

Speculation pays when a verify step (the real row and the draft row in one forward) costs less than 1 + acceptance
plain steps: a verify step yields one token plus the draft when it is accepted. Both sides depend on the machine,
the cache (offloaded, a rejected draft's experts are read too), the text and the sampling, so nothing is assumed:
the engine measures each mode on its own calls and keeps a running estimate per configuration (batch size,
predictor, greedy or sampled):

    plain:        ms per generated token
    speculative:  ms per verify step and the drafts kept per step, so ms per token = step / (1 + kept)

An engine loaded with `draft_tokens=d` > 1 may also chain 1 to d drafts a step: each chain length is a mode of its
own (a longer chain keeps more tokens a step, and costs more rows). A call with `speculative="auto"` first measures
whichever mode has no estimate yet (plain, then one draft, two, ...), then runs the one with the lowest estimate,
and every `REMEASURE_EVERY` calls runs the least measured other once more, so an estimate that no longer holds
(another text, a warmer cache) is corrected. A call that captured a new decode graph (or
compiled kernels) is not a measurement: its time is mostly that one-off cost. The decision and the estimates it
used are reported in the call's statistics (`speculative_auto`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .accounting import Stats

REMEASURE_EVERY = 16  # calls of one configuration between re-measurements of the mode not chosen
SMOOTHING = 0.5  # weight of a new measurement in a mode's running estimate
MIN_DECODE_TOKENS = 4  # shorter calls measure launch overheads more than decoding


def remeasure_due(calls: dict[tuple, int], key: tuple) -> bool:
    """Count a decided call of configuration `key`; True on every REMEASURE_EVERY-th, which runs the mode not chosen
    (the one rule of both auto choices)."""
    calls[key] = calls.get(key, 0) + 1
    return calls[key] % REMEASURE_EVERY == 0


@dataclass
class ModeCost:
    """A mode's running estimate: ms per generated token (plain) or per verify step and its acceptance."""

    ms: float
    acceptance: float = 0.0
    samples: int = 1

    @property
    def per_token(self) -> float:
        """ms per generated token: a verify step yields 1 + acceptance tokens (plain decode: acceptance 0)."""
        return self.ms / (1.0 + self.acceptance)

    def update(self, ms: float, acceptance: float) -> None:
        self.ms += SMOOTHING * (ms - self.ms)
        self.acceptance += SMOOTHING * (acceptance - self.acceptance)
        self.samples += 1


@dataclass
class Decision:
    """What an auto call runs and why (its statistics report `as_dict()`)."""

    key: tuple
    mode: str  # "mtp" or "none"
    reason: str
    plain_ms_per_token: float | None = None
    speculative_ms_per_token: float | None = None  # the chain run (or the best one, when plain decode runs)
    acceptance: float | None = None  # its drafts kept per verify step and row
    measures: bool = True  # False when speculation cannot run: the call says nothing about the choice
    draft_tokens: int | None = None  # mtp: the drafts chained per step
    by_chain: dict[int, float] = field(default_factory=dict)  # ms per token estimated for each chain length

    def as_dict(self) -> dict:
        return {"mode": self.mode, "reason": self.reason, "plain_ms_per_token": self.plain_ms_per_token,
                "speculative_ms_per_token": self.speculative_ms_per_token, "acceptance": self.acceptance,
                "draft_tokens": self.draft_tokens, "ms_per_token_by_draft_tokens": dict(self.by_chain)}


@dataclass
class AutoSpeculation:
    """One engine's estimates and decisions (no state outside the engine that owns it)."""

    plain: dict[tuple, ModeCost] = field(default_factory=dict)
    speculative: dict[tuple, ModeCost] = field(default_factory=dict)
    calls: dict[tuple, int] = field(default_factory=dict)

    def choose(self, key: tuple, unavailable: str | None = None, chains: int = 1) -> Decision:
        """The mode of the next call of configuration `key` (speculation chaining 1 to `chains` drafts a step);
        `unavailable` says why speculation cannot run."""
        if unavailable is not None:
            return Decision(key, "none", unavailable, measures=False)
        if key not in self.plain:
            return self._decision(key, None, "measuring plain decode (no estimate yet)", chains)
        for d in range(1, chains + 1):
            if (key, d) not in self.speculative:
                what = "speculation" if chains == 1 else f"speculation with {d} draft{'s' if d > 1 else ''} a step"
                return self._decision(key, d, f"measuring {what} (no estimate yet)", chains)
        costs = {None: self.plain[key].per_token, **{d: self.speculative[key, d].per_token
                                                     for d in range(1, chains + 1)}}
        best = min(costs, key=lambda d: (costs[d], d or 0))
        if remeasure_due(self.calls, key):
            samples = {d: (self.plain[key] if d is None else self.speculative[key, d]).samples for d in costs}
            other = min((d for d in costs if d != best), key=lambda d: (samples[d], d or 0))
            return self._decision(key, other, f"re-measuring {self._name(other, chains)} (every {REMEASURE_EVERY} "
                                              f"calls)", chains)
        return self._decision(key, best, f"{self._name(best, chains)} is faster here", chains)

    @staticmethod
    def _name(chain: int | None, chains: int) -> str:
        if chain is None:
            return "plain decode"
        return "speculation" if chains == 1 else f"speculation with {chain} draft{'s' if chain > 1 else ''} a step"

    def _decision(self, key: tuple, chain: int | None, reason: str, chains: int) -> Decision:
        plain = self.plain.get(key)
        known = {d: self.speculative[key, d] for d in range(1, chains + 1) if (key, d) in self.speculative}
        shown = known.get(chain) if chain is not None else \
            min(known.values(), key=lambda c: c.per_token, default=None)
        return Decision(key, "none" if chain is None else "mtp", reason,
                        plain_ms_per_token=plain.per_token if plain else None,
                        speculative_ms_per_token=shown.per_token if shown else None,
                        acceptance=shown.acceptance if shown else None, draft_tokens=chain,
                        by_chain={d: c.per_token for d, c in known.items()})

    def record(self, decision: Decision, stats: "Stats", warm: bool) -> bool:
        """Fold a finished call's statistics into its mode's estimate; False when the call measured nothing (too
        short, or not `warm`: it captured a new decode graph)."""
        tokens, steps = stats.decode_tokens, stats.decode_steps
        if not decision.measures or not warm or tokens < MIN_DECODE_TOKENS or steps < 1:
            return False
        sequences = max(stats.sequences, 1)
        if decision.mode == "mtp":  # ms per verify step and sequence; a token costs that / (1 + acceptance)
            ms = 1000.0 * stats.decode_seconds / (steps * sequences)
            # tokens a row gains per verify step: drafts kept over the rows that could check one (with
            # verify_confidence, unchecked drafts gain nothing; over the checked ones alone it would overstate)
            acceptance, table = stats.draft_accepted / max(stats.draft_offered, 1), self.speculative
            entry: tuple = (decision.key, decision.draft_tokens or 1)
        else:
            ms, acceptance, table, entry = 1000.0 * stats.decode_seconds / tokens, 0.0, self.plain, decision.key
        if entry in table:
            table[entry].update(ms, acceptance)
        else:
            table[entry] = ModeCost(ms, acceptance)
        return True


# ---- draft_experts="auto" ----------------------------------------------------------------------------------------
#
# Offloaded, the MTP head's routed experts either come from VRAM only (`cached`: no link bytes, but a draft computed
# without its missing experts is right less often) or are read like the real rows' (`all`: better drafts, more
# bytes). Which is faster depends on the cache, the text and the link, so "auto" measures both per configuration on
# this engine's own calls (ms per generated token, with the drafts' acceptance and the link bytes per token that
# explain it) and runs the faster, re-measuring the other every REMEASURE_EVERY calls, as `AutoSpeculation` does.

DRAFT_MODES = ("cached", "all")


@dataclass
class DraftCost:
    """One draft mode's running estimate in one configuration."""

    ms_per_token: float
    acceptance: float | None  # the drafts' share that was right (speculation: kept), when the call had drafts
    mb_per_token: float  # expert bytes over the link per generated token
    samples: int = 1

    def update(self, ms: float, acceptance: float | None, mb: float) -> None:
        self.ms_per_token += SMOOTHING * (ms - self.ms_per_token)
        if acceptance is not None:
            old = self.acceptance if self.acceptance is not None else acceptance
            self.acceptance = old + SMOOTHING * (acceptance - old)
        self.mb_per_token += SMOOTHING * (mb - self.mb_per_token)
        self.samples += 1

    def as_dict(self) -> dict:
        return {"ms_per_token": self.ms_per_token, "draft_acceptance": self.acceptance,
                "mb_per_token": self.mb_per_token, "samples": self.samples}


@dataclass
class DraftDecision:
    """What an auto call's MTP head reads and why (its statistics report `as_dict()` as `draft_experts_auto`)."""

    key: tuple
    mode: str  # cached | all
    reason: str
    estimates: dict[str, dict] = field(default_factory=dict)  # per mode measured so far (`DraftCost.as_dict`)
    measures: bool = True  # False when the call's MTP head reads no offloaded expert: the mode changes nothing

    def as_dict(self) -> dict:
        return {"mode": self.mode, "reason": self.reason, "estimates": self.estimates}


@dataclass
class AutoDraftExperts:
    """One engine's draft-mode estimates and decisions (no state outside the engine that owns it)."""

    costs: dict[tuple, dict[str, DraftCost]] = field(default_factory=dict)
    calls: dict[tuple, int] = field(default_factory=dict)

    def choose(self, key: tuple, inapplicable: str | None = None) -> DraftDecision:
        """The draft mode of the next call of configuration `key`; `inapplicable` says why the mode cannot matter
        (no MTP head runs, or every expert is resident)."""
        if inapplicable is not None:
            return DraftDecision(key, "cached", inapplicable, measures=False)
        known = self.costs.setdefault(key, {})
        for mode in DRAFT_MODES:
            if mode not in known:
                return self._decision(key, mode, f"measuring draft_experts={mode} (no estimate yet)")
        faster = min(DRAFT_MODES, key=lambda mode: known[mode].ms_per_token)
        if remeasure_due(self.calls, key):
            other = next(mode for mode in DRAFT_MODES if mode != faster)
            return self._decision(key, other, f"re-measuring draft_experts={other} (every {REMEASURE_EVERY} calls)")
        return self._decision(key, faster, f"draft_experts={faster} is faster here")

    def _decision(self, key: tuple, mode: str, reason: str) -> DraftDecision:
        known = self.costs.get(key, {})
        return DraftDecision(key, mode, reason, {m: c.as_dict() for m, c in known.items()})

    def record(self, decision: DraftDecision, stats: "Stats", warm: bool) -> bool:
        """Fold a finished call's statistics into its mode's estimate; False when the call measured nothing (too
        short, not `warm`, or a mode that could not matter)."""
        tokens = stats.decode_tokens
        if not decision.measures or not warm or tokens < MIN_DECODE_TOKENS:
            return False
        ms = 1000.0 * stats.decode_seconds / tokens
        if stats.draft_offered:  # speculation: the drafts kept
            acceptance: float | None = stats.draft_accepted / stats.draft_offered
        elif stats.mtp_drafts_checked:  # the mtp predictor's shadow row: the drafts that were the next token
            acceptance = stats.mtp_drafts_correct / stats.mtp_drafts_checked
        else:
            acceptance = None
        mb = stats.to_dict()["decode_bytes_h2d_per_token"] / 1e6
        known = self.costs.setdefault(decision.key, {})
        if decision.mode in known:
            known[decision.mode].update(ms, acceptance, mb)
        else:
            known[decision.mode] = DraftCost(ms, acceptance, mb)
        return True
