#!/usr/bin/env python
"""GPU benchmark: moeprefetch against the PCIe floor and the Hugging Face peer, on one GPU.

Workloads
  ref17      the shipped reference model with each routed expert padded to ~17 MB (extra gate/up rows random, the
             matching down-projection columns zero, so the function is unchanged): learned routing and MTP drafts at
             DeepSeek-V2-Lite's transfer size;
  v2lite     DeepSeek-V2-Lite's shape (27 layers, 64 experts top-6, hidden 2048) with random weights, written as a
             sharded safetensors checkpoint and loaded through the normal path;
  v3layers   DeepSeek-V3's layer shape (hidden 7168, 256 experts top-8, 88 MB bf16 experts), 1 dense + 2 MoE layers.

Rows per workload (same prompts, same budget): all_resident (compute-only bound), hf_accelerate (transformers +
accelerate device_map offload at the same budget), none (reactive LRU), next_layer_gate, mtp, mtp+next_layer_gate,
oracle, speculative_mtp; and the floor = max(all-resident time, bytes Belady-optimal replacement must move / measured
host->device bandwidth). Every measured run starts from an empty expert cache after a warm-up run; medians over runs.

    python scripts/bench_gpu.py --out experiments/results/bench_h200.json
    python scripts/bench_gpu.py --device cpu --scale tiny --out /tmp/bench.json   # exercise the script on a CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import logging
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moeprefetch import MoEPrefetchEngine  # noqa: E402
from moeprefetch.analysis import belady_bytes_per_token  # noqa: E402
from moeprefetch.checkpoint import CheckpointReader  # noqa: E402
from moeprefetch.expert_records import EXPERT_DTYPES  # noqa: E402
from moeprefetch.options import FILL_LINK, LATE_PREFETCH, POLICIES, VERIFY_ROWS, EngineConfig, check_fraction  # noqa: E402

logger = logging.getLogger("bench_gpu")
GiB = 1024**3

# ---- shapes -------------------------------------------------------------------------------------------------------

V2LITE = dict(
    model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
    num_experts_per_tok=6, first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=False,
    topk_method="greedy", n_group=1, topk_group=1, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
    v_head_dim=128, qk_nope_head_dim=128, max_position_embeddings=163840, rms_norm_eps=1e-6, bos_token_id=0,
    eos_token_id=1, tie_word_embeddings=False, hidden_act="silu", scoring_func="softmax",
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}, rope_theta=10000,
)
V3LAYERS = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=3, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
    num_experts_per_tok=8, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    topk_method="noaux_tc", n_group=8, topk_group=4, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
    v_head_dim=128, qk_nope_head_dim=128, max_position_embeddings=163840, rms_norm_eps=1e-6, bos_token_id=0,
    eos_token_id=1, tie_word_embeddings=False, hidden_act="silu", scoring_func="sigmoid", num_nextn_predict_layers=0,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}, rope_theta=10000,
)


# Qwen3-30B-A3B's shape (48 layers of 128 experts, top-8, expert intermediate 768). `qwen3_30b` writes its experts in
# FP8 with block scales, as Qwen3-30B-A3B-FP8 is published (~31 GB: the bf16 model's 61 GB does not fit the GPU
# machine's 64 GiB disk beside the rest); `qwen3_30b_layers` keeps bf16 and its first N layers (--qwen3-layers)
QWEN3_30B = dict(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643,
    eos_token_id=151645, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
    use_sliding_window=False,
)


def tiny(shape: dict[str, Any]) -> dict[str, Any]:
    """A CPU-sized version of a shape, for checking the script itself."""
    small = dict(shape, vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
                 qk_nope_head_dim=16, n_routed_experts=16, max_position_embeddings=4096)
    small["num_hidden_layers"] = min(shape["num_hidden_layers"], 4)
    if shape.get("q_lora_rank"):
        small["q_lora_rank"] = 24
    if shape["model_type"] == "qwen3_moe":
        small.update(head_dim=16, num_experts=16, num_key_value_heads=2)
    else:
        small["n_group"] = min(shape["n_group"], 4)
        small["topk_group"] = min(shape["topk_group"], 2)
    small["num_experts_per_tok"] = min(shape["num_experts_per_tok"], 4)
    return small


# ---- environment --------------------------------------------------------------------------------------------------


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(device)}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / GiB
        try:
            query = "pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,driver_version"
            line = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                                  text=True, timeout=20).stdout.strip().splitlines()[0]
            gen, gen_max, width, driver = [p.strip() for p in line.split(",")]
            env.update(pcie_gen=gen, pcie_gen_max=gen_max, pcie_width=width, driver=driver)
        except Exception as exc:  # nvidia-smi is informative only
            env["pcie_error"] = str(exc)
    try:
        env["host_ram_gib"] = int(open("/proc/meminfo").readline().split()[1]) / 1024**2
    except OSError:
        pass
    env.update(host_memory_bandwidth())
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                           cwd=ROOT).stdout.strip() or None
    except Exception:
        env["git_commit"] = None
    # the code that ran, whatever the copy's git metadata says (a device's copy of the tree may carry a stale .git)
    digest = hashlib.sha1()
    for source in sorted((ROOT / "moeprefetch").rglob("*.py")):
        digest.update(source.read_bytes())
    env["source_sha1"] = digest.hexdigest()[:12]
    return env


def _median_time(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    times = []
    for i in range(repeats + 2):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1000
        else:
            t = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t
        if i >= 2:  # two warm-up repetitions excluded
            times.append(elapsed)
    return statistics.median(times)


def link_bandwidth(device: torch.device, sizes_mib: tuple[int, ...] = (17, 88, 256)) -> dict[str, float]:
    """Measured host->device GB/s (pinned and pageable) and device-memory copy GB/s (read + write)."""
    out: dict[str, float] = {}
    if device.type != "cuda":
        return out
    for mib in sizes_mib:
        n = mib * 1024**2
        dst = torch.empty(n, dtype=torch.uint8, device=device)
        pinned = torch.empty(n, dtype=torch.uint8).pin_memory()
        pageable = torch.empty(n, dtype=torch.uint8)
        pinned.fill_(1)
        pageable.fill_(1)
        out[f"h2d_pinned_{mib}mib_gbps"] = n / _median_time(lambda: dst.copy_(pinned, non_blocking=True), device, 10) / 1e9
        out[f"h2d_pageable_{mib}mib_gbps"] = n / _median_time(lambda: dst.copy_(pageable), device, 5) / 1e9
        del dst, pinned, pageable
    n = 4 * GiB
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty(n, dtype=torch.uint8, device=device)
    out["hbm_copy_gbps"] = 2 * n / _median_time(lambda: b.copy_(a), device, 10) / 1e9
    del a, b
    torch.cuda.empty_cache()
    out["h2d_peak_gbps"] = max(v for k, v in out.items() if k.startswith("h2d_pinned"))
    out.update(scale_placement(device))
    return out


def scale_placement(device: torch.device) -> dict[str, float]:
    """Do FP8 block scales need to stay in VRAM while the payload streams? Time moving 8 FP8 experts of
    V2-Lite shape (payload + scales in one record) against moving the payload alone (scales kept resident) and
    against payload and scales as two copies each."""
    from moeprefetch.expert_records import ExpertFormat

    fmt = ExpertFormat.build(2048, 1408, torch.bfloat16, "fp8")
    n = 8
    host = torch.empty(n, fmt.record_bytes, dtype=torch.uint8).pin_memory()
    host.fill_(3)
    dev = torch.empty(n, fmt.record_bytes, dtype=torch.uint8, device=device)
    payload = fmt.payload_bytes + 2 * 64  # the payload regions incl. alignment padding, scales excluded
    first_scale = min(r.offset for k, r in fmt.regions.items() if k.endswith("_scale"))

    def whole() -> None:
        for i in range(n):
            dev[i].copy_(host[i], non_blocking=True)

    def payload_only() -> None:
        for i in range(n):
            dev[i, :first_scale].copy_(host[i, :first_scale], non_blocking=True)

    def split() -> None:
        for i in range(n):
            dev[i, :first_scale].copy_(host[i, :first_scale], non_blocking=True)
            dev[i, first_scale:].copy_(host[i, first_scale:], non_blocking=True)

    t_whole = _median_time(whole, device, 20)
    t_payload = _median_time(payload_only, device, 20)
    t_split = _median_time(split, device, 20)
    return {"fp8_record_bytes": fmt.record_bytes, "fp8_scale_bytes": fmt.scale_bytes,
            "fp8_8_records_ms": 1000 * t_whole, "fp8_8_payloads_only_ms": 1000 * t_payload,
            "fp8_8_records_two_copies_ms": 1000 * t_split, "fp8_payload_bytes": payload}


# ---- checkpoints --------------------------------------------------------------------------------------------------


FP8_BLOCK = (128, 128)


def random_v2lite_engine(workdir: Path, name: str, scale: str, device: torch.device, budget_gib: float,
                         **options: Any) -> MoEPrefetchEngine:
    """The serving and prefill benches' engine: V2-Lite's shape (tiny at --scale tiny) on random weights written
    under workdir/name, in bf16 on CUDA (fp32 elsewhere), at `budget_gib` GiB at full scale (no budget at tiny
    scale); `options` are the bench's own engine options."""
    shape = tiny(V2LITE) if scale == "tiny" else V2LITE
    path = write_random_checkpoint(workdir / name, shape, device)
    return MoEPrefetchEngine.from_pretrained(
        path, device=str(device), dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, progress=False,
        vram_budget=f"{budget_gib}GiB" if scale == "full" else None, **options)


def write_random_checkpoint(out: Path, shape: dict[str, Any], device: torch.device, seed: int = 0,
                            shard_bytes: int = 4 * GiB, fp8_experts: bool = False) -> Path:
    """A random-weight checkpoint with real tensor names, generated shard by shard (bounded host RAM). With
    `fp8_experts` the routed experts are FP8 with 128x128 block scales (`weight_scale_inv`), as DeepSeek-V3's and
    Qwen3-30B-A3B-FP8's releases are."""
    from safetensors.torch import save_file

    from moeprefetch.quant import quantize_fp8_blocks

    # the index is written last and names what was generated: a complete checkpoint of the same shape, seed and
    # expert format is reused (one device call runs several benches over it; writing V2-Lite's takes ~60 s)
    # (the device too: one seed draws other numbers on the CPU and on CUDA)
    made = json.loads(json.dumps({"shape": shape, "seed": seed, "fp8_experts": fp8_experts,
                                  "device": torch.device(device).type}))
    index_path = out / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            if json.loads(index_path.read_text()).get("metadata", {}).get("random_checkpoint") == made:
                return out
        except ValueError:
            pass
        index_path.unlink()  # a rewrite cut short must never pass for the checkpoint the old index names
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(shape)
    architecture = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                    "qwen3_moe": "Qwen3MoeForCausalLM"}[cfg["model_type"]]
    if fp8_experts:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(FP8_BLOCK)}
    (out / "config.json").write_text(json.dumps({**cfg, "architectures": [architecture], "torch_dtype": "bfloat16"},
                                                indent=1))
    generator = torch.Generator(device=device).manual_seed(seed)
    names = _tensor_shapes(cfg)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    weight_map, files = {}, []

    def flush() -> None:
        index = len(files) + 1
        name = f"model-{index:05d}.safetensors"
        save_file(shards[-1], str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shards[-1]})
        files.append(name)

    for name, tensor_shape in names:
        if name.endswith("norm.weight"):
            tensor = torch.ones(tensor_shape, dtype=torch.bfloat16)
        elif name.endswith("e_score_correction_bias"):
            tensor = torch.zeros(tensor_shape, dtype=torch.float32)
        else:
            std = 0.02 if not name.endswith("mlp.gate.weight") else 0.05
            tensor = (torch.randn(tensor_shape, generator=generator, device=device) * std).to(torch.bfloat16)
            if fp8_experts and ".mlp.experts." in name:
                payload, scale = quantize_fp8_blocks(tensor, FP8_BLOCK)
                tensors = {name: payload.cpu(), name.removesuffix(".weight") + ".weight_scale_inv": scale.cpu()}
            else:
                tensor = tensor.cpu()
        if not (fp8_experts and ".mlp.experts." in name):
            tensors = {name: tensor}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if shards[-1] and size + nbytes > shard_bytes:
            flush()
            shards.append({})
            size = 0
        shards[-1].update(tensors)
        size += nbytes
    flush()
    index_path.write_text(json.dumps({"metadata": {"random_checkpoint": made}, "weight_map": weight_map}))
    return out


def _qwen3_tensor_shapes(c: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen3-MoE's published names: grouped-query attention with q/k norms, every layer MoE (no shared expert)."""
    h, d = c["hidden_size"], c["head_dim"]
    q, kv, e, i = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["num_experts"], c["moe_intermediate_size"]
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        shapes += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,)),
                   (f"{p}.self_attn.q_proj.weight", (q, h)), (f"{p}.self_attn.k_proj.weight", (kv, h)),
                   (f"{p}.self_attn.v_proj.weight", (kv, h)), (f"{p}.self_attn.o_proj.weight", (h, q)),
                   (f"{p}.self_attn.q_norm.weight", (d,)), (f"{p}.self_attn.k_norm.weight", (d,)),
                   (f"{p}.mlp.gate.weight", (e, h))]
        for x in range(e):
            shapes += _mlp_shapes(f"{p}.mlp.experts.{x}", i, h)
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"], h))]
    return shapes


def _mlp_shapes(prefix: str, intermediate: int, hidden: int) -> list[tuple[str, tuple[int, ...]]]:
    """A gated MLP's three projections (a dense MLP, the shared experts, or one routed expert)."""
    return [(f"{prefix}.gate_proj.weight", (intermediate, hidden)), (f"{prefix}.up_proj.weight", (intermediate, hidden)),
            (f"{prefix}.down_proj.weight", (hidden, intermediate))]


def _tensor_shapes(c: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    if c["model_type"] == "qwen3_moe":
        return _qwen3_tensor_shapes(c)
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for layer in range(layers):
        shapes += _layer_shapes(c, layer)
    if c.get("num_nextn_predict_layers"):  # DeepSeek's MTP layer after the main ones, with its own head
        p = f"model.layers.{layers}"
        shapes += _layer_shapes(c, layers) + [
            (f"{p}.enorm.weight", (h,)), (f"{p}.hnorm.weight", (h,)), (f"{p}.eh_proj.weight", (h, 2 * h)),
            (f"{p}.shared_head.norm.weight", (h,)), (f"{p}.shared_head.head.weight", (c["vocab_size"], h))]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"], h))]
    return shapes


def _layer_shapes(c: dict[str, Any], layer: int) -> list[tuple[str, tuple[int, ...]]]:
    """One MLA decoder layer's tensors: dense before first_k_dense_replace, MoE after."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    shapes: list[tuple[str, tuple[int, ...]]] = []
    p = f"model.layers.{layer}"
    shapes += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,))]
    if c.get("q_lora_rank"):
        shapes += [(f"{p}.self_attn.q_a_proj.weight", (c["q_lora_rank"], h)),
                   (f"{p}.self_attn.q_a_layernorm.weight", (c["q_lora_rank"],)),
                   (f"{p}.self_attn.q_b_proj.weight", (heads * qk, c["q_lora_rank"]))]
    else:
        shapes.append((f"{p}.self_attn.q_proj.weight", (heads * qk, h)))
    shapes += [
        (f"{p}.self_attn.kv_a_proj_with_mqa.weight", (c["kv_lora_rank"] + c["qk_rope_head_dim"], h)),
        (f"{p}.self_attn.kv_a_layernorm.weight", (c["kv_lora_rank"],)),
        (f"{p}.self_attn.kv_b_proj.weight", (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])),
        (f"{p}.self_attn.o_proj.weight", (h, heads * c["v_head_dim"])),
    ]
    if layer < c["first_k_dense_replace"]:
        return shapes + _mlp_shapes(f"{p}.mlp", c["intermediate_size"], h)
    e, i = c["n_routed_experts"], c["moe_intermediate_size"]
    shapes.append((f"{p}.mlp.gate.weight", (e, h)))
    if c["model_type"] == "deepseek_v3":
        shapes.append((f"{p}.mlp.gate.e_score_correction_bias", (e,)))
    s = i * c["n_shared_experts"]
    shapes += _mlp_shapes(f"{p}.mlp.shared_experts", s, h)
    for x in range(e):
        shapes += _mlp_shapes(f"{p}.mlp.experts.{x}", i, h)
    return shapes


def write_padded_reference(src: Path, out: Path, target_expert_bytes: int, seed: int = 0) -> Path:
    """The reference model with routed experts padded to ~target bytes: extra gate/up rows random, the matching
    down-projection columns zero, so every expert computes the same function at a large model's transfer size."""
    from safetensors.torch import save_file

    marker = out / ".padded"  # a complete earlier write of the same source and size is reused (tens of GB for deep)
    made_from = f"{src.resolve()}:{(src / 'model.safetensors.index.json').stat().st_mtime_ns}:{target_expert_bytes}"
    if marker.is_file() and marker.read_text() == made_from:
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    h, i = config["hidden_size"], config["moe_intermediate_size"]
    padded = max(i, int(round(target_expert_bytes / (3 * h * 2) / 64)) * 64)
    config["moe_intermediate_size"] = padded
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            (out / name).write_bytes((src / name).read_bytes())
    reader = CheckpointReader(src)
    generator = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, weight_map, files = 0, {}, []

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shards[-1], str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shards[-1]})
        files.append(name)

    for name in sorted(reader.tensors):
        tensor = reader.read(name)
        if ".mlp.experts." in name or ".mlp.shared_experts." in name:
            # shared experts have n_shared x moe_intermediate_size rows: pad them the same way (function unchanged)
            width = tensor.shape[0] if not name.endswith("down_proj.weight") else tensor.shape[1]
            extra = width // i * padded - width
            std = float(tensor.float().std())
            if name.endswith(("gate_proj.weight", "up_proj.weight")):
                pad = (torch.randn(extra, h, generator=generator) * std).to(tensor.dtype)
                tensor = torch.cat((tensor, pad), dim=0)
            else:
                tensor = torch.cat((tensor, torch.zeros(h, extra, dtype=tensor.dtype)), dim=1)
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > 2 * GiB:
            flush()
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    marker.write_text(made_from)
    return out


# ---- measurement --------------------------------------------------------------------------------------------------


def rss_gib() -> float:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return float("nan")


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options that every offloaded engine of a run takes from the command line."""
    return dict(policy=args.policy, lrfu_halflife=args.lrfu_halflife, prefetch_lead=args.prefetch_lead)


def format_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The expert format of every engine of a run (all-resident too): --expert-dtype and, for int4, its settings
    (the engine refuses int4 settings beside another format)."""
    int4 = args.expert_dtype == "int4"
    return dict(expert_dtype=args.expert_dtype, int4_group_size=args.int4_group_size if int4 else None,
                int4_symmetric=args.int4_symmetric if int4 else None)


def host_memory_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, Any]:
    """The host's memory bandwidth as a multi-threaded copy of `nbytes` (torch's CPU copy splits it over every
    thread), median of `repeats`: read + write bytes per second, so a CPU-side expert path can be judged against
    the link."""
    threads = torch.get_num_threads()
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {"host_copy_gbps": nbytes / seconds / 1e9, "host_copy_read_write_gbps": 2 * nbytes / seconds / 1e9,
            "host_copy_threads": threads, "host_copy_bytes": nbytes}


def run_row(engine: MoEPrefetchEngine, system: str, prompts: list[list[int]], new_tokens: int, *,
            predictor: str = "none", speculative: str | None = None, runs: int = 3,
            lookahead: int | None = None, min_confidence: float = 0.0, batch: int = 1, temperature: float = 0.0,
            seed: int = 0) -> dict[str, Any]:
    """Warm-up once, then `runs` measured generations (one per prompt, or `batch` prompts at once; cold expert cache
    and no routing history each); medians. Per-token figures count the tokens of every row. Greedy, or sampled at
    `temperature` with `seed` (seeded sampling draws the same tokens from the same logits, so rows stay comparable)."""
    device = engine.device
    kwargs = dict(predictor=predictor, speculative=speculative, stop_at_eos=False, lookahead=lookahead,
                  min_confidence=min_confidence, temperature=temperature, seed=seed)
    engine.reset_expert_cache(forget_routing=True)
    engine.generate([prompts[i % len(prompts)] for i in range(batch)], max_new_tokens=min(8, new_tokens), **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    results, sequences = [], []
    for run in range(runs):
        engine.reset_expert_cache(forget_routing=True)
        result = engine.generate([prompts[(run + i) % len(prompts)] for i in range(batch)], max_new_tokens=new_tokens,
                                 **kwargs)
        results.append(result.stats.to_dict())
        sequences.append(result.sequences[0] if batch == 1 else result.sequences)
    med = lambda key: statistics.median(r.get(key) or 0.0 for r in results)  # noqa: E731
    decode_tokens = statistics.median(r["generated_tokens"] - 1 for r in results)
    row = {
        "system": system,
        "batch": batch,
        "predictor": predictor,
        "lookahead": lookahead or engine.options.lookahead,
        "prefetch_lead": engine.options.prefetch_lead,
        "policy": engine.options.policy,
        "lrfu_halflife": engine.options.lrfu_halflife,
        "min_confidence": min_confidence,
        "fill_confidence": engine.options.fill_confidence,
        "fill_link": engine.options.fill_link,
        "reuse_weight": engine.residency.cfg.reuse_weight,  # what the calls ran (the learned head's defaults)
        "bypass": engine.residency.cfg.bypass,
        "fill_budget_per_layer": engine.residency.cfg.budget_per_target,  # fills per (step, layer); 0: protection only
        "verify_rows": engine.options.verify_rows,  # what ran (a checkpoint without an MTP layer runs separate)
        "spare_recent": engine.residency.cfg.spare_recent,  # what the calls ran (oracles spare nothing)
        "max_inflight_experts": engine.options.max_inflight_experts,
        "routing_trace": engine.options.routing_trace,
        "speculative": speculative,
        "temperature": temperature,
        "seed": seed,
        "expert_dtype": engine.options.expert_dtype,
        "runs": runs,
        "new_tokens": new_tokens,
        "ms_per_token": med("ms_per_token"),
        "decode_tokens_per_s": med("decode_tokens_per_s"),
        "prefill_tokens_per_s": med("prefill_tokens_per_s"),
        "ttft_seconds": med("ttft_seconds"),
        "hit_rate": med("hit_rate"),
        "decode_hit_rate": med("decode_hit_rate"),
        "misses_per_token": med("decode_misses_per_token"),
        "syncs_per_token": med("syncs_per_token"),
        "decode_bytes_h2d_per_token": med("decode_bytes_h2d_per_token"),
        "zero_copy_bytes_per_token": med("zero_copy_bytes_per_token"),
        "fill_bytes_per_token": med("fill_bytes_per_token"),
        "streamed_bytes_per_token": med("streamed_bytes_per_token"),
        "stream_stall_ms_per_token": med("stream_stall_ms_per_token"),
        "decode_h2d_gbps": statistics.median(
            r["decode_bytes_h2d_per_token"] / max(r["ms_per_token"], 1e-9) / 1e6 for r in results),
        "bytes_h2d_per_token": med("bytes_h2d") / max(decode_tokens, 1),
        "prediction_recall": med("prediction_recall_main_layers"),
        "prediction_recall_by_lead": [statistics.median(v) for v in zip(*(
            [x if x is not None else 0.0 for x in r["prediction_recall_by_lead"]] for r in results))],
        "prediction_precision": med("prediction_precision_main_layers"),
        "prefetch_waste": med("prefetch_waste"),
        "prefetch_issued": med("prefetch_issued"),
        "prefetch_useful": med("prefetch_useful"),
        "prefetch_late": med("prefetch_late"),
        "prefetch_wasted": med("prefetch_wasted"),
        "draft_acceptance": med("draft_acceptance") if speculative else None,
        "tokens_per_verify_step": med("tokens_per_verify_step") if speculative else None,
        "draft_tokens": engine.options.draft_tokens if speculative else None,
        # per draft position over every run: of the drafts reached (those before kept) and checked, the share kept
        "draft_acceptance_by_position": _acceptance_by_position(results) if speculative else None,
        # speculation: the share of verify rows whose draft was checked (verify_confidence), and tokens per step
        "drafts_checked_share": statistics.median(r["draft_proposed"] / max(r["draft_offered"], 1) for r in results)
        if speculative else None,
        "tokens_per_step": statistics.median((r["generated_tokens"] - 1) / max(r["decode_steps"], 1)
                                             for r in results),  # batch 1, as decode_tokens above
        "mtp_draft_accuracy": med("mtp_draft_accuracy"),
        "cache_slots": engine.residency.n_slots,
        "peak_vram_gib": torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None,
        "host_ram_gib": rss_gib(),
        "host_pinned_gib": engine.memory_stats()["host_pinned_bytes"] / GiB,
        "cuda_graphs": bool(engine._steps) and all(step.captured for step in engine._steps.values()),
        "sequences": sequences,
    }
    return row


# the timeline's kernel groups ("await": layers waiting for late fills, which "other" hid until the fourteenth session)
KERNEL_GROUPS = (("plan", ("_plan_kernel", "_step_start_kernel")), ("experts", ("_gate_up_kernel", "_down_kernel",
                                                                                  "_combine_kernel")),
                 ("await", ("_await_kernel",)), ("fill", ("_fill_kernel",)))


def _acceptance_by_position(results: list[dict[str, Any]]) -> list[float | None]:
    """Each draft position's acceptance over several calls' statistics (`Stats.to_dict()`), their counts summed."""
    positions = max((len(r.get("draft_proposed_by_position") or []) for r in results), default=0)
    reached, kept = [0] * positions, [0] * positions
    for r in results:
        for j, (n, k) in enumerate(zip(r.get("draft_proposed_by_position") or [],
                                       r.get("draft_accepted_by_position") or [])):
            reached[j] += n
            kept[j] += k
    return [k / n if n else None for k, n in zip(kept, reached)]


def timeline(engine: MoEPrefetchEngine, prompt: list[int] | list[list[int]], new_tokens: int,
             predictor: str, temperature: float = 0.0, seed: int = 0, speculative: str | None = None
             ) -> dict[str, Any]:
    """Where a decode token's time goes, from a CUDA trace of the replayed step graphs (torch.profiler/CUPTI).

    Per decode step (ms; one step is one token of every row, so per token at batch 1): wall time; busy time of the
    main stream; the plan, routed-expert and other kernels on it; fill kernels on the side stream, and how much of
    them overlapped main-stream work. Also the kernel list of one step (start offset and duration in microseconds,
    stream) for a picture of a single step. `prompt`: one prompt, or a batch of them. `speculative="mtp"`: a step is a
    verify step (tokens per step reported beside it)."""
    prompts = prompt if prompt and isinstance(prompt[0], list) else [prompt]
    from torch.profiler import ProfilerActivity, profile

    engine.reset_expert_cache(forget_routing=True)
    sampling = dict(temperature=temperature, seed=seed, speculative=speculative)
    engine.generate(prompts, max_new_tokens=min(8, new_tokens), predictor=predictor, stop_at_eos=False, **sampling)
    engine.reset_expert_cache(forget_routing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = engine.generate(prompts, max_new_tokens=new_tokens, predictor=predictor, stop_at_eos=False,
                                 **sampling)
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() >= 0]
    if not kernels:
        return {"timeline_error": "the profiler recorded no kernels"}
    steps = [e for e in kernels if e.name.startswith("_step_start_kernel")]
    decode_start = steps[-result.stats.decode_steps].time_range.start if result.stats.decode_steps else 0
    decode = [e for e in kernels if e.time_range.start >= decode_start]
    fill_streams = {getattr(e, "device_resource_id", None) for e in decode if e.name.startswith("_fill_kernel")}

    def group(name: str) -> str:
        for label, prefixes in KERNEL_GROUPS:
            if name.startswith(prefixes):
                return label
        return "other"

    tokens = max(result.stats.decode_steps, 1)  # per step (= per token at batch 1)
    main = [e for e in decode if getattr(e, "device_resource_id", None) not in fill_streams or group(e.name) != "fill"]
    side = [e for e in decode if group(e.name) == "fill"]
    totals: dict[str, float] = {}
    for e in main:
        totals[group(e.name)] = totals.get(group(e.name), 0.0) + e.time_range.elapsed_us()
    busy = _union([(e.time_range.start, e.time_range.end) for e in main])
    fills = _union([(e.time_range.start, e.time_range.end) for e in side])
    overlap = _intersection([(e.time_range.start, e.time_range.end) for e in main],
                            [(e.time_range.start, e.time_range.end) for e in side])
    last = max(e.time_range.end for e in decode)
    out = {f"{k}_ms_per_token": v / 1000 / tokens for k, v in totals.items()}
    by_name: dict[str, list[float]] = {}
    for e in main:
        entry = by_name.setdefault(e.name[:60], [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.elapsed_us()
    out["kernels_per_token"] = sum(n for n, _ in by_name.values()) / tokens
    out["by_kernel"] = sorted(([name, n / tokens, us / 1000 / tokens] for name, (n, us) in by_name.items()),
                              key=lambda row: -row[2])[:30]  # [name, launches/token, ms/token]
    out.update(wall_ms_per_token=(last - decode_start) / 1000 / tokens, main_busy_ms_per_token=busy / 1000 / tokens,
               fill_ms_per_token=fills / 1000 / tokens, fill_overlapped_ms_per_token=overlap / 1000 / tokens,
               decode_steps=tokens, batch=len(prompts), speculative=speculative,
               tokens_per_step=(result.stats.generated_tokens - 1) / tokens,
               ms_per_token_untraced=result.stats.to_dict()["ms_per_token"],
               ms_per_step_untraced=result.stats.decode_seconds * 1000 / tokens)
    if len(steps) >= 2:  # one whole step, for a picture
        a, b = steps[-2].time_range.start, steps[-1].time_range.start
        out["one_step"] = [(round(e.time_range.start - a, 1), round(e.time_range.elapsed_us(), 1), group(e.name),
                            e.name[:40]) for e in decode if a <= e.time_range.start < b]
    return out


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return _union(a) + _union(b) - _union(a + b)


def hf_accelerate_row(path: Path, budget_gib: float, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """transformers + accelerate device_map offload under max_memory: what a Hugging Face user would do."""
    from transformers import AutoModelForCausalLM

    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.bfloat16, device_map="auto",
        max_memory={0: f"{budget_gib}GiB", "cpu": "200GiB"},
    ).eval()
    load_s = time.perf_counter() - t
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
        torch.cuda.synchronize()
        total = time.perf_counter() - t
    generated = out.shape[1] - ids.shape[1]
    row = {"system": "hf_accelerate", "load_seconds": load_s, "new_tokens": generated, "cache_fraction": None,
           "h2d_gbps": None, "hit_rate": None, "stall_ms_per_token": None, "prefill_tokens_per_s": None,
           "ms_per_token": 1000 * total / generated, "decode_tokens_per_s": generated / total,
           "peak_vram_gib": torch.cuda.max_memory_allocated() / GiB, "host_ram_gib": rss_gib(),
           "note": "prefill included in the per-token time (generate() does not split it); warm-up excluded; "
                   "accelerate exposes no expert-level counters, so cache_fraction, h2d_gbps, hit_rate, stall and "
                   "prefill are null"}
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return row


# ---- workloads ----------------------------------------------------------------------------------------------------


def prompts_for(path: Path, corpus: Path | None, vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    if corpus is not None and corpus.is_file() and (path / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
        lines = [json.loads(line) for line in corpus.read_text().splitlines() if line.strip()]
        step = max(len(lines) // count, 1)
        return [tokenizer(lines[i * step]["text"])["input_ids"] for i in range(count)]
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=generator).tolist() for _ in range(count)]


@dataclasses.dataclass
class WorkloadRun:
    """What every row of one workload's decode run shares: its prompts, sampling, engine options and the row fields
    they all carry; the all-resident tokens every later row is checked against, once measured."""
    name: str
    path: Path
    args: argparse.Namespace
    device: torch.device
    link: dict[str, float]
    emit: Callable[[dict[str, Any]], None]
    prompts: list[list[int]]
    sampling: dict[str, Any]
    common: dict[str, Any]
    base: dict[str, Any]
    reference: list | None = None  # the all-resident run's sequences
    resident_ms: float | None = None
    total_experts: int | None = None

    def fail(self, system: str, exc: Exception, limit: int | None = 4) -> None:
        self.emit({**self.base, "system": system, "failed": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc(limit=limit)})

    def checked(self, row: dict[str, Any]) -> dict[str, Any]:
        """A row with whether its tokens are the all-resident run's (when that run gave any)."""
        if self.reference is not None:
            row["same_tokens_as_all_resident"] = row["sequences"] == self.reference
        return row

    def resident_row(self, engine: MoEPrefetchEngine, system: str, predictor: str) -> None:
        """A predictor's row on the all-resident engine: its own compute at no link bytes."""
        try:
            self.emit({**self.base, "vram_budget_gib": None, "cache_fraction": 1.0,
                       **run_row(engine, system, self.prompts, self.args.new_tokens, predictor=predictor,
                                 runs=self.args.runs, **self.sampling)})
        except Exception as exc:
            self.fail(system, exc)

    def timeline_row(self, engine: MoEPrefetchEngine, system: str, predictor: str, **options: Any) -> None:
        """A per-op split of the first prompt's generation (its own row: a failed profile loses no other row)."""
        try:
            self.emit({**self.base, "system": system,
                       **timeline(engine, self.prompts[0], self.args.new_tokens, predictor, **options,
                                  **self.sampling)})
        except Exception as exc:
            self.fail(system, exc)


def bench_workload(name: str, path: Path, args: argparse.Namespace, device: torch.device, link: dict[str, float],
                   emit: Callable[[dict[str, Any]], None]) -> None:
    """Every decode row of one workload: all-resident, then one offloaded engine running every asked predictor on
    the same prompts and budget, the floor, compressed experts, and transformers' offload (v2lite)."""
    run = workload_run(name, path, args, device, link, emit)
    resident_rows(run)
    _free()
    offload_kwargs = offloaded_options(run)
    engine = offloaded_engine(run, offload_kwargs)
    if engine is not None:
        fraction = plan_row(run, engine)
        predictor_rows(run, engine, fraction)
        if args.profile:
            offloaded_timelines(run, engine)
        floor_row(run, engine, fraction)
        engine.close()
        del engine
        _free()
    for expert_dtype in args.expert_dtypes.split(",") if args.expert_dtypes else []:
        quantized_rows(run, offload_kwargs, expert_dtype)
        _free()
    if name == "v2lite" and args.hf_baseline and device.type == "cuda":
        try:
            emit({**run.base, **hf_accelerate_row(path, args.budget_gib, run.prompts[0], args.hf_tokens)})
        except Exception as exc:
            emit({**run.base, "system": "hf_accelerate", "failed": f"{type(exc).__name__}: {exc}"})
        _free()


def workload_run(name: str, path: Path, args: argparse.Namespace, device: torch.device, link: dict[str, float],
                 emit: Callable[[dict[str, Any]], None]) -> WorkloadRun:
    config = json.loads((path / "config.json").read_text())
    learned = name in ("ref17", "deep")  # trained checkpoints: held-out text as prompts, a share of experts cached
    prompts = prompts_for(path, args.corpus if learned else None, config["vocab_size"], args.runs,
                          args.prompt_tokens, seed=1)
    common = dict(device=str(device), dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                  max_seq_len=args.max_seq_len, max_batch_size=1, progress=False, **format_settings(args),
                  draft_tokens=longest_chain(args.systems), verify_rows=args.verify_rows)
    if name == "v2lite_trace":  # every engine, all-resident too, routes decode steps from the trace
        common["routing_trace"] = str(routing_trace_for(args, config))
    if head := learned_head_for(name, path, args):
        common["predictor_path"] = str(head)
    dtype_tag = "" if args.expert_dtype == "model" else f"@{args.expert_dtype}"
    base = {"workload": name + dtype_tag + (f"#{args.variant}" if args.variant else ""), "batch": 1,
            **format_settings(args), "verify_rows": args.verify_rows,
            "prompt_tokens": [len(p) for p in prompts], "vram_budget_gib": args.budget_gib}
    # every generation of the workload, the floor's included, samples alike
    sampling = dict(temperature=args.temperature, seed=args.seed)
    return WorkloadRun(name, path, args, device, link, emit, prompts, sampling, common, base)


def asked(args: argparse.Namespace, system: str) -> bool:
    """Whether --systems asks for a row (every row when it names none)."""
    return not args.systems or system in args.systems.split(",")


def resident_rows(run: WorkloadRun) -> None:
    """All-resident: the compute-only bound, and the tokens every later row is checked against; the MTP head's, the
    learned head's and speculation's cost at no link bytes, when the model has them and --systems asks."""
    args = run.args
    if args.systems and not any(system.split("~")[0] in ("all_resident", "all_resident_speculative")
                                for system in args.systems.split(",")):
        return  # all_resident skipped (--systems)
    try:
        engine = one_draft(MoEPrefetchEngine.from_pretrained(run.path, **run.common))
        row = run_row(engine, "all_resident", run.prompts, args.new_tokens, runs=args.runs, **run.sampling)
    except Exception as exc:
        run.fail("all_resident", exc, limit=3)
        return
    run.resident_ms = row["ms_per_token"]
    run.total_experts = engine.plan.total_experts
    active = _active_bytes(engine)
    row.update(active_bytes_per_token=active, hbm_gbps=active / (run.resident_ms / 1000) / 1e9, cache_fraction=1.0,
               expert_bytes=engine.residency.expert_bytes, total_experts=run.total_experts)
    run.emit({**run.base, **row, "vram_budget_gib": None})
    run.reference = row["sequences"]
    if engine.has_mtp and asked(args, "all_resident_mtp"):
        # the compute the MTP machinery adds (shadow row and head) when no byte crosses the link
        run.resident_row(engine, "all_resident_mtp", "mtp")
        if args.profile:
            run.timeline_row(engine, "all_resident_mtp_timeline", "mtp")
    if engine.has_mtp and args.systems:  # speculation with every expert resident (issue 39's first aim)
        resident_speculation_rows(engine, run.base, run.prompts, args, run.sampling, run.reference, run.emit)
        if args.profile and "all_resident_speculative" in args.systems.split(","):  # where a verify step goes
            run.timeline_row(engine, "all_resident_speculative_timeline", "none", speculative="mtp")
    if engine.runner.learned_head is not None and asked(args, "all_resident_learned"):
        # the learned head's own cost (and link 1 of the MTP head, when the head reads it) at no link bytes
        run.resident_row(engine, "all_resident_learned", "learned")
    if args.profile:
        run.timeline_row(engine, "all_resident_timeline", "none")
    engine.close()
    del engine


def offloaded_options(run: WorkloadRun) -> dict[str, Any]:
    """The offloaded engine's options: the run's settings, and the budget (random shapes) or a share of the experts
    cached (the trained models, and a cut of Qwen3-30B-A3B's layers: --cache-fraction)."""
    args = run.args
    options = dict(run.common, max_inflight_experts=args.max_inflight, draft_experts=args.draft_experts,
                   spare_recent=args.spare_recent, late_prefetch=args.late_prefetch,
                   fill_confidence=args.fill_confidence, fill_link=args.fill_link, **engine_settings(args))
    if run.name not in ("ref17", "deep", "qwen3_30b_layers"):
        options["vram_budget"] = f"{args.budget_gib}GiB"
    elif run.total_experts:
        options["expert_cache_slots"] = max(int(round(args.cache_fraction * run.total_experts)), 8)
    else:  # no all-resident row counted the experts (--systems skipped it): the engine takes the share itself (a
        # fixed 40 slots here once measured a 30 % row of the deep model at 2.3 %, thirty-fifth session)
        options["expert_cache_fraction"] = args.cache_fraction
    return options


def offloaded_engine(run: WorkloadRun, options: dict[str, Any]) -> MoEPrefetchEngine | None:
    """One engine (one store fill) for every offloaded row, or None when none is asked for or it cannot load. A
    budget that holds every expert (int4 at 12 GiB, say) gives that engine's row as the budget's answer."""
    args = run.args

    def resident_at_budget(engine: MoEPrefetchEngine) -> None:
        row = run_row(engine, "resident_at_budget", run.prompts, args.new_tokens, runs=args.runs, **run.sampling)
        row.update(cache_fraction=1.0, expert_bytes=engine.residency.expert_bytes, plan=engine.plan.describe(),
                   peak_vram_gib=torch.cuda.max_memory_allocated() / GiB if run.device.type == "cuda" else None)
        run.emit({**run.base, **run.checked(row)})

    # only resident rows asked for: a budget that holds every expert needs no offloaded engine after its row
    resident_only = bool(args.systems) and all(system.startswith("all_resident") or system == "resident_at_budget"
                                               for system in args.systems.split(","))
    if resident_only and "resident_at_budget" not in args.systems.split(","):
        return None  # no offloaded row asked for: no offloaded engine (a padded deep model loads for tens of s)
    try:
        engine = load_offloaded(run.path, options, args.cache_fraction,
                                when_resident=resident_at_budget if "vram_budget" in options else None,
                                reload=not resident_only)
    except Exception as exc:
        run.emit({**run.base, "system": "offload_load", "failed": f"{type(exc).__name__}: {exc}"})
        return None
    return one_draft(engine) if engine is not None else None


def plan_row(run: WorkloadRun, engine: MoEPrefetchEngine) -> float:
    """The offloaded engine's plan and store as a row; returns the share of experts its cache holds."""
    store = engine.residency.store
    if store is None:  # --cache-fraction 1.0: every expert resident (speculation's resident rows, say)
        run.emit({**run.base, "system": "plan", "plan": engine.plan.describe(), "cache_fraction": 1.0})
        return 1.0
    fraction = engine.residency.n_slots / engine.plan.total_experts
    run.emit({**run.base, "system": "plan", "plan": engine.plan.describe(), "cache_fraction": fraction,
              "cache_slots": engine.residency.n_slots, "store_load_seconds": store.load_seconds,
              "pin_seconds": store.pin_seconds, "host_expert_gib": store.nbytes / GiB,
              "host_pinned_gib": store.pinned_bytes / GiB,
              "store_fill_gbps": store.nbytes / max(store.load_seconds, 1e-9) / 1e9})
    return fraction


def planned_systems(engine: MoEPrefetchEngine, args: argparse.Namespace) -> list[tuple]:
    """The offloaded rows to run: (row name, predictor, speculative, lookahead, min_confidence, engine option
    overrides); the default list, or --systems' rows (with their modifiers) that this model can run, and each again
    at --lead-rows' leads and --policy-rows' policies."""
    cuts = [float(v) for v in str(args.min_confidence).split(",") if v]

    def with_cuts(name: str) -> list[tuple]:
        """The predictor uncut, then at every confidence cut (the '@' rows)."""
        return [(name, name, None, None, 0.0)] + [(f"{name}@{cut}", name, None, None, cut) for cut in cuts]

    systems = [("none", "none", None, None, 0.0), *with_cuts("next_layer_gate"),
               ("oracle", "oracle", None, args.oracle_lookahead, 0.0), ("oracle_next", "oracle_next", None, None, 0.0)]
    if engine.has_mtp:
        systems += [*with_cuts("mtp"), *with_cuts("mtp+next_layer_gate"), ("mtp_router", "mtp_router", None, None, 0.0),
                    ("mtp_router+next_layer_gate", "mtp_router+next_layer_gate", None, None, 0.0),
                    ("speculative_mtp", "none", "mtp", None, 0.0),
                    ("speculative_mtp+next_layer_gate", "next_layer_gate", "mtp", None, 0.0)]
        # MTP drafts chained 2 and 3 tokens ahead (issue 21)
        systems += [(f"{name}_la{k}", name, None, k, 0.0) for name in ("mtp", "mtp+next_layer_gate") for k in (2, 3)]
    if engine.runner.learned_head is not None:  # a trained routing head (issue 38): 1..its leads tokens ahead
        leads = engine.runner.learned_head.config.leads
        systems += [("learned", "learned", None, 1, 0.0), ("learned+next_layer_gate", "learned+next_layer_gate",
                                                            None, 1, 0.0)]
        systems += [(f"learned_la{k}", "learned", None, k, 0.0) for k in range(2, leads + 1)]
    # every row runs with the run's engine options (--fill-confidence, --fill-link, --spare-recent, ...) unless its name
    # says otherwise (~fillC, ~idle, ~reuseW, ~spareN, ~inflightN: `modified_row`)
    systems = [(*s, {}) for s in systems]
    if args.systems:
        known = {s[0]: s for s in systems}
        # rows this model cannot run (MTP rows without an MTP layer, say) are left out, as in the default list
        systems = [known.get(name) or modified_row(name, known) for name in args.systems.split(",")
                   if name.split("~")[0] in known]
    # the same predictors with other prefetch leads ('~lead' rows) and cache policies ('~policy' rows, reactive too)
    leads = [int(v) for v in args.lead_rows.split(",") if v]
    policies = [v for v in args.policy_rows.split(",") if v]
    return list(systems) + \
        [(f"{s[0]}~lead{lead}", *s[1:5], {**s[5], "prefetch_lead": lead}) for lead in leads for s in systems
         if s[1] != "none"] + \
        [(f"{s[0]}~{policy}", *s[1:5], {**s[5], "policy": policy}) for policy in policies for s in systems
         if s[1] != "oracle"]  # the oracle's victims are Belady's whatever the policy


def predictor_rows(run: WorkloadRun, engine: MoEPrefetchEngine, fraction: float) -> None:
    """Every planned offloaded row on the one engine, whose options change between calls."""
    run_options = engine.options
    for system, predictor, speculative, lookahead, min_confidence, overrides in planned_systems(engine, run.args):
        engine.options = dataclasses.replace(run_options, **overrides)
        try:
            row = run_row(engine, system, run.prompts, run.args.new_tokens, predictor=predictor,
                          speculative=speculative, runs=run.args.runs, lookahead=lookahead,
                          min_confidence=min_confidence, **run.sampling)
            row["cache_fraction"] = fraction
            run.emit({**run.base, **run.checked(row)})
        except Exception as exc:
            run.fail(system, exc)
    engine.options = run_options


def offloaded_timelines(run: WorkloadRun, engine: MoEPrefetchEngine) -> None:
    """--profile's offloaded timelines: --profile-predictors, or reactive, the oracle and the best predictor;
    'speculative_mtp' (or 'speculative_mtp+<predictor>') profiles verify steps."""
    default = ("none", "oracle", "mtp+next_layer_gate" if engine.has_mtp else "next_layer_gate")
    chosen = run.args.profile_predictors.split(",") if run.args.profile_predictors else default
    run_options = engine.options
    for name in chosen:  # a name may carry a row's modifiers ('learned~budget0~reuse0.7~bypass': `modified_row`)
        predictor = name.split("~")[0]
        overrides = row_overrides(name)
        speculative = "mtp" if predictor.startswith("speculative_mtp") else None
        underlying = predictor.removeprefix("speculative_mtp").removeprefix("+") or "none" if speculative \
            else predictor
        engine.options = dataclasses.replace(run_options, **overrides)
        try:
            run.timeline_row(engine, f"timeline_{name}", underlying, speculative=speculative)
        finally:
            engine.options = run_options


def floor_row(run: WorkloadRun, engine: MoEPrefetchEngine, fraction: float) -> None:
    """The floor: Belady-optimal replacement on the true routing of the measured runs, at the engine's slots."""
    try:
        floors = []
        for prompt in run.prompts:
            engine.reset_expert_cache(forget_routing=True)
            floors.append(belady_bytes_per_token(engine, prompt, run.args.new_tokens, **run.sampling))
        bytes_per_token = statistics.median(floors)
        transfer_ms = 1000 * bytes_per_token / (run.link.get("h2d_peak_gbps", float("nan")) * 1e9)
        run.emit({**run.base, "system": "floor", "belady_bytes_per_token": bytes_per_token,
                  "transfer_floor_ms_per_token": transfer_ms,
                  "floor_ms_per_token": max(run.resident_ms or 0.0, transfer_ms),
                  "h2d_peak_gbps": run.link.get("h2d_peak_gbps"), "cache_slots": engine.residency.n_slots,
                  "cache_fraction": fraction})
    except Exception as exc:
        run.fail("floor", exc, limit=None)


def quantized_rows(run: WorkloadRun, offload_kwargs: dict[str, Any], expert_dtype: str) -> None:
    """--expert-dtypes: compressed experts on the wire at the same budget or slot count, reactive and the best
    predictor."""
    try:
        int4 = dict(int4_group_size=run.args.int4_group_size, int4_symmetric=run.args.int4_symmetric) \
            if expert_dtype == "int4" else dict(int4_group_size=None, int4_symmetric=None)
        quantized = MoEPrefetchEngine.from_pretrained(run.path, **{**offload_kwargs, "expert_dtype": expert_dtype,
                                                                   **int4})
        store = quantized.residency.store  # None when the budget holds every compressed expert
        best = "mtp+next_layer_gate" if quantized.has_mtp else "next_layer_gate"
        for predictor in ("none", best):
            row = run_row(quantized, f"{predictor}@{expert_dtype}", run.prompts, run.args.new_tokens,
                          predictor=predictor, runs=run.args.runs, **run.sampling)
            row.update(cache_fraction=quantized.residency.n_slots / quantized.plan.total_experts,
                       expert_bytes=quantized.residency.expert_bytes,
                       host_expert_gib=store.nbytes / GiB if store is not None else None)
            run.emit({**run.base, **run.checked(row)})
        quantized.close()
        del quantized
    except Exception as exc:
        run.fail(f"quantized@{expert_dtype}", exc)


def bench_decode_compute(name: str, path: Path, args: argparse.Namespace, device: torch.device,
                         emit: Callable[[dict[str, Any]], None]) -> None:
    """Every expert resident: decode at a short and a 4,096-token context, the fused kernels against the torch
    definitions (`fused_kernels=False`), and batches 1-16 (the decode-compute rows); then batches 1-16 offloaded."""
    config = json.loads((path / "config.json").read_text())
    short = prompts_for(path, None, config["vocab_size"], args.runs, args.prompt_tokens, seed=1)
    context = min(4096, config["max_position_embeddings"] - 2 * args.new_tokens)
    long = prompts_for(path, None, config["vocab_size"], 2, context, seed=2)
    base = {"workload": name + (f"#{args.variant}" if args.variant else ""), "vram_budget_gib": None,
            "cache_fraction": 1.0}
    common = dict(device=str(device), dtype=torch.bfloat16, progress=False, max_batch_size=1, **engine_settings(args))

    wanted = set(args.systems.split(",")) if args.systems else None

    def row(engine: MoEPrefetchEngine, system: str, prompts: list[list[int]], runs: int, new_tokens: int,
            batch: int = 1) -> dict[str, Any] | None:
        if wanted is not None and system not in wanted:
            return None
        out = run_row(engine, system, prompts, new_tokens, runs=runs, batch=batch)
        active = _active_bytes(engine)
        out.update(active_bytes_per_token=active, prompt_tokens=[len(p) for p in prompts],
                   hbm_gbps=active / (out["ms_per_token"] * batch / 1000) / 1e9 if batch == 1 else None)
        emit({**base, **out})
        return out

    for fused in (True, False):
        suffix = "" if fused else "_unfused"
        if wanted is not None and not {"all_resident" + suffix, "all_resident_ctx4096" + suffix} & wanted:
            continue
        try:
            engine = MoEPrefetchEngine.from_pretrained(path, **common, max_seq_len=context + 2 * args.new_tokens,
                                                       fused_kernels=fused)
            row(engine, "all_resident" + suffix, short, args.runs, args.new_tokens)
            row(engine, "all_resident_ctx4096" + suffix, long, 2, args.new_tokens)
            if args.profile and fused:
                emit({**base, "system": "all_resident_timeline",
                      **timeline(engine, short[0], args.new_tokens, "none")})
            engine.close()
        except Exception as exc:
            emit({**base, "system": "all_resident" + suffix, "failed": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc(limit=4)})
        _free()
    resident_batch_rows(path, args, config, common, base, emit, wanted, row)
    offloaded_batch_rows(path, args, config, common, base, emit, wanted)
    prefill_rows(path, args, config, common, base, emit, wanted)


def resident_batch_rows(path: Path, args: argparse.Namespace, config: dict[str, Any], common: dict[str, Any],
                        base: dict[str, Any], emit: Callable[[dict[str, Any]], None], wanted: set[str] | None,
                        row: Callable[..., dict[str, Any] | None]) -> None:
    """Decode throughput of batches 1-16, every expert resident (`all_resident_b{n}`), with the step timelines of
    batches 1 and 8 under --profile."""
    if wanted is not None and not {f"all_resident_b{batch}" for batch in (1, 4, 8, 16)} & wanted:
        return
    try:
        engine = MoEPrefetchEngine.from_pretrained(path, **{**common, "max_batch_size": 16},
                                                   max_seq_len=args.prompt_tokens + 2 * args.new_tokens)
        many = prompts_for(path, None, config["vocab_size"], 16, args.prompt_tokens, seed=3)
        for batch in (1, 4, 8, 16):
            row(engine, f"all_resident_b{batch}", many, 2, args.new_tokens, batch=batch)
            profiled = args.profile and engine.device.type == "cuda" and batch in (1, 8)
            if profiled and (wanted is None or f"all_resident_b{batch}" in wanted):
                emit({**base, "system": f"all_resident_b{batch}_timeline",
                      **timeline(engine, many[:batch], args.new_tokens, "none")})
        engine.close()
    except Exception as exc:
        emit({**base, "system": "all_resident_batches", "failed": f"{type(exc).__name__}: {exc}",
              "traceback": traceback.format_exc(limit=4)})
    _free()


def offloaded_batch_rows(path: Path, args: argparse.Namespace, config: dict[str, Any], common: dict[str, Any],
                         base: dict[str, Any], emit: Callable[[dict[str, Any]], None], wanted: set[str] | None) -> None:
    """Decode throughput of batches 1-16 with the experts offloaded (`--budget-gib`): reactive (`offloaded_b{n}`)
    and `next_layer_gate` (`offloaded_gate_b{n}`); an expert's bytes cross the link once per step whatever the rows.
    Under --profile also the step timelines of batches 1 and 4."""
    names = {f"offloaded{tag}_b{batch}" for tag in ("", "_gate") for batch in (1, 4, 8, 16)}
    if wanted is not None and not names & wanted:
        return
    try:
        engine = load_offloaded(path, dict(common, max_batch_size=16, vram_budget=f"{args.budget_gib}GiB",
                                           max_seq_len=args.prompt_tokens + 2 * args.new_tokens), args.cache_fraction)
        budget = args.budget_gib if engine.plan.budget_bytes is not None else None  # None: the fixed share
        many = prompts_for(path, None, config["vocab_size"], 16, args.prompt_tokens, seed=3)
        fraction = engine.residency.n_slots / engine.plan.total_experts
        for tag, predictor in (("", "none"), ("_gate", "next_layer_gate")):
            for batch in (1, 4, 8, 16):
                system = f"offloaded{tag}_b{batch}"
                if wanted is None or system in wanted:
                    row = run_row(engine, system, many, args.new_tokens, predictor=predictor, runs=2, batch=batch)
                    emit({**base, **row, "vram_budget_gib": budget, "cache_fraction": fraction})
                    if args.profile and engine.device.type == "cuda" and batch in (1, 4):  # where the link time goes
                        emit({**base, "system": f"{system}_timeline",
                              **timeline(engine, many[:batch], args.new_tokens, predictor)})
        engine.close()
    except Exception as exc:
        emit({**base, "system": "offloaded_batches", "failed": f"{type(exc).__name__}: {exc}",
              "traceback": traceback.format_exc(limit=4)})
    _free()


def prefill_rows(path: Path, args: argparse.Namespace, config: dict[str, Any], common: dict[str, Any],
                 base: dict[str, Any], emit: Callable[[dict[str, Any]], None], wanted: set[str] | None) -> None:
    """Prefill tokens/s and time to first token per prompt length (every expert resident; one new token)."""
    lengths = [n for n in (int(v) for v in args.prefill_lengths.split(",") if v)
               if n + 4 <= config["max_position_embeddings"] and (wanted is None or f"prefill_{n}" in wanted)]
    if not lengths:
        return
    try:
        engine = MoEPrefetchEngine.from_pretrained(path, **common, max_seq_len=max(lengths) + 4)
        for n in lengths:
            prompts = prompts_for(path, None, config["vocab_size"], 3, n, seed=4)
            engine.generate([prompts[0]], max_new_tokens=1, stop_at_eos=False)  # warm-up (kernel compiles)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()  # this length's peak, not the longest one so far
            stats = [engine.generate([p], max_new_tokens=1, stop_at_eos=False).stats.to_dict() for p in prompts]
            emit({**base, "system": f"prefill_{n}", "prompt_tokens": n, "runs": len(prompts),
                  "prefill_tokens_per_s": statistics.median(s["prefill_tokens_per_s"] for s in stats),
                  "ttft_seconds": statistics.median(s["ttft_seconds"] for s in stats),
                  "peak_vram_gib": torch.cuda.max_memory_allocated() / GiB if torch.cuda.is_available() else None})
        engine.close()
    except Exception as exc:
        emit({**base, "system": "prefill", "failed": f"{type(exc).__name__}: {exc}",
              "traceback": traceback.format_exc(limit=4)})
    _free()


def bench_prefill(name: str, path: Path, args: argparse.Namespace, device: torch.device, link: dict[str, float],
                  emit: Callable[[dict[str, Any]], None]) -> None:
    """Issue 15's rows: `prefill_resident` and `prefill_offloaded` (`--budget-gib`) per prompt length and prefill
    chunk, from a cold expert cache, with the bytes the prompt moved and the link bound (prompt tokens over the time
    its distinct experts need at the measured link peak: each touched expert crossing once); then transformers'
    resident prefill at the same lengths (`prefill_transformers`)."""
    config = json.loads((path / "config.json").read_text())
    lengths = [int(v) for v in args.prefill_lengths.split(",") if v]
    chunks = sorted(int(v) for v in args.prefill_chunks.split(",") if v)  # none given: the engine's own choice
    windows = sorted(int(v) for v in args.prefill_windows.split(",") if v)
    workload = name + (f"#{args.variant}" if args.variant else "")
    peak = link.get("h2d_peak_gbps", float("nan")) * 1e9
    common = dict(device=str(device), dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                  progress=False, max_batch_size=1, max_seq_len=max(lengths) + 8, **engine_settings(args))
    if chunks:
        common["prefill_chunk"] = max(chunks)  # memory planned for the largest chunk
    if windows:
        common["prefill_window"] = max(windows)  # and window
    for system, extra in (("prefill_resident", {}), ("prefill_offloaded", {"vram_budget": f"{args.budget_gib}GiB"})):
        if args.systems and system not in args.systems.split(","):
            continue
        engine = None
        try:
            engine = load_offloaded(path, dict(common, **extra), args.cache_fraction) if extra else \
                MoEPrefetchEngine.from_pretrained(path, **common)
            own, own_window = engine.options.prefill_chunk, engine.options.prefill_window
            for n in lengths:
                prompts = prompts_for(path, None, config["vocab_size"], args.runs, n, seed=4)
                for chunk in sorted({min(c, n) for c in chunks or [own]}):
                    for window in sorted({max(min(w, n) // chunk, 1) * chunk for w in windows or [own_window]}):
                        engine.options = dataclasses.replace(engine.options, prefill_chunk=chunk,
                                                             prefill_window=window)
                        emit({"workload": workload, **prefill_row(engine, system, prompts, chunk, peak,
                                                                  args.budget_gib if extra else None)})
                engine.options = dataclasses.replace(engine.options, prefill_window=own_window)
                if args.profile and n == max(lengths):
                    engine.options = dataclasses.replace(engine.options, prefill_chunk=max(chunks or [own]))
                    try:
                        emit({"workload": workload, **prefill_profile(engine, system, prompts[0])})
                    except Exception as exc:
                        emit({"workload": workload, "system": f"{system}_profile",
                              "failed": f"{type(exc).__name__}: {exc}"})
        except Exception as exc:
            emit({"workload": workload, "system": system, "failed": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc(limit=4)})
        finally:
            if engine is not None:
                engine.close()
        _free()
    if not args.systems or "prefill_transformers" in args.systems.split(","):
        try:
            for row in transformers_prefill_rows(path, lengths, config["vocab_size"], args.runs):
                emit({"workload": workload, **row})
        except Exception as exc:
            emit({"workload": workload, "system": "prefill_transformers", "failed": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc(limit=4)})
        _free()


def prefill_row(engine: MoEPrefetchEngine, system: str, prompts: list[list[int]], chunk: int, link_peak: float,
                budget_gib: float | None) -> dict[str, Any]:
    """Medians over prompts, each prefilled (one new token) from a cold expert cache after one warm-up."""
    res = engine.residency
    engine.reset_expert_cache(forget_routing=True)
    engine.generate([prompts[0]], max_new_tokens=1, stop_at_eos=False)  # warm-up: compiles, this chunk's shapes
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    runs = []
    for prompt in prompts:
        engine.reset_expert_cache(forget_routing=True)
        # the experts a prompt touches, for the link bound: only offloaded (the log reads every layer's plan back)
        res.prefill_log = [] if res.store is not None else None
        stats = engine.generate([prompt], max_new_tokens=1, stop_at_eos=False).stats.to_dict()
        touched = {(layer, e) for layer, experts in res.prefill_log or [] for e in experts}
        res.prefill_log = None
        runs.append((stats, len(touched) * res.expert_bytes))
    n = len(prompts[0])
    fetch = statistics.median(b for _, b in runs) if res.store is not None else 0
    link_bound = n / (fetch / link_peak) if fetch else None
    tps = statistics.median(s["prefill_tokens_per_s"] for s, _ in runs)
    return {"system": system, "prompt_tokens": n, "prefill_chunk": chunk,
            "prefill_window": engine.options.prefill_window, "runs": len(runs),
            "vram_budget_gib": budget_gib, "prefill_tokens_per_s": tps,
            "ttft_seconds": statistics.median(s["ttft_seconds"] for s, _ in runs),
            "cache_fraction": res.n_slots / engine.plan.total_experts, "cache_slots": res.n_slots,
            "prefill_bytes_h2d": statistics.median(s["prefill_bytes_h2d"] for s, _ in runs),
            "must_fetch_bytes": fetch, "link_bound_tokens_per_s": link_bound,
            "fraction_of_link_bound": tps / link_bound if link_bound else None,
            "prefill_experts_ahead": statistics.median(s.get("prefill_experts_ahead", 0) for s, _ in runs),
            "prefill_experts_ahead_unused": statistics.median(s.get("prefill_experts_ahead_unused", 0) for s, _ in runs),
            "peak_vram_gib": torch.cuda.max_memory_allocated() / GiB if torch.cuda.is_available() else None}


def prefill_profile(engine: MoEPrefetchEngine, system: str, prompt: list[int]) -> dict[str, Any]:
    """Where one prompt's prefill time goes (cold cache, after a warm-up): CUDA kernel time by kind and the longest
    kernels, and the GPU's busy time against the span of the prefill (the gaps are the host: per-layer plans and
    synchronisations) and the wall time."""
    from torch.profiler import ProfilerActivity, profile

    engine.reset_expert_cache(forget_routing=True)
    engine.generate([prompt], max_new_tokens=1, stop_at_eos=False)
    engine.reset_expert_cache(forget_routing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        stats = engine.generate([prompt], max_new_tokens=1, stop_at_eos=False).stats.to_dict()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() >= 0]
    kinds = (("grouped_experts", ("_grouped",)), ("attention", ("fmha", "flash", "attention", "efficient")),
             ("gemm", ("nvjet", "cutlass", "gemm", "sm90", "cublas")), ("copy", ("Memcpy",)))
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in kernels:
        kind = next((k for k, prefixes in kinds if any(p in e.name for p in prefixes)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + e.time_range.elapsed_us() / 1000
        by_name[e.name[:70]] = by_name.get(e.name[:70], 0.0) + e.time_range.elapsed_us() / 1000
    spans = [(e.time_range.start, e.time_range.end) for e in kernels if not e.name.startswith("Memcpy")]
    return {"system": f"{system}_profile", "prompt_tokens": len(prompt), "prefill_chunk": engine.options.prefill_chunk,
            "prefill_window": engine.options.prefill_window,
            "prefill_seconds_traced": stats["prefill_seconds"],
            "kernel_busy_ms": _union(spans) / 1000,
            "kernel_span_ms": (max(e for _, e in spans) - min(s for s, _ in spans)) / 1000 if spans else None,
            "ms_by_kind": by_kind,
            "top_kernels_ms": sorted(by_name.items(), key=lambda kv: -kv[1])[:15]}


def transformers_prefill_rows(path: Path, lengths: list[int], vocab: int, runs: int) -> list[dict[str, Any]]:
    """The peer: transformers' own model, every weight in VRAM (bf16), one forward over the prompt with its cache."""
    from transformers import AutoModelForCausalLM

    torch.cuda.reset_peak_memory_stats()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, device_map="cuda").eval()
    rows = []
    for n in lengths:
        prompts = prompts_for(path, None, vocab, runs, n, seed=4)
        times = []
        with torch.no_grad():
            for i, prompt in enumerate([prompts[0]] + prompts):  # the first is the warm-up
                ids = torch.tensor([prompt], device="cuda")
                torch.cuda.synchronize()
                start = time.perf_counter()
                model(ids, use_cache=True)
                torch.cuda.synchronize()
                if i:
                    times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        rows.append({"system": "prefill_transformers", "prompt_tokens": n, "runs": len(times),
                     "prefill_tokens_per_s": n / seconds, "ttft_seconds": seconds,
                     "peak_vram_gib": torch.cuda.max_memory_allocated() / GiB,
                     "note": "one forward with use_cache=True, timed between synchronisations"})
    del model
    return rows


STREAM_LAYERS = 8  # the issue's stream8 row
SMALL_BUDGETS_GIB = (1.5, 2.0, 2.5, 3.0)  # tried in order for the min_budget row


def bench_streaming(name: str, path: Path, args: argparse.Namespace, device: torch.device, link: dict[str, float],
                    emit: Callable[[dict[str, Any]], None]) -> None:
    """Layer streaming: reactive decode at --budget-gib without and with `stream_layers=8` (what streaming adds,
    against its own link time), then the smallest budget that loads and decodes, and 3 GiB with the engine's
    default context and batch."""
    config = json.loads((path / "config.json").read_text())
    prompts = prompts_for(path, None, config["vocab_size"], args.runs, args.prompt_tokens, seed=1)
    common = dict(device=str(device), dtype=torch.bfloat16, max_seq_len=args.max_seq_len, max_batch_size=1,
                  progress=False, **engine_settings(args))
    base = {"workload": name + (f"#{args.variant}" if args.variant else ""), "batch": 1,
            "prompt_tokens": [len(p) for p in prompts]}
    peak = link.get("h2d_peak_gbps", float("nan"))  # no link on the CPU (a check of the script)
    wanted = set(args.systems.split(",")) if args.systems else None

    def measured(system: str, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        if wanted is not None and system not in wanted:
            return None
        try:
            engine = MoEPrefetchEngine.from_pretrained(path, **common, **kwargs)
        except Exception as exc:
            emit({**base, "system": system, "failed": f"{type(exc).__name__}: {exc}", **kwargs})
            return None
        try:
            row = run_row(engine, system, prompts, args.new_tokens, runs=args.runs)
            memory = engine.memory_stats()
            row.update(kwargs, plan=engine.plan.describe(), stream_layers=len(engine.plan.streamed_layers),
                       host_embedding=engine.plan.host_embedding, stream_ring_bytes=memory["stream_ring_bytes"],
                       planned_vram_gib=engine.plan.planned_vram_bytes / GiB,
                       stream_link_ms_per_token=row["streamed_bytes_per_token"] / peak / 1e6)
            emit({**base, **row})
            return row
        except Exception as exc:
            emit({**base, "system": system, "failed": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()})
            return None
        finally:
            engine.close()
            _free()

    budget = f"{args.budget_gib}GiB"
    plain = measured("no_stream", {"vram_budget": budget})
    streamed = measured("stream8", {"vram_budget": budget, "stream_layers": STREAM_LAYERS})
    if plain and streamed:
        added = streamed["ms_per_token"] - plain["ms_per_token"]
        emit({**base, "system": "stream8_overhead", "added_ms_per_token": added,
              "stream_link_ms_per_token": streamed["stream_link_ms_per_token"],
              "added_over_link_time": added / max(streamed["stream_link_ms_per_token"], 1e-9),
              "same_tokens_as_no_stream": streamed["sequences"] == plain["sequences"], "link_peak_gbps": peak})
    for gib in SMALL_BUDGETS_GIB:
        row = measured("min_budget", {"vram_budget": f"{gib}GiB"})
        if row is not None:
            if plain:  # the same row again, with the comparison (a row replaces its workload and system's)
                emit({**base, **row, "same_tokens_as_no_stream": row["sequences"] == plain["sequences"]})
            break
    if wanted is None or "budget_3gib_defaults" in wanted:  # the engine's own context (4,096) and batch (8)
        engine = None
        try:
            engine = MoEPrefetchEngine.from_pretrained(path, device=str(device), dtype=torch.bfloat16,
                                                       vram_budget="3GiB", progress=False)
            engine.generate(prompts[:1], max_new_tokens=8, stop_at_eos=False)  # warm-up: compiles and captures
            result = engine.generate(prompts[1:2], max_new_tokens=32, stop_at_eos=False)
            emit({**base, "system": "budget_3gib_defaults", "plan": engine.plan.describe(),
                  "ms_per_token": result.stats.to_dict()["ms_per_token"],
                  "peak_vram_gib": torch.cuda.max_memory_allocated(device) / GiB,
                  "max_seq_len": engine.options.max_seq_len, "max_batch_size": engine.options.max_batch_size})
        except Exception as exc:
            emit({**base, "system": "budget_3gib_defaults", "failed": f"{type(exc).__name__}: {exc}"})
        finally:
            if engine is not None:
                engine.close()
            _free()


def _active_bytes(engine: MoEPrefetchEngine) -> int:
    """Bytes a decode step must read from device memory at batch 1: resident weights except the embedding table
    (one row is read), plus top-k routed experts per MoE layer."""
    from moeprefetch.weights import weights_nbytes

    resident = weights_nbytes(engine.weights) - engine.weights.embed.numel() * engine.weights.embed.element_size()
    if engine.weights.mtp is not None:
        resident -= weights_nbytes(engine.weights.mtp)  # the all-resident row runs no MTP head
    experts = len(engine.args.moe_layers) * engine.args.num_experts_per_tok * engine.residency.expert_bytes
    return int(resident + experts)


def routing_trace_for(args: argparse.Namespace, config: dict[str, Any]) -> Path:
    """v2lite_trace's trace: the real one at full scale; a random one of the model's tiny shape otherwise."""
    if args.scale == "full":
        return args.routing_trace
    from moeprefetch.traces import write_trace

    layers = list(range(config["first_k_dense_replace"], config["num_hidden_layers"]))
    g = torch.Generator().manual_seed(3)
    experts = torch.stack([torch.stack([torch.randperm(config["n_routed_experts"], generator=g)[
        : config["num_experts_per_tok"]] for _ in layers]) for _ in range(64)])
    out = args.workdir / "tiny_trace.jsonl"
    write_trace(out, layers, experts)
    return out


def learned_head_for(name: str, path: Path, args: argparse.Namespace) -> Path | None:
    """The routing head of a workload's engines (issue 38), or None: --predictor-path, else the trained models' own
    (the shipped reference head; `routing_head.safetensors` beside the deep model). A head trained on the unpadded
    model is keyed to the padded copy the bench runs: padding changes the config's expert width but no router and no
    computed value (`write_padded_reference`), so the head predicts the same routing."""
    from moeprefetch.errors import CheckpointError
    from moeprefetch.learned_predictor import load_predictor, save_predictor
    from moeprefetch.checkpoint import checkpoint_fingerprint

    sources = {"ref17": ROOT / "moeprefetch/reference_model", "deep": args.deep_checkpoint}
    if args.predictor_path is not None:
        head_path = args.predictor_path
    elif name in sources and (sources[name] / "routing_head.safetensors").is_file():
        head_path = sources[name] / "routing_head.safetensors"
    else:
        return None
    try:  # a head is some checkpoint's: the workloads of a run that are not its run without 'learned' rows
        head = load_predictor(head_path, sources.get(name, path))
    except CheckpointError:
        logger.info("%s: the routing head %s belongs to another checkpoint; no learned rows", name, head_path)
        return None
    if name not in sources:
        return head_path
    head.config = dataclasses.replace(head.config, fingerprint=checkpoint_fingerprint(path))
    out = path / "routing_head.safetensors"
    save_predictor(head, out, {"keyed_from": str(head_path), "source": str(sources[name])})
    return out


# a row name's modifiers: engine option, its parser
ROW_MODIFIERS = {"fill": ("fill_confidence", float), "reuse": ("reuse_weight", float),
                 "spare": ("spare_recent", int), "inflight": ("max_inflight_experts", int),
                 "budget": ("prefetch_budget", float), "lead": ("prefetch_lead", int),
                 "halflife": ("lrfu_halflife", float), "verify": ("verify_confidence", float),
                 "drafts": ("draft_tokens", int)}


def modified_row(name: str, known: dict[str, tuple]) -> tuple:
    """A row named '<row>~fillC~idle~reuseW~spareN~inflightN~budgetB~leadL~halflifeH~verifyV~draftsD~bypass' (any of
    the modifiers, any order): the known row <row> with fill_confidence C, fill_link='idle', reuse_weight W,
    spare_recent N, max_inflight_experts N, prefetch_budget B (0: protection only, and the plans skip their
    reservation passes), prefetch_lead L (fills reserved at most L MoE layers before their need), lrfu_halflife H,
    verify_confidence V (speculative rows: drafts below V are not verified), draft_tokens D (speculative rows: a
    chain of D drafts checked per step; the engines are loaded for the largest D of --systems) and/or bypass=True."""
    system, predictor, speculative, lookahead, cut, overrides = known[name.split("~")[0]]
    return (name, predictor, speculative, lookahead, cut, {**overrides, **row_overrides(name)})


def row_overrides(name: str) -> dict[str, Any]:
    """The engine options a row name's modifiers set (`modified_row`), checked."""
    overrides: dict[str, Any] = {}
    for mod in name.split("~")[1:]:
        prefix = next((p for p in ROW_MODIFIERS if mod.startswith(p) and mod[len(p):]), None)
        if mod == "idle":
            overrides["fill_link"] = "idle"
        elif mod == "bypass":
            overrides["bypass"] = True
        elif prefix is not None:
            option, parse = ROW_MODIFIERS[prefix]
            try:
                overrides[option] = parse(mod[len(prefix):])
            except ValueError:
                raise SystemExit(f"--systems: {mod!r} in {name!r} needs a number after {prefix!r}") from None
        else:
            raise SystemExit(f"--systems: unknown modifier {mod!r} in {name!r} (fillC, idle, reuseW, spareN, "
                             f"inflightN, budgetB, leadL, halflifeH, verifyV, draftsD or bypass)")
    for option in ("reuse_weight", "verify_confidence"):
        if option in overrides:
            check_fraction(option, overrides[option], upper_open=False)
    return overrides


def longest_chain(systems: str) -> int:
    """The most drafts a row of --systems checks per step ('~draftsD'; 1 without): the engines are sized for it, and
    every row without '~draftsD' runs with one draft, as a default engine does."""
    chains = [int(mod[len("drafts"):]) for name in systems.split(",") for mod in name.split("~")[1:]
              if mod.startswith("drafts") and mod[len("drafts"):].isdigit()]
    return max(chains, default=1)


def one_draft(engine: MoEPrefetchEngine) -> MoEPrefetchEngine:
    """An engine loaded for longer chains (`longest_chain`) runs its rows with one draft unless a row says more."""
    engine.options = dataclasses.replace(engine.options, draft_tokens=1)
    return engine


def resident_speculation_rows(engine: MoEPrefetchEngine, base: dict, prompts: list, args: argparse.Namespace,
                               sampling: dict, reference: list | None,
                               emit: Callable[[dict[str, Any]], None]) -> None:
    """The rows named 'all_resident_speculative' (any ROW_MODIFIERS, e.g. '~verify0.3') in --systems: speculative
    decoding on the all-resident engine, every expert in VRAM, beside its plain row."""
    known = {"all_resident_speculative": ("all_resident_speculative", "none", "mtp", None, 0.0, {})}
    options = engine.options
    for name in args.systems.split(","):
        if name.split("~")[0] not in known:
            continue
        system, predictor, speculative, _, _, overrides = modified_row(name, known)
        engine.options = dataclasses.replace(options, **overrides)
        try:  # a failed row is its own (the resident row's tokens stay every later row's reference)
            row = run_row(engine, system, prompts, args.new_tokens, predictor=predictor, speculative=speculative,
                          runs=args.runs, **sampling)
            if reference is not None:
                row["same_tokens_as_all_resident"] = row["sequences"] == reference
            emit({**base, **row, "vram_budget_gib": None, "cache_fraction": 1.0})
        except Exception as exc:
            emit({**base, "system": system, "failed": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc(limit=4)})
        finally:
            engine.options = options


def load_offloaded(path: Path, options: dict[str, Any], cache_fraction: float,
                   when_resident: Callable[[MoEPrefetchEngine], None] | None = None,
                   reload: bool = True) -> MoEPrefetchEngine | None:
    """An engine with `options` that offloads experts: when its `vram_budget` holds every expert (nothing would
    cross the link), `when_resident` measures that engine, and it is loaded again with a fixed share
    (`cache_fraction`, at least 8) of the experts cached (None without `reload`)."""
    engine = MoEPrefetchEngine.from_pretrained(path, **options)
    if engine.residency.store is not None:
        return engine
    if when_resident is not None:
        when_resident(engine)
    if not reload:
        engine.close()
        return None
    slots = max(int(round(cache_fraction * engine.plan.total_experts)), 8)
    engine.close()
    rest = {k: v for k, v in options.items() if k != "vram_budget"}
    return MoEPrefetchEngine.from_pretrained(path, **rest, expert_cache_slots=slots)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/bench_h200.json")
    parser.add_argument("--workloads", default="ref17,v2lite,v3layers")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", choices=["full", "tiny"], default="full")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/moeprefetch-bench"))
    parser.add_argument("--corpus", type=Path, default=ROOT / "experiments/prompts/heldout.jsonl",
                        help="held-out prompts (JSON lines with 'text') for the reference model")
    parser.add_argument("--budget-gib", type=float, default=12.0)
    parser.add_argument("--cache-fraction", type=float, default=0.25, help="ref17: share of experts cached")
    parser.add_argument("--expert-mb", type=float, default=17.3, help="ref17: padded expert size (MB)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--profile", action="store_true", help="also record per-op time splits (eager runs)")
    parser.add_argument("--profile-predictors", default="",
                        help="the offloaded timelines to record (comma list; names may carry row modifiers, ~budget0)")
    parser.add_argument("--oracle-lookahead", type=int, default=1,
                        help="decode steps the oracle prefetches ahead (rows before 2026-12-01 afternoon asked for 2 "
                             "but planned 1: the window held one step)")
    parser.add_argument("--min-confidence", default="0.1", help="the confidence cuts of the '@' rows (comma list)")
    parser.add_argument("--hf-baseline", action="store_true", help="v2lite: run transformers + accelerate offload")
    parser.add_argument("--hf-tokens", type=int, default=4)
    parser.add_argument("--systems", default="", help="only these rows (comma list; default all)")
    parser.add_argument("--prefill-lengths", default="64,512,2048,8192",
                        help="--decode-compute / --prefill: prompt lengths of the prefill rows (empty: none)")
    parser.add_argument("--prefill", action="store_true",
                        help="only the prefill rows (resident, offloaded at --budget-gib, transformers)")
    parser.add_argument("--prefill-chunks", default="", help="--prefill: chunk sizes (default: the engine's)")
    parser.add_argument("--prefill-windows", default="", help="--prefill: window sizes in tokens (default: the "
                        "engine's; a window of one chunk runs the chunks one at a time)")
    parser.add_argument("--decode-compute", action="store_true",
                        help="v2lite/v3layers: only the all-resident decode-compute rows (contexts, fused vs not, "
                             "batches)")
    parser.add_argument("--qwen3-layers", type=int, default=12,
                        help="qwen3_30b_layers: how many of Qwen3-30B-A3B's 48 layers the checkpoint keeps")
    parser.add_argument("--streaming", action="store_true",
                        help="v2lite: only the layer-streaming rows (no_stream, stream8, min_budget)")
    parser.add_argument("--max-inflight", type=int, default=None, help="fills in flight at most (engine default)")
    parser.add_argument("--draft-experts", choices=["cached", "all", "auto"], default="cached",
                        help="the MTP head's routed experts (engine option draft_experts)")
    parser.add_argument("--spare-recent", type=int, default=1, help="engine option spare_recent (steps)")
    parser.add_argument("--prefetch-lead", type=int, default=EngineConfig.prefetch_lead,
                        help="engine option prefetch_lead (MoE layers; 0: no limit)")
    parser.add_argument("--lead-rows", default="", help="also run every predictor's row at these prefetch leads "
                        "('~leadN' rows, comma list)")
    parser.add_argument("--policy", choices=POLICIES, default=EngineConfig.policy, help="engine option policy")
    parser.add_argument("--lrfu-halflife", type=float, default=EngineConfig.lrfu_halflife,
                        help="engine option lrfu_halflife (steps)")
    parser.add_argument("--policy-rows", default="", help="also run every row, reactive too, with these cache "
                        "policies ('~POLICY' rows, comma list)")
    parser.add_argument("--late-prefetch", choices=LATE_PREFETCH, default=EngineConfig.late_prefetch,
                        help="engine option late_prefetch (offloaded rows)")
    parser.add_argument("--mtp-layer", action="store_true",
                        help="the random DeepSeek shapes get an MTP layer (random: its drafts are never kept), so "
                             "speculative rows measure the verify step's cost")
    parser.add_argument("--verify-rows", choices=VERIFY_ROWS, default=EngineConfig.verify_rows,
                        help="engine option verify_rows (a step's extra rows: batches of their own, or one batch)")
    parser.add_argument("--variant", default="", help="a tag appended to every row's workload (settings runs)")
    parser.add_argument("--expert-dtypes", default="", help="also run offloaded rows with these expert formats, "
                        "e.g. fp8,int8")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep (and reuse) the random-weight checkpoints in --workdir for the next run")
    parser.add_argument("--expert-dtype", choices=EXPERT_DTYPES, default="model",
                        help="every engine's expert format (rows' workload gets '@dtype'): model, fp8, int8, int4")
    parser.add_argument("--int4-group-size", type=int, default=EngineConfig.int4_group_size)
    parser.add_argument("--int4-symmetric", action="store_true", default=None)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample the workloads' generations at this temperature (0: greedy); a small trained "
                             "model's greedy continuation falls into loops whose routing is far more cacheable "
                             "than text's")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed (with --temperature)")
    parser.add_argument("--fill-confidence", type=float, default=EngineConfig.fill_confidence,
                        help="engine option fill_confidence (rows named ~fillC override it)")
    parser.add_argument("--fill-link", choices=FILL_LINK, default=EngineConfig.fill_link,
                        help="engine option fill_link (rows named ~idle override it)")
    parser.add_argument("--deep-checkpoint", type=Path, default=ROOT / ".device-data/deep",
                        help="deep: the deep reference model (reference/train_reference.py --preset deep)")
    parser.add_argument("--predictor-path", type=Path, default=None,
                        help="a routing head for the 'learned' rows (default: ref17's shipped head, the deep model's "
                             "routing_head.safetensors when present)")
    parser.add_argument("--routing-trace", type=Path,
                        default=ROOT / ".device-data/traces/nvmoe-dsv2lite-a.tokens.jsonl",
                        help="v2lite_trace: the routing trace every decode step follows (../shared/traces)")
    return parser


def workload_checkpoint(name: str, args: argparse.Namespace, device: torch.device) -> Path:
    """A workload's checkpoint: the trained models padded to --expert-mb, or a random one of the named shape
    (reused with --keep-checkpoints)."""
    if name in ("ref17", "deep"):
        source = ROOT / "moeprefetch/reference_model" if name == "ref17" else args.deep_checkpoint
        if not (source / "model.safetensors.index.json").is_file():
            raise FileNotFoundError(f"{source} holds no checkpoint: train it with reference/"
                                    f"train_reference.py --preset deep (scripts/device_pending.sh STAGE=deep)")
        return write_padded_reference(source, args.workdir / name,
                                      int(args.expert_mb * 1e6 if args.scale == "full" else 3e5))
    if name not in ("v2lite", "v2lite_trace", "v3layers", "qwen3_30b", "qwen3_30b_layers"):
        raise ValueError(f"unknown workload {name}")
    shape = {"v2lite": V2LITE, "v2lite_trace": V2LITE, "v3layers": V3LAYERS}.get(name, QWEN3_30B)
    if name == "qwen3_30b_layers":
        shape = dict(shape, num_hidden_layers=args.qwen3_layers)
    if args.mtp_layer and shape["model_type"] != "qwen3_moe":  # a random MTP layer: verify steps
        shape = dict(shape, num_nextn_predict_layers=1)
    shape = tiny(shape) if args.scale == "tiny" else shape
    # the whole Qwen3-30B-A3B only fits the GPU machine's disk as its published FP8 release does
    path = args.workdir / name
    if not (args.keep_checkpoints and (path / "model.safetensors.index.json").is_file()):
        path = write_random_checkpoint(path, shape, device, fp8_experts=name == "qwen3_30b")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if unknown := [p for p in args.policy_rows.split(",") if p and p not in POLICIES]:
        parser.error(f"--policy-rows: unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = torch.device(args.device)
    torch.manual_seed(0)
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = json.loads(args.out.read_text()) if args.out.is_file() else {}
    report.setdefault("rows", [])
    report["environment"] = environment(device)
    link = link_bandwidth(device)
    report["link"] = link
    report.setdefault("runs", []).append({"argv": sys.argv[1:], "started": time.strftime("%Y-%m-%d %H:%M:%S")})

    def emit(row: dict[str, Any]) -> None:
        row = {k: v for k, v in row.items() if k != "sequences"} | ({"sequences": row["sequences"][:1]}
                                                                     if "sequences" in row else {})
        # a row replaces the earlier one of its workload and system; prefill rows: one per prompt length and chunk
        per_length = str(row.get("system", "")).startswith("prefill")
        per_prompt = ("prompt_tokens", "prefill_chunk", "prefill_window")
        identity = ("workload", "system") + (per_prompt if per_length else ())
        report["rows"] = [r for r in report["rows"] if any(r.get(k) != row.get(k) for k in identity)]
        report["rows"].append(row)
        args.out.write_text(json.dumps(report, indent=1, default=str))
        brief = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                 if k in ("workload", "system", "ms_per_token", "hit_rate", "stall_ms_per_token", "h2d_gbps",
                          "prediction_recall", "floor_ms_per_token", "failed", "same_tokens_as_all_resident",
                          "hbm_gbps", "draft_acceptance", "cache_fraction", "peak_vram_gib",
                          "decode_tokens_per_s", "kernels_per_token", "wall_ms_per_token", "prefill_tokens_per_s",
                          "ttft_seconds", "streamed_bytes_per_token", "stream_stall_ms_per_token",
                          "added_over_link_time", "vram_budget")}
        print(json.dumps(brief), flush=True)

    for name in args.workloads.split(","):
        start = time.perf_counter()
        try:
            path = workload_checkpoint(name, args, device)
            logger.info("%s checkpoint ready in %.1f s", name, time.perf_counter() - start)
            if args.prefill:
                bench_prefill(name, path, args, device, link, emit)
            elif args.decode_compute:
                bench_decode_compute(name, path, args, device, emit)
            elif args.streaming:
                bench_streaming(name, path, args, device, link, emit)
            else:
                bench_workload(name, path, args, device, link, emit)
        except Exception as exc:
            emit({"workload": name, "system": "setup", "failed": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()})
        finally:
            if name not in ("ref17", "deep") and not args.keep_checkpoints:  # trained models are kept for the next run
                subprocess.run(["rm", "-rf", str(args.workdir / name)])
        logger.info("%s done in %.1f s", name, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
