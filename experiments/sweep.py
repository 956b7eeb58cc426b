#!/usr/bin/env python
"""Hydra sweeps over cache size, policy, predictor and lookahead; one tidy JSON row per point.

    python experiments/sweep.py -m cache.fraction=0.125,0.25,0.5 \\
        predictor=none,previous,next_layer_gate,mtp,mtp_router,mtp_gate,oracle lookahead=1,2
    moeprefetch report multirun/<date>/<time>/results.jsonl

Every point runs the same held-out prompts: one untimed warm-up generation, then one measured generation per prompt,
each from an empty expert cache. A point that fails is recorded as failed and the sweep goes on; rows are appended
one at a time, so rows already written are never lost. Only this directory imports hydra; the package never does.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import platform
import subprocess
import sys
import time
import traceback
from functools import lru_cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from moeprefetch.accounting import merge_stats  # noqa: E402
from moeprefetch.options import EngineConfig  # noqa: E402

logger = logging.getLogger("sweep")



def _resolve(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else ROOT / p


def _predictor_path(cfg: DictConfig) -> str | None:
    """The learned predictor's head (predictor.predictor_path), resolved like the model's path."""
    path = cfg.predictor.get("predictor_path", None)
    return str(_resolve(path)) if path else None


def engine_config(cfg: DictConfig) -> EngineConfig:
    """The composed config groups as the engine's one option type (the API and the CLI build the same)."""
    device = cfg.device.name
    # the cache group gives at most one size (conf/cache: quarter, slots, budget, resident); an override that adds
    # another is refused by EngineConfig's one rule (options.check_one_cache_size), never resolved silently here
    slots = int(cfg.cache.slots) if cfg.cache.slots is not None else None
    fraction = float(cfg.cache.fraction) if cfg.cache.fraction is not None else None
    return EngineConfig(
        device=device, dtype=cfg.model.dtype or ("bfloat16" if device.startswith("cuda") else "float32"),
        expert_cache_slots=slots, expert_cache_fraction=fraction,
        vram_budget=cfg.cache.budget or None, policy=cfg.cache.policy, expert_dtype=cfg.model.expert_dtype,
        int4_group_size=cfg.model.get("int4_group_size", EngineConfig.int4_group_size),
        int4_symmetric=cfg.model.get("int4_symmetric", EngineConfig.int4_symmetric),
        lrfu_halflife=float(cfg.cache.get("lrfu_halflife", EngineConfig.lrfu_halflife)),
        prefetch_budget=_optional(cfg.predictor.get("prefetch_budget"), float),
        max_inflight_experts=cfg.predictor.max_inflight_experts,
        draft_experts=cfg.predictor.get("draft_experts", "cached"),
        verify_confidence=float(cfg.predictor.get("verify_confidence", EngineConfig.verify_confidence)),
        draft_tokens=int(cfg.predictor.get("draft_tokens", EngineConfig.draft_tokens)),
        verify_rows=str(cfg.predictor.get("verify_rows", EngineConfig.verify_rows)),
        spare_recent=int(cfg.predictor.get("spare_recent", 1)),
        prefetch_lead=int(cfg.predictor.get("prefetch_lead", EngineConfig.prefetch_lead)),
        fill_confidence=float(cfg.predictor.get("fill_confidence", EngineConfig.fill_confidence)),
        fill_link=str(cfg.predictor.get("fill_link", EngineConfig.fill_link)), cuda_graphs=bool(cfg.device.cuda_graphs),
        predictor_path=_predictor_path(cfg),
        reuse_weight=_optional(cfg.predictor.get("reuse_weight"), float),
        bypass=_optional(cfg.predictor.get("bypass"), bool),
        max_batch_size=int(cfg.workload.batch), progress=False)


def _optional(value: Any, kind: type) -> Any:
    """A predictor setting left out or null: None, the engine's default for the call's predictor."""
    return None if value is None else kind(value)


@lru_cache(maxsize=4)
def _engine(path: str, config: EngineConfig):
    """Engines are reused across points that differ only in per-call settings (predictor, lookahead)."""
    from moeprefetch import MoEPrefetchEngine

    return MoEPrefetchEngine.from_pretrained(_resolve(path), config=config)


def load_prompts(cfg: DictConfig) -> list[str]:
    lines = _resolve(cfg.workload.prompts_file).read_text().splitlines()
    prompts = [json.loads(line)["text"] for line in lines if line.strip()]
    return prompts[: int(cfg.workload.num_prompts)]


def _environment(device: str) -> dict[str, Any]:
    import torch
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "host": platform.node(), "timestamp": _dt.datetime.now().isoformat(timespec="seconds")}
    env["device_name"] = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                           cwd=ROOT, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    return env


def run_point(cfg: DictConfig) -> dict[str, Any]:
    """Run one sweep point and return its row (config, environment, merged statistics)."""
    config = {
        "model": cfg.model.path,
        "device": cfg.device.name,
        "dtype": cfg.model.dtype,
        "expert_dtype": cfg.model.expert_dtype,
        "int4_group_size": cfg.model.get("int4_group_size", EngineConfig.int4_group_size),
        "int4_symmetric": cfg.model.get("int4_symmetric", EngineConfig.int4_symmetric),
        "cache_slots_requested": cfg.cache.slots,
        "cache_fraction_requested": cfg.cache.fraction,
        "cache_budget": cfg.cache.budget,
        "policy": cfg.cache.policy,
        "lrfu_halflife": float(cfg.cache.get("lrfu_halflife", EngineConfig.lrfu_halflife)),
        "predictor": cfg.predictor.name,
        "prefetch_budget": _optional(cfg.predictor.get("prefetch_budget"), float),  # None: the predictor's default
        "min_confidence": float(cfg.predictor.get("min_confidence", 0.0)),
        "draft_experts": cfg.predictor.get("draft_experts", "cached"),
        "verify_confidence": float(cfg.predictor.get("verify_confidence", EngineConfig.verify_confidence)),
        "draft_tokens": int(cfg.predictor.get("draft_tokens", EngineConfig.draft_tokens)),
        "verify_rows": str(cfg.predictor.get("verify_rows", EngineConfig.verify_rows)),
        "spare_recent": int(cfg.predictor.get("spare_recent", 1)),
        "prefetch_lead": int(cfg.predictor.get("prefetch_lead", EngineConfig.prefetch_lead)),
        "fill_confidence": float(cfg.predictor.get("fill_confidence", EngineConfig.fill_confidence)),
        "fill_link": str(cfg.predictor.get("fill_link", EngineConfig.fill_link)),
        "reuse_weight": _optional(cfg.predictor.get("reuse_weight"), float),
        "bypass": _optional(cfg.predictor.get("bypass"), bool),
        "predictor_path": _predictor_path(cfg),
        "lookahead": int(cfg.lookahead),
        "speculative": cfg.speculative,
        "batch": int(cfg.workload.batch),
        "new_tokens": int(cfg.workload.new_tokens),
        "temperature": float(cfg.workload.temperature),
    }
    row: dict[str, Any] = {**config, **_environment(cfg.device.name)}
    start = time.perf_counter()
    try:
        engine = _engine(cfg.model.path, engine_config(cfg))
        prompts = load_prompts(cfg)
        batch = int(cfg.workload.batch)
        batches = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        kwargs = dict(max_new_tokens=int(cfg.workload.new_tokens), temperature=float(cfg.workload.temperature),
                      seed=int(cfg.workload.seed), predictor=cfg.predictor.name, lookahead=int(cfg.lookahead),
                      speculative=cfg.speculative, stop_at_eos=False,
                      min_confidence=float(cfg.predictor.get("min_confidence", 0.0)))
        if cfg.warmup:
            engine.reset_expert_cache(forget_routing=True)
            engine.generate(batches[0], **{**kwargs, "max_new_tokens": min(8, kwargs["max_new_tokens"])})
        runs = []
        for prompt_batch in batches:
            engine.reset_expert_cache(forget_routing=True)
            runs.append(engine.generate(prompt_batch, **kwargs).stats)
        row.update(merge_stats(runs).to_dict())
        slots = engine.residency.n_slots
        row.update(status="ok", cache_slots=slots, total_experts=engine.plan.total_experts,
                   verify_rows=engine.options.verify_rows,  # what ran: without an MTP layer, separate
                   # what the calls ran where the predictor's defaults decided (session.prefetch_settings)
                   reuse_weight_run=engine.residency.cfg.reuse_weight, bypass_run=engine.residency.cfg.bypass,
                   fill_budget_per_layer=engine.residency.cfg.budget_per_target,
                   cache_fraction=slots / engine.plan.total_experts, prompt_count=len(prompts),
                   expert_bytes=engine.residency.expert_bytes, memory=engine.memory_stats())
    except Exception as exc:  # a failed point is recorded, and the sweep goes on
        row.update(status="failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(limit=5))
        logger.error("point failed: %s", row["error"])
    row["wall_seconds"] = time.perf_counter() - start
    return row


def results_path(cfg: DictConfig) -> Path:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    out = Path(hc.runtime.output_dir)
    base = out.parent if hc.mode == RunMode.MULTIRUN else out
    return base / cfg.results_file


def append_row(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:  # append-only: a crash later never loses rows already written
        fh.write(json.dumps(row, default=str) + "\n")
        fh.flush()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    row = run_point(cfg)
    path = results_path(cfg)
    append_row(path, row)
    brief = {k: row.get(k) for k in ("status", "predictor", "lookahead", "policy", "cache_slots", "hit_rate",
                                      "prediction_recall_main_layers", "ms_per_token")}
    logger.info("%s -> %s", json.dumps(brief, default=str), path)
    OmegaConf.save(cfg, Path(path.parent, ".last_config.yaml"))


if __name__ == "__main__":
    main()
