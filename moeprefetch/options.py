"""`EngineConfig`: every option of an engine, as a user writes it, in one frozen dataclass.

The Python API (`MoEPrefetchEngine.from_pretrained(path, **options)` or `config=`), the command line and the hydra
sweeps all build one of these, so an option has one name, one default and one check. `check()` validates every field
before anything is read or allocated (one sentence per mistake); `build.py` then resolves the values (device, dtype,
predictor default) against the checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from .errors import RequestError
from .expert_records import EXPERT_DTYPES, INT4_GROUP_SIZE
from .residency.state import POLICIES, ResidencyConfig

# how the MTP head reads its routed experts: only those in VRAM (drafts steer speed, never tokens), or all of them
DRAFT_EXPERTS = ("cached", "all", "auto")
MAX_DRAFT_TOKENS = 4  # chained MTP drafts a verify step checks at most
LATE_PREFETCH = ("reread", "wait")
FILL_LINK = ("shared", "idle")
VERIFY_ROWS = ("separate", "shared")  # a step's extra rows: batches of their own, or one batch with the real rows


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineConfig:
    device: str | torch.device = _opt("cpu", "cpu or cuda (cuda:N)")
    dtype: str | torch.dtype = _opt(torch.float32, "compute dtype: float32, bfloat16 or float16")
    # the VRAM expert cache: none of the three = every expert resident
    expert_cache_slots: int | None = _opt(None, "routed-expert slots in device memory")
    expert_cache_fraction: float | None = _opt(None, "expert slots as a share of all routed experts")
    vram_budget: str | int | float | None = _opt(None, "device-memory budget that sizes the cache, e.g. 12GiB")
    policy: str = _opt("lrfu", "cache policy: lrfu (uses decayed by half every lrfu_halflife steps), lru, lfu or "
                               "static")
    lrfu_halflife: float = _opt(ResidencyConfig.frequency_halflife,
                                "lrfu: a use counts half after this many steps (decode steps and prefill chunks; 16 "
                                "missed least on real routing traces, BENCHMARKS)")
    hot_set: Sequence[tuple[int, int]] | None = _opt(None, "the static policy's pinned (layer, expert) pairs")
    # prediction and prefetching (defaults that generate() may override per call)
    predictor: str | None = _opt(None, "prefetch predictor (default none: reactive fetching, the fastest measured "
                                       "offloaded; e.g. next_layer_gate, mtp, mtp+next_layer_gate, oracle_next)")
    predictor_path: str | None = _opt(None, "a routing head trained by `moeprefetch train-predictor` on this "
                                            "checkpoint, for predictor='learned'")
    lookahead: int = _opt(1, "MoE layers ahead for next_layer_gate, decode steps ahead for oracle, tokens ahead for "
                             "MTP drafts: how far predictions reach (their fills wait for prefetch_lead)")
    prefetch_budget: float | None = _opt(None, "prefetches per (step, layer), as a multiple of top-k (default 1.5; "
                                               "0 for predictor='learned' alone: protection only, the fastest "
                                               "measured offloaded, BENCHMARKS; 0 makes any predictor protect only)")
    max_inflight_experts: int | None = _opt(None, "prefetches in flight at most (default 2 x top-k per row)")
    min_confidence: float = _opt(0.0, "predictions below this confidence are neither fetched nor counted")
    fill_confidence: float = _opt(0.0, "predictions below this confidence are not prefetched; they still protect "
                                       "the experts they name from eviction (protection moves no bytes)")
    fill_link: str = _opt("shared", "shared: prefetch fills and a layer's reads of missed experts share the link; "
                                    "idle: fills for later layers wait while a layer reads experts from host, so "
                                    "they use only link time that would idle")
    reuse_weight: float | None = _opt(None, "predictor='learned': victims by w x the head's probability that the "
                                            "expert is needed soon (its horizon, or the next two tokens) + (1 - w) x "
                                            "the policy's rank (default 0.7 where the head runs, the fewest misses "
                                            "measured, BENCHMARKS; 0: the policy alone)")
    bypass: bool | None = _opt(None, "predictor='learned': a miss that the head thinks less likely to be needed soon "
                                     "than its victim is read from host without admission, keeping the victim "
                                     "(issue 36; default on where the head runs); this and reuse_weight act in calls "
                                     "whose predictor runs the head (a call with another logs that they do nothing "
                                     "there; a server refuses one)")
    spare_recent: int = _opt(1, "prefetches never evict an expert used in the last N steps (0: any victim; lrfu, "
                                "lru and static policies; the oracles' prefetches, never wrong, spare nothing)")
    prefetch_lead: int = _opt(0, "a prefetch is reserved at most this many MoE layers before its need (0: no limit, as "
                                 "soon as predicted, fastest on the H200); a fill reserved early holds its slot longer")
    late_prefetch: str = _opt("wait", "an expert whose prefetch is still in flight when its layer runs: wait a "
                                      "bounded time for the fill (wait), or read it from host memory again (reread; "
                                      "slower on the H200: BENCHMARKS.md)")
    draft_experts: str = _opt("cached", "the MTP head drafts with the routed experts in VRAM, fetching none (cached: "
                                        "offloaded, mostly its shared expert alone), reads every one it routes to "
                                        "(all), or runs whichever this engine measured faster per token on its own "
                                        "calls (auto; the choice, each mode's acceptance and bytes per token are in "
                                        "the statistics as draft_experts_auto; continuous batches and serve draft "
                                        "from VRAM)")
    verify_confidence: float = _opt(0.0, "speculative='mtp': a draft is verified only when the MTP head gave it at "
                                         "least this probability; below it the step computes the draft row without "
                                         "its routed experts, so an unlikely draft moves no expert bytes (0: verify "
                                         "every draft)")
    draft_tokens: int = _opt(1, f"speculative='mtp': drafts a verify step checks (1 to {MAX_DRAFT_TOKENS}): the MTP "
                                f"draft, chained on its own output for each further one; each costs a row per step, "
                                f"and every step of this engine computes its rows' kernels for 1 + draft_tokens rows")
    verify_rows: str = _opt("separate", "how a decode step computes a sequence's extra rows (its drafts or shadow "
                                        "row): each as a batch of its own beside the real rows (separate: a plain "
                                        "step computes its real rows alone; a verify step reads the layers' weights "
                                        "once per row), or all 1 + draft_tokens rows of a sequence as one batch in "
                                        "every step (shared: a verify step reads each weight once for all its rows, "
                                        "with one launch per kernel; a plain step computes padding rows)")
    # shapes and formats
    max_seq_len: int | None = _opt(None, "longest sequence (default min(model limit, 4096))")
    max_batch_size: int = _opt(8, "largest batch of a call")
    prefill_chunk: int | None = _opt(None, "prompt tokens per prefill step (default 2048 on CUDA, 512 on the CPU)")
    prefill_window: int | None = _opt(None, "prompt tokens whose chunks run each layer together, so an offloaded "
                                            "expert crosses once per window (default 8192 on CUDA, 2048 on the "
                                            "CPU; whole chunks; shorter windows need less memory)")
    expert_dtype: str | None = _opt(None, "expert records on the wire and in the cache: model (the compute dtype), "
                                          "fp8, int8, or int4 (4-bit groups, dequantised inside the expert kernels); "
                                          "default: int4 for a 4-bit checkpoint (GPTQ, AWQ, compressed-tensors), else "
                                          "model")
    int4_group_size: int | None = _opt(None, f"int4: inputs per scale group, an even number (default: a 4-bit "
                                             f"checkpoint's own, else {INT4_GROUP_SIZE}; smaller groups are more exact "
                                             f"and carry more scale bytes)")
    int4_symmetric: bool | None = _opt(None, "int4: symmetric groups (a scale each) instead of asymmetric ones (a "
                                             "scale and a zero point each); default: a 4-bit checkpoint's own, else "
                                             "asymmetric")
    # mechanics
    pin_memory: bool = _opt(True, "page-lock the host expert store")
    cuda_graphs: bool = _opt(True, "capture each decode step as one CUDA graph")
    fused_kernels: bool = _opt(True, "decode steps on CUDA run fused Triton kernels for norms, routers, attention "
                                     "and projections (False: the torch definitions, for comparison; the routed "
                                     "experts' kernel is the same either way)")
    stream_layers: int | None = _opt(None, "layers streamed from host RAM (default: as the budget needs)")
    stream_ahead: int = _opt(2, "streamed layers copied ahead of the compute")
    progress: bool = _opt(False, "progress bars while loading")
    routing_trace: str | None = _opt(None, "benchmarks only: a routing trace file (moeprefetch/traces.py format) "
                                           "whose experts every decode step's main MoE layers use instead of the "
                                           "router's choice, so a random-weight checkpoint sees real routing")
    # several GPUs (expert parallelism over torch.distributed, launched by torchrun)
    distributed: bool = _opt(False, "join torchrun's process group: each rank (cuda:LOCAL_RANK) owns a share of every "
                                    "MoE layer's experts, with its own host arena, VRAM cache and link")
    placement_profile: Mapping[tuple[int, int], float] | None = _opt(
        None, "expected uses per (layer, expert), e.g. an engine's routing_profile: places experts so that every "
              "rank's link traffic is even (default round-robin)")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def help(cls, name: str) -> str:
        """An option's one-line description (the CLI's help text)."""
        return next(f.metadata["help"] for f in fields(cls) if f.name == name)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "EngineConfig":
        """From keyword options (API) or a config mapping (hydra): an unknown name is one clear sentence."""
        return cls().updated(values)

    def updated(self, values: Mapping[str, Any]) -> "EngineConfig":
        unknown = sorted(set(values) - set(self.names()))
        if unknown:
            raise RequestError(f"unknown engine option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
                               f"; the options are: {', '.join(self.names())}")
        return replace(self, **values)

    def check(self) -> None:
        """Every option, checked before anything is read or allocated."""
        if self.draft_experts not in DRAFT_EXPERTS:
            raise RequestError(f"draft_experts must be one of {', '.join(DRAFT_EXPERTS)}, got {self.draft_experts!r}")
        if self.late_prefetch not in LATE_PREFETCH:
            raise RequestError(f"late_prefetch must be one of {', '.join(LATE_PREFETCH)}, got {self.late_prefetch!r}")
        if self.fill_link not in FILL_LINK:
            raise RequestError(f"fill_link must be one of {', '.join(FILL_LINK)}, got {self.fill_link!r}")
        if self.predictor_path is not None and not isinstance(self.predictor_path, (str, Path)):
            raise RequestError(f"predictor_path must be the path of a predictor file, got {self.predictor_path!r}")
        if self.routing_trace is not None and not isinstance(self.routing_trace, (str, Path)):
            raise RequestError(f"routing_trace must be the path of a trace file, got {self.routing_trace!r}")
        if self.policy not in POLICIES:
            raise RequestError(f"unknown cache policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        check_halflife("lrfu_halflife", self.lrfu_halflife)
        if self.expert_dtype is not None and self.expert_dtype not in EXPERT_DTYPES:
            raise RequestError(f"expert_dtype must be one of {', '.join(EXPERT_DTYPES)}, got {self.expert_dtype!r}")
        group = self.int4_group_size
        if group is not None and (not isinstance(group, int) or isinstance(group, bool) or group < 2 or group % 2
                                  or group > 1 << 16):
            raise RequestError(f"int4_group_size must be an even number of inputs from 2 to 65536, got {group!r}")
        if self.int4_symmetric is not None and not isinstance(self.int4_symmetric, bool):
            raise RequestError(f"int4_symmetric must be True or False, got {self.int4_symmetric!r}")
        for name in ("max_batch_size", "stream_ahead", "lookahead", "draft_tokens"):
            check_positive_int(name, getattr(self, name))
        if self.verify_rows not in VERIFY_ROWS:
            raise RequestError(f"verify_rows must be one of {', '.join(VERIFY_ROWS)}, got {self.verify_rows!r}")
        if self.draft_tokens > MAX_DRAFT_TOKENS:
            raise RequestError(f"draft_tokens must be at most {MAX_DRAFT_TOKENS}, got {self.draft_tokens!r}")
        spare = self.spare_recent
        if not isinstance(spare, int) or isinstance(spare, bool) or not 0 <= spare <= 64:
            raise RequestError(f"spare_recent must be an integer from 0 to 64 (steps), got {spare!r}")
        lead = self.prefetch_lead
        if not isinstance(lead, int) or isinstance(lead, bool) or not 0 <= lead <= 4096:
            raise RequestError(f"prefetch_lead must be an integer from 0 to 4096 (MoE layers; 0: no limit), "
                               f"got {lead!r}")
        for name in ("max_inflight_experts", "stream_layers", "expert_cache_slots", "max_seq_len", "prefill_chunk",
                     "prefill_window"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        check_fraction("min_confidence", self.min_confidence, upper_open=False)
        check_fraction("fill_confidence", self.fill_confidence, upper_open=False)
        check_fraction("verify_confidence", self.verify_confidence, upper_open=False)
        if self.reuse_weight is not None:
            check_fraction("reuse_weight", self.reuse_weight, upper_open=False)
        if self.bypass is not None and not isinstance(self.bypass, bool):
            raise RequestError(f"bypass must be True, False or None (on where a learned head runs), "
                               f"got {self.bypass!r}")
        for name in ("pin_memory", "cuda_graphs", "fused_kernels", "progress", "distributed"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.predictor_path is None and (self.bypass or self.reuse_weight):  # else silently without effect
            raise RequestError(f"{'bypass' if self.bypass else 'reuse_weight'} acts on a learned routing head's "
                               f"predictions: load one with predictor_path= (train it with moeprefetch "
                               f"train-predictor), or leave it out")
        budget = self.prefetch_budget
        if budget is not None and (not isinstance(budget, (int, float)) or isinstance(budget, bool)
                                   or not math.isfinite(budget) or budget < 0):
            raise RequestError(f"prefetch_budget must be a number >= 0 (a multiple of top-k), got {budget!r}")
        check_one_cache_size([name for name in ("expert_cache_slots", "vram_budget", "expert_cache_fraction")
                              if getattr(self, name) is not None])
        if self.placement_profile is not None and not self.distributed:
            raise RequestError("placement_profile places experts over ranks: it needs distributed=True")
        if self.placement_profile is not None and not isinstance(self.placement_profile, Mapping):
            raise RequestError("placement_profile must map (layer, expert) to expected uses, like an engine's "
                               "routing_profile")
        fraction = self.expert_cache_fraction
        if fraction is not None and (not isinstance(fraction, (int, float)) or isinstance(fraction, bool)
                                     or not 0 < fraction <= 1):
            raise RequestError(f"expert_cache_fraction must be a number in (0, 1], got {fraction!r}")


def check_one_cache_size(given: Sequence[str]) -> None:
    """The one rule for the settings that size the expert cache (options, CLI flags, the planner's inputs): at most
    one of them may be given."""
    if len(given) > 1:
        raise RequestError(f"give one of {' or '.join(given)}, not both: each sizes the expert cache")


def check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise RequestError(f"{name} must be a positive integer, got {value!r}")


def check_halflife(name: str, value: Any) -> None:
    """LRFU's half-life: a number of steps above 0 and at most 1e6 (the engine's option and `replay`'s)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1e6:
        raise RequestError(f"{name} must be a number of steps above 0 and at most 1e6, got {value!r}")


def check_fraction(name: str, value: Any, upper_open: bool = True) -> None:
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0
            or (value >= 1 if upper_open else value > 1)):
        raise RequestError(f"{name} must be a number in [0, 1{')' if upper_open else ']'}, got {value!r}")
