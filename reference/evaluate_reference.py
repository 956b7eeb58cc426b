#!/usr/bin/env python
"""Evaluate a reference checkpoint written by ``reference/train_reference.py`` and write its model card.

Measured on the corpus' HELD-OUT ids:

* main-head and MTP-head loss / perplexity (teacher forced; the MTP head at position i predicts token i+2),
  top-1 accuracies of both heads;
* greedy MTP draft acceptance: greedy decoding from held-out prompts; at each step the MTP head drafts the
  token after next from (H_t, greedy token t+1), and we count how often the next greedy token equals the draft;
* per-layer expert load balance (max/mean, min/mean, normalised entropy, coefficient of variation).

The checkpoint is loaded from its HF files with the training script's own model class, so this evaluation is
independent of the inference engine. Writes ``eval.json`` and ``README.md`` into the checkpoint directory.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import shlex
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

import numpy as np
import torch
from tqdm import tqdm

LOG = logging.getLogger("evaluate_reference")


def import_train_reference() -> ModuleType:
    """Import the sibling training script as a module (reference/ is not a package)."""
    name = "train_reference"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / "train_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------------------------
# Measurements
# ----------------------------------------------------------------------------------------------------------------


def heldout_windows(ids: np.ndarray, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Non-overlapping windows of seq_len+2 tokens (stride seq_len) covering up to max_tokens predictions."""
    length = seq_len + 2
    count = min(max(1, max_tokens // seq_len), (len(ids) - length) // seq_len + 1)
    if count < 1 or len(ids) < length:
        raise ValueError("held-out set shorter than one evaluation window")
    starts = np.arange(count) * seq_len
    return torch.from_numpy(np.stack([ids[s : s + length] for s in starts]).astype(np.int64))


@torch.no_grad()
def evaluate_heads(
    model: Any, windows: torch.Tensor, batch: int, device: torch.device, amp: torch.dtype | None
) -> tuple[dict[str, float], torch.Tensor]:
    """Teacher-forced main/MTP losses and top-1 accuracies; also returns per-MoE-layer expert load counts."""
    sums = {"main_nll": 0.0, "mtp_nll": 0.0, "main_correct": 0.0, "mtp_correct": 0.0}
    loads = torch.zeros(len(model.routers()), model.cfg.n_routed_experts, dtype=torch.float64)
    count = 0
    seq = windows.shape[1] - 2
    for chunk in tqdm(windows.split(batch), desc="held-out", unit="batch", mininterval=2.0):
        chunk = chunk.to(device)
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            hidden, layer_loads, _ = model.main_hidden(chunk[:, :seq])
            main_logits = model.logits(hidden).float()
            mtp_hidden, mtp_load, _ = model.mtp_hidden(hidden, chunk[:, 1 : seq + 1])
            mtp_logits = model.logits(mtp_hidden).float()
        for key, logits, target in (
            ("main", main_logits, chunk[:, 1 : seq + 1]),
            ("mtp", mtp_logits, chunk[:, 2 : seq + 2]),
        ):
            flat = logits.reshape(-1, logits.shape[-1])
            sums[f"{key}_nll"] += float(torch.nn.functional.cross_entropy(flat, target.reshape(-1), reduction="sum"))
            sums[f"{key}_correct"] += float((flat.argmax(-1) == target.reshape(-1)).sum())
        loads += torch.stack([*layer_loads, mtp_load]).double().cpu()
        count += chunk.shape[0] * seq
    main_loss, mtp_loss = sums["main_nll"] / count, sums["mtp_nll"] / count
    metrics = {
        "tokens": count,
        "main_loss": main_loss,
        "main_ppl": math.exp(main_loss),
        "main_top1": sums["main_correct"] / count,
        "mtp_loss": mtp_loss,
        "mtp_ppl": math.exp(mtp_loss),
        "mtp_top1_teacher_forced": sums["mtp_correct"] / count,
    }
    return metrics, loads


@torch.no_grad()
def greedy_mtp_acceptance(
    model: Any, prompts: torch.Tensor, new_tokens: int, amp: torch.dtype | None
) -> dict[str, Any]:
    """Greedy decoding with an MTP draft at every step; acceptance = share of drafts the next greedy token equals.

    Each step recomputes the full (short) sequences without a KV cache: exactly what cached decoding computes,
    and simple enough to be an independent reference for the engine's MTP drafting.
    """
    device = prompts.device
    seqs = prompts
    draft: torch.Tensor | None = None
    accepted = compared = 0
    for _ in tqdm(range(new_tokens), desc="greedy", unit="tok", mininterval=2.0):
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            hidden, _, _ = model.main_hidden(seqs)
            greedy = model.logits(hidden[:, -1]).float().argmax(-1)
        if draft is not None:
            accepted += int((draft == greedy).sum())
            compared += greedy.numel()
        seqs = torch.cat([seqs, greedy[:, None]], dim=1)
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            # MTP pairs (H_j, token j+1) for every j; the last pair uses the token just decoded.
            mtp_hidden, _, _ = model.mtp_hidden(hidden, seqs[:, 1:])
            draft = model.logits(mtp_hidden[:, -1]).float().argmax(-1)
    return {
        "prompts": prompts.shape[0],
        "prompt_len": prompts.shape[1],
        "new_tokens": new_tokens,
        "drafts_compared": compared,
        "drafts_accepted": accepted,
        "acceptance": accepted / compared if compared else float("nan"),
    }


def sample_prompts(ids: np.ndarray, count: int, length: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(ids) - length, size=count)
    return torch.from_numpy(np.stack([ids[s : s + length] for s in starts]).astype(np.int64))


def balance_stats(names: list[str], loads: torch.Tensor, top_k: int) -> list[dict[str, Any]]:
    """Per-layer load balance from expert selection counts."""
    rows = []
    for name, load in zip(names, loads):
        mean = float(load.mean())
        share = load / load.sum()
        entropy = float(-(share[share > 0] * share[share > 0].log()).sum())
        rows.append(
            {
                "layer": name,
                "tokens": int(round(float(load.sum()) / top_k)),
                "max_over_mean": float(load.max()) / mean,
                "min_over_mean": float(load.min()) / mean,
                "entropy_normalised": entropy / math.log(load.numel()),
                "cv": float(load.std(unbiased=False)) / mean,
                "dead_experts": int((load == 0).sum()),
            }
        )
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Model card
# ----------------------------------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 4) -> str:
    """Human-readable cell: bools as true/false, big numbers with separators, tiny floats in e-notation."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.2e}"
        return f"{value:.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return "n/a" if value is None else str(value)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def data_section(corpus_dir: Path, train_log: dict[str, Any]) -> str:
    corpus = train_log.get("corpus", {})
    lines = [
        f"- Corpus directory: `{corpus_dir}`; train tokens {_fmt(corpus.get('train_tokens'))}, "
        f"held-out tokens {_fmt(corpus.get('heldout_tokens'))}.",
        "- Documents are joined by the eos id 1; training samples random contiguous windows.",
    ]
    manifest_path = corpus_dir / "manifest.json"
    if not manifest_path.exists():
        return "\n".join(lines + ["- No `manifest.json` in the corpus directory."])
    manifest = json.loads(manifest_path.read_text())
    sources = manifest.get("sources") if isinstance(manifest, dict) else None
    if isinstance(sources, list):
        lines.append("- Sources (from `manifest.json`):")
        for source in sources:
            if isinstance(source, dict):
                desc = ", ".join(f"{k}: {v}" for k, v in source.items() if not isinstance(v, (dict, list)))
                lines.append(f"  - {desc}")
            else:
                lines.append(f"  - {source}")
    else:
        text = json.dumps(manifest, indent=2)
        lines += ["- `manifest.json`:", "", "```json", text[:3000] + ("\n..." if len(text) > 3000 else ""), "```"]
    return "\n".join(lines)


def tokenizer_section(ckpt_dir: Path, vocab_size: int) -> str:
    path = ckpt_dir / "tokenizer.json"
    kind = "unknown"
    if path.exists():
        kind = json.loads(path.read_text()).get("model", {}).get("type", "unknown")
    return (
        f"- `tokenizer.json` ({kind}, vocab {vocab_size:,}) and `tokenizer_config.json` copied from the corpus; "
        "bos id 0, eos id 1."
    )


def architecture_table(cfg: dict[str, Any]) -> str:
    keys = [
        "vocab_size", "hidden_size", "num_hidden_layers", "first_k_dense_replace", "num_nextn_predict_layers",
        "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
        "v_head_dim", "intermediate_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
        "n_group", "topk_group", "n_shared_experts", "routed_scaling_factor", "scoring_func", "topk_method",
        "norm_topk_prob", "rope_interleave", "rope_theta", "max_position_embeddings", "rms_norm_eps",
        "tie_word_embeddings",
    ]
    return _table(["field", "value"], [[k, cfg.get(k)] for k in keys])


def render_model_card(
    ckpt_dir: Path, corpus_dir: Path, cfg: dict[str, Any], train_log: dict[str, Any], result: dict[str, Any]
) -> str:
    params = train_log.get("parameters", {})
    env = train_log.get("environment", {})
    heads = result["heldout"]
    acc = result["greedy_mtp"]
    disk = result["size_on_disk_bytes"]
    balance_rows = [
        [r["layer"], r["max_over_mean"], r["min_over_mean"], r["entropy_normalised"], r["cv"], r["dead_experts"]]
        for r in result["load_balance"]
    ]
    targs = train_log.get("args", {})
    amp = targs.get("dtype", "auto")
    if amp == "auto":
        amp = "bf16" if str(env.get("device", "")).startswith("cuda") else "fp32"
    train_rows = [
        ["tokens seen", train_log.get("tokens_seen")],
        ["batch × seq len", f"{targs.get('batch_size')} × {targs.get('seq_len')}"],
        ["peak lr / warmup steps", f"{targs.get('lr')} / {targs.get('warmup_steps')}"],
        ["MTP loss weight", targs.get("mtp_weight")],
        ["bias step γ / seq-aux α", f"{targs.get('bias_update_gamma')} / {targs.get('seq_aux_alpha')}"],
        ["compute dtype", amp],
        ["steps", train_log.get("steps")],
        ["stopped by", train_log.get("stopped_by")],
        ["training wall time (s)", train_log.get("train_wall_time_s")],
        ["throughput (tokens/s, overall)", train_log.get("tokens_per_s")],
        ["throughput (tokens/s, after first step)", train_log.get("tokens_per_s_after_first_step")],
        ["final train loss (main / MTP)",
         f"{_fmt(train_log.get('final_train_loss'))} / {_fmt(train_log.get('final_train_mtp_loss'))}"],
        ["final held-out loss during training (main / MTP)",
         f"{_fmt(train_log.get('final_heldout_loss'))} / {_fmt(train_log.get('final_heldout_mtp_loss'))}"],
        ["device", env.get("gpu") or env.get("device")],
        ["torch / CUDA", f"{env.get('torch')} / {env.get('cuda')}"],
        ["torch.compile", train_log.get("compiled")],
    ]
    sections = [
        "# moeprefetch reference model (DeepSeek-V3 architecture, tiny)",
        "A small DeepSeek-V3-architecture language model with one multi-token-prediction (MTP) layer, trained from "
        "scratch by `reference/train_reference.py` as a realistic, non-random routing and MTP-drafting workload for "
        "the moeprefetch engine. It is loadable with `transformers.DeepseekV3ForCausalLM.from_pretrained(dir)`; "
        f"the MTP layer is stored as `model.layers.{cfg['num_hidden_layers']}.*` (DeepSeek layout, embedding and "
        "head shared with the main model and not duplicated).",
        "## Data",
        data_section(corpus_dir, train_log),
        "## Tokenizer",
        tokenizer_section(ckpt_dir, cfg["vocab_size"]),
        "## Architecture",
        architecture_table(cfg),
        f"Parameters: {_fmt(params.get('total'))} total (main model {_fmt(params.get('main_model'))}, MTP layer "
        f"{_fmt(params.get('mtp_layer'))}; activated per token in the main model "
        f"{_fmt(params.get('activated_main_per_token'))}). Size on disk: {disk / 1e6:.2f} MB of safetensors "
        "(bf16; `mlp.gate.weight` and `mlp.gate.e_score_correction_bias` in fp32).",
        "## Training",
        _table(["what", "value"], train_rows),
        "AdamW (β 0.9/0.95, weight decay on matrices), linear warmup + cosine (time-aware under a time budget), "
        "gradient clipping, auxiliary-loss-free load balancing (correction-bias step γ after every optimizer step) "
        "plus DeepSeek-V3's sequence-wise balance loss; the MTP loss back-propagates into the trunk. Full log: "
        "`training_log.json`.",
        "## Held-out evaluation",
        _table(
            ["head", "loss", "perplexity", "top-1 accuracy"],
            [
                ["main (next token)", heads["main_loss"], heads["main_ppl"], heads["main_top1"]],
                ["MTP (token after next, teacher forced)", heads["mtp_loss"], heads["mtp_ppl"],
                 heads["mtp_top1_teacher_forced"]],
            ],
        ),
        f"Evaluated on {heads['tokens']:,} held-out predictions (windows of {result['seq_len']} tokens).",
        f"**Greedy MTP draft acceptance: {acc['acceptance']:.4f}** ({acc['drafts_accepted']:,} of "
        f"{acc['drafts_compared']:,} drafts; {acc['prompts']} held-out prompts of {acc['prompt_len']} tokens, "
        f"{acc['new_tokens']} greedy tokens each). A draft is the MTP head's argmax for token t+2 made from "
        "(H_t, greedy token t+1); it is accepted when greedy decoding then produces the same token.",
        "## Expert load balance (held-out text)",
        _table(["MoE layer", "max/mean", "min/mean", "entropy (normalised)", "CV", "dead experts"], balance_rows),
        "## Reproduce",
        "```bash\n" + train_log.get("command", "python reference/train_reference.py ...") + "\n"
        + result["command"] + "\n```",
    ]
    return "\n\n".join(sections) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="compute dtype (bf16 = autocast)")
    p.add_argument("--moe-impl", default="auto", choices=["auto", "dense", "sparse"],
                   help="auto: dense on cuda, sparse on cpu (identical results)")
    p.add_argument("--max-tokens", type=int, default=200_000, help="held-out predictions to evaluate")
    p.add_argument("--seq-len", type=int, default=None, help="default: the training seq len")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p


def checkpoint_disk_bytes(ckpt_dir: Path) -> int:
    return sum(p.stat().st_size for p in ckpt_dir.glob("*.safetensors"))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tr = import_train_reference()
    device = tr.resolve_device(args.device)
    amp = torch.bfloat16 if args.dtype == "bf16" else None

    t0 = time.perf_counter()
    model = tr.load_checkpoint(args.checkpoint, device)
    impl = args.moe_impl if args.moe_impl != "auto" else ("dense" if device.type == "cuda" else "sparse")
    model.set_moe_impl(impl)
    log_path = args.checkpoint / "training_log.json"
    train_log = json.loads(log_path.read_text()) if log_path.exists() else {}
    seq_len = args.seq_len or train_log.get("args", {}).get("seq_len", 512)
    heldout = np.load(args.corpus / "heldout_ids.npy")
    LOG.info("loaded %s (%s MoE) on %s; %d held-out tokens", args.checkpoint, impl, device, len(heldout))

    windows = heldout_windows(heldout, seq_len, args.max_tokens)
    heads, loads = evaluate_heads(model, windows, args.batch_size, device, amp)
    prompts = sample_prompts(heldout, args.num_prompts, args.prompt_len, args.seed).to(device)
    acceptance = greedy_mtp_acceptance(model, prompts, args.new_tokens, amp)
    result = {
        "checkpoint": str(args.checkpoint),
        "command": "python reference/evaluate_reference.py " + shlex.join(argv),
        "device": str(device),
        "dtype": args.dtype,
        "moe_impl": impl,
        "seq_len": seq_len,
        "heldout": heads,
        "greedy_mtp": acceptance,
        "load_balance": balance_stats(model.moe_layer_names(), loads, model.cfg.num_experts_per_tok),
        "parameters": tr.count_parameters(model),
        "size_on_disk_bytes": checkpoint_disk_bytes(args.checkpoint),
        "eval_wall_time_s": time.perf_counter() - t0,
    }
    (args.checkpoint / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    cfg = json.loads((args.checkpoint / "config.json").read_text())
    card = render_model_card(args.checkpoint, args.corpus, cfg, train_log, result)
    (args.checkpoint / "README.md").write_text(card)
    print(
        f"held-out main loss {heads['main_loss']:.4f} (ppl {heads['main_ppl']:.2f}), MTP loss {heads['mtp_loss']:.4f} "
        f"(ppl {heads['mtp_ppl']:.2f}, top-1 {heads['mtp_top1_teacher_forced']:.3f}), greedy MTP acceptance "
        f"{acceptance['acceptance']:.3f}; wrote eval.json and README.md to {args.checkpoint}"
    )
    return result


if __name__ == "__main__":
    main()
