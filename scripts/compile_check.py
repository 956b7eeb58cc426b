"""Compile a kernel for a GPU architecture from example arguments, without a GPU (Triton ships ptxas).

Used by the tests to catch what the interpreter cannot (type rules of the compiler, register and shared-memory use)
on a machine with no device, and by developers to read the resource report:

    python scripts/compile_check.py [--plan-spills]

A development tool, not part of the package (it imports the kernels and the residency that launches them).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moeprefetch.kernels import HAS_TRITON  # noqa: E402

_TYPES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64", torch.int32: "i32",
    torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv",
}


def compile_for(kernel: Any, args: dict[str, Any], arch: int = 90, num_warps: int = 4, num_stages: int = 3) -> Any:
    """Compile `kernel` (a triton.jit function) for sm_`arch` with the named example arguments."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        name = param.name
        value = args[name]
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
            # the JIT specialises 16-byte-aligned pointers (every allocation is); without it the compiler neither
            # vectorises the loads nor pipelines them through shared memory, and reports another kernel's resources
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i64" if not -(2**31) <= value < 2**31 else "i32"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"cannot type argument {name}={value!r}")
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def resources(compiled: Any) -> dict[str, int]:
    meta = compiled.metadata
    return {"registers": getattr(compiled, "n_regs", -1), "spills": getattr(compiled, "n_spills", -1),
            "shared_bytes": meta.shared}


def example_launches(hidden: int = 2048, intermediate: int = 1408, experts: int = 64, top_k: int = 6,
                     positions: int = 27, slots: int = 544, rows: int = 2, expert_dtype: str = "model") -> dict:
    """Every kernel's launch at a model's shape (DeepSeek-V2-Lite by default), on meta-free CPU tensors: only
    dtypes and constants matter for compiling."""
    import torch.nn.functional as F

    from moeprefetch.expert_records import ExpertFormat
    from moeprefetch.residency.state import ResidencyConfig, TableState
    from moeprefetch.kernels.experts import DEFAULT_TILES, RoutedExperts
    from moeprefetch.kernels.grouped import LONG_BLOCK_TILES, GroupedExperts, GroupedTiles
    from moeprefetch.residency.fill import Filler
    from moeprefetch.residency.plan_kernel import LayerPlanner

    fmt = ExpertFormat.build(hidden, intermediate, torch.bfloat16, expert_dtype)
    cfg = ResidencyConfig(positions=positions, main_positions=positions - 1, n_experts=experts, n_slots=slots,
                          record_bytes=fmt.record_bytes, wait_late=False)  # the waiting plan: plan_launch
    u = 16 * top_k
    st = TableState.allocate(replace(cfg, ring=3), u, torch.device("cpu"))  # as long as any planner's ring below
    pool = torch.zeros(2, fmt.record_bytes, dtype=torch.uint8)
    host = torch.zeros(2, fmt.record_bytes, dtype=torch.uint8)
    ids = torch.zeros(rows, top_k, dtype=torch.int64)
    act = torch.ones(rows, dtype=torch.bool)
    assign = torch.zeros(2 * rows, top_k, dtype=torch.int32)
    u_vec = torch.zeros(u, dtype=torch.int32)
    launches = {}
    planner = LayerPlanner(st, cfg, top_k, 16, 16, use_kernel=True)
    launches["plan"] = planner.launch(3, ids, act, ids, act, assign, u_vec, u_vec, u_vec, True, True)
    from moeprefetch.residency.fill import await_launch

    waiting = LayerPlanner(st, replace(cfg, wait_late=True), top_k, 16, 16, use_kernel=True)
    launches["plan_wait"] = waiting.launch(3, ids, act, ids, act, assign, u_vec, u_vec, u_vec, True, True,
                                           u_wait=u_vec)
    ahead = LayerPlanner(st, replace(cfg, wait_late=True, ring=3), top_k, 16, 16, use_kernel=True)  # oracle, 2 steps
    launches["plan_ring3"] = ahead.launch(3, ids, act, None, None, assign[:rows], u_vec, u_vec, u_vec, True, True,
                                          u_wait=u_vec)
    launches["await"] = await_launch(st, 3, u_vec, u_vec)
    launches["step_start"] = planner.start_launch(True)
    launches["fill"] = Filler(st, cfg, pool, host, use_kernel=True).launch(3)
    widest = 32  # a step of 32 rows: tiles wider than 16 rows (DOT_WIDE_TILES for unquantised records)
    x = torch.zeros(widest, hidden, dtype=torch.bfloat16)
    out = torch.zeros(widest, hidden)
    weights = torch.zeros(widest, top_k)
    assign = torch.zeros(widest, top_k, dtype=torch.int32)
    rows_first = replace(DEFAULT_TILES, weights_first=False)
    # tl.dot tiles (weights first, the default, and rows first; 16-row and 32-row tiles), and the CUDA-core path of
    # small steps
    for max_rows, tag, tiles in ((16, "", None), (16, "_rows_first", rows_first), (widest, "_wide", None),
                                 (2, "_gemv", None), (1, "_gemv1", None)):  # gemv1: batch 1 without an MTP layer
        experts_ = RoutedExperts(fmt, pool, host, "silu", F.silu, max_rows, top_k, use_kernels=True, tiles=tiles)
        for name, launch in zip(("gate_up", "down", "combine"),
                                experts_.launches(x[:max_rows], assign[:max_rows], weights[:max_rows], u_vec, u_vec,
                                                  u_vec, out[:max_rows], max_rows)):
            launches[name + tag] = launch
    grouped = GroupedExperts(fmt, pool, host, "silu", F.silu, use_kernels=True)
    blocks = torch.zeros(4, 3, dtype=torch.int32)
    pairs = torch.zeros(64, dtype=torch.int32)
    mid = torch.zeros(64, intermediate, dtype=torch.bfloat16)
    for tiles, tag in ((GroupedTiles(), ""), (LONG_BLOCK_TILES, "_long")):  # short and long prompts' blocks
        for name, launch in zip(("grouped_gate_up", "grouped_down"),
                                grouped.launches(x, pairs, blocks, u_vec, u_vec, mid, torch.zeros(64, hidden), tiles)):
            launches[name + tag] = launch
    launches.update(layer_launches(hidden, experts, top_k))
    return launches


def layer_launches(hidden: int, experts: int, top_k: int, heads: int = 16, latent: int = 512, rope_dim: int = 64,
                   nope: int = 128, rows: int = 2) -> dict:
    """The fused decode-layer kernels (norm, act*up, router, MLA decode attention) at a model's shape."""
    from moeprefetch.kernels.attention import MLADecode
    from moeprefetch.kernels.norm import act_mul_launch, residual_norm_launch
    from moeprefetch.kernels.router import RouterShape, select_launch

    bf16 = torch.bfloat16
    x = torch.zeros(rows, hidden, dtype=bf16)
    launches = {"residual_norm": residual_norm_launch(x, [x.float(), x], x[0], 1e-6, x, x),
                "act_mul": act_mul_launch(x, x, 0, x)}
    logits = torch.zeros(rows, experts)
    ids = torch.zeros(rows, top_k, dtype=torch.int64)
    for method, groups in (("greedy", 1), ("noaux_tc", 8)):
        router = RouterShape(experts, top_k, groups, max(1, groups // 2), method, method == "noaux_tc", True, 2.5)
        launches[f"router_{method}"] = select_launch(router, logits, logits[0], ids, logits[:, :top_k], logits)
    mla = MLADecode(heads, nope, latent, rope_dim, 4096, rows, torch.device("cpu"), True)
    q = torch.zeros(rows, heads, nope + rope_dim, dtype=bf16)
    kv = torch.zeros(rows, latent + rope_dim, dtype=bf16)
    cache_latent, cache_rope = torch.zeros(1, 8, latent, dtype=bf16), torch.zeros(1, 8, rope_dim, dtype=bf16)
    slots = torch.zeros(rows, dtype=torch.int64)
    launches["mla_prepare"] = mla.prepare_launch(q, kv, slots, slots, 1, cache_latent, cache_rope, kv[0], 1e-6,
                                                 logits[0], 1.0, True)
    q_latent = torch.zeros(heads, rows, latent, dtype=bf16)
    split, merge = mla.attend_launches(q_latent, q, cache_latent, cache_rope, slots, 1, 0.1, q_latent)
    launches.update(mla_split=split, mla_merge=merge)
    from moeprefetch.kernels.gqa_attention import GQADecode

    for window, tag in ((None, ""), (4096, "_window")):  # Qwen3-30B's heads (32 query, 4 key-value, 128 wide)
        gqa = GQADecode(32, 4, 128, 4096, rows, window, torch.device("cpu"), True)
        q_gqa, cache = torch.zeros(rows, 32, 128, dtype=bf16), torch.zeros(1, 8, 4, 128, dtype=bf16)
        split, merge = gqa.launches(q_gqa, cache, cache, slots, 1, 0.1, q_gqa)
        launches.update({f"gqa_split{tag}": split, f"gqa_merge{tag}": merge})
    from moeprefetch.kernels.clock import stamp_launch
    from moeprefetch.kernels.gather import gather_launch

    stamps = torch.zeros(2, dtype=torch.int64)
    launches.update(clock_start=stamp_launch(stamps, add=False), clock_stop=stamp_launch(stamps, add=True))
    launches["embed_gather"] = gather_launch(slots, x[0], slots[:1], x)
    from moeprefetch.kernels.sampling import gumbel_argmax_launch

    scaled, seeds = torch.zeros(rows, 102400), torch.zeros(rows, 2, dtype=torch.int64)  # V2-Lite's vocabulary
    launches["gumbel_argmax"] = gumbel_argmax_launch(scaled, slots, slots, seeds[:, 0], seeds[:, 1],
                                                     torch.zeros(rows, 50), torch.zeros(rows, 50, dtype=torch.int64))
    return launches


def local_memory_ops(compiled: Any) -> int | None:
    """Local-memory loads and stores (register spills) in a compiled kernel's SASS, or None without cuobjdump."""
    import os
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return sum(1 for line in sass.splitlines() if " LDL" in line or " STL" in line)


def plan_launch(positions: int, experts: int, slots: int, top_k: int, ring: int) -> Any:
    """The plan kernel's launch with prefetch reservation at a model's shape (wait_late, shadow rows)."""
    from moeprefetch.residency.state import ResidencyConfig, TableState
    from moeprefetch.residency.plan_kernel import LayerPlanner

    cfg = ResidencyConfig(positions=positions + 1, main_positions=positions, n_experts=experts, n_slots=slots,
                          record_bytes=1 << 20, ring=ring, wait_late=True)
    st = TableState.allocate(replace(cfg, ring=9), max(16 * top_k, experts), torch.device("cpu"))
    ids = torch.zeros(1, top_k, dtype=torch.int64)
    act = torch.ones(1, dtype=torch.bool)
    assign = torch.zeros(2, top_k, dtype=torch.int32)
    u = torch.zeros(max(16 * top_k, experts), dtype=torch.int32)
    return LayerPlanner(st, cfg, top_k, 16, 16, use_kernel=True).launch(5, ids, act, ids, act, assign, u, u, u, True, True,
                                                                    u_wait=u)


PLAN_SHAPES = {  # (MoE layers, experts, slots at 12 GiB, top-k)
    "qwen3_30b": (48, 128, 897, 8), "deepseek_v3": (58, 256, 136, 8), "v2_lite": (26, 64, 568, 6)}


INT4_LAUNCHES = ("gate_up", "down", "grouped_gate_up", "grouped_down")  # name prefixes of the expert-record readers


def compile_all(arch: int = 90, **shape: Any) -> dict[str, Any]:
    return {name: compile_for(launch.kernel, launch.args, arch, launch.num_warps, launch.num_stages)
            for name, launch in example_launches(**shape).items()}


if __name__ == "__main__" and HAS_TRITON:  # pragma: no cover - a developer's report
    import sys

    if "--plan-spills" in sys.argv:  # the plan kernel's local-memory traffic at real models' shapes
        for model, (layers, n, s, k) in PLAN_SHAPES.items():
            for ring in (2, 3):
                launch = plan_launch(layers, n, s, k, ring)
                compiled = compile_for(launch.kernel, launch.args, 90, launch.num_warps, launch.num_stages)
                print(model, f"ring {ring}", {"local_memory_ops": local_memory_ops(compiled)})
        sys.exit(0)
    for dtype in ("model", "fp8"):
        for name, compiled in compile_all(expert_dtype=dtype).items():
            print(dtype, name, resources(compiled))
    # int4: the launches that read expert records (the others do not depend on the format)
    for name, launch in example_launches(expert_dtype="int4").items():
        if name.startswith(INT4_LAUNCHES):
            compiled = compile_for(launch.kernel, launch.args, 90, launch.num_warps, launch.num_stages)
            print("int4", name, resources(compiled))
