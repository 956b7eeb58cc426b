"""Pre-quantised 4-bit weight-only checkpoints in the layouts published MoE checkpoints ship in.

Three formats are read (and written, by `write_int4_checkpoint`, for tests and fixtures). Each describes one Linear
weight W [out, in] ("in" = the input features, the reduction dimension) by 4-bit codes q in 0..15, a scale per output
row and group of `group` consecutive inputs and a zero point per row and group; `read_parts` returns them as
`Int4Parts`, the one form every consumer sees:

    W[o, i] = (q[o, i] - zero[o, i // group]) * scale[o, i // group]        (zero = 8 when symmetric)

compressed-tensors ``pack-quantized`` (llm-compressor, vLLM)
    config.json ``quantization_config``: ``quant_method: "compressed-tensors"``, ``format: "pack-quantized"`` (or
    ``"mixed-precision"`` with each config group's own ``format``), ``config_groups: {name: {targets, weights:
    {num_bits: 4, type: "int", symmetric, strategy: "group" | "channel", group_size, actorder, dynamic: false},
    input_activations: null, output_activations: null}}``, ``ignore`` (module names, or ``re:`` patterns matched with
    ``re.match`` from the start of the name), ``kv_cache_scheme``, ``sparsity_config``, ``transform_config``,
    ``quantization_status: "compressed"``, ``version``. A group value may also be a target list under a preset name
    (``"W4A16": ["Linear"]``). Tensors per quantised module ``<base>``:

    * ``<base>.weight_packed`` int32 [out, ceil(in / 8)]: the signed code c in -8..7 is stored as the nibble c + 8,
      input column i in bits 4 * (i % 8) .. 4 * (i % 8) + 3 of word i // 8 (column 8j in the lowest nibble); the
      ragged last word is padded with zero nibbles. A word whose top nibble is >= 8 is a negative int32.
    * ``<base>.weight_scale`` in the weight's dtype (bf16/fp16/fp32) [out, ceil(in / group_size)], [out, 1] for the
      channel strategy.
    * ``<base>.weight_shape`` int64 [2] = (out, in).
    * ``<base>.weight_zero_point`` only when asymmetric: the signed zero point z in -8..7 as the nibble z + 8, packed
      along the *output* dimension, int32 [ceil(out / 8), groups] (row o in nibble o % 8 of word row o // 8).
      Checkpoints from compressed-tensors before 0.9.4 stored it unpacked, int8 [out, groups], signed; both are read.
    * ``<base>.weight_g_idx`` int32 [in] only with ``actorder: "group"`` (refused).

    Dequantisation is (c - z) * scale = ((c + 8) - (z + 8)) * scale, so zero = z + 8 here, and 8 when symmetric (no
    zero point tensor is saved then). The quantiser (llm-compressor's min-max observer, round to nearest): symmetric
    scale = amax / 7.5, c = clamp(round(w / scale), -8, 7); asymmetric scale = (max - min) / 15 over a range that
    includes 0, z = clamp(round(-8 - min / scale), -8, 7), c = clamp(round(w / scale) + z, -8, 7).
    Sources (github.com/neuralmagic/compressed-tensors at 52792be0, 0.12.2+23):
    src/compressed_tensors/compressors/quantized_compressors/pack_quantized.py (pack_to_int32, unpack_from_int32,
    compression_param_info, compress_weight; zero-point packing added in ed3ac7c, first tag 0.9.4),
    src/compressed_tensors/compressors/quantized_compressors/base.py (``_skip_zp``: no zero point when symmetric),
    src/compressed_tensors/quantization/lifecycle/initialize.py (scale shape via ``strategy_cdiv`` = ceil, channel
    [out, 1], scale dtype = the weight's, zero point int8), src/compressed_tensors/quantization/utils/helpers.py
    (``calculate_qparams``), src/compressed_tensors/quantization/quant_args.py (strategy inference, actorder
    aliases), src/compressed_tensors/quantization/quant_scheme.py (W4A16 presets),
    src/compressed_tensors/quantization/quant_config.py and compressors/model_compressors/model_compressor.py
    (``update_config``: the config keys; ``ignore`` lists the untargeted Linear modules by name),
    src/compressed_tensors/utils/match.py (``_match_name``), src/compressed_tensors/config/base.py (format names).
    vLLM (github.com/vllm-project/vllm): vllm/model_executor/layers/quantization/compressed_tensors/schemes/
    compressed_tensors_wNa16.py (4-bit = ``uint4b8``, unsigned with bias 8; ``weight_shape`` int64 [2];
    ``weight_zero_point`` int32 [out / 8, groups], ``packed_dim=0``).

GPTQ (AutoGPTQ, GPTQModel, transformers/optimum, vLLM)
    config.json ``quantization_config`` (GPTQModel also writes the same dict to quantize_config.json):
    ``quant_method: "gptq"``, ``bits: 4``, ``group_size`` (-1 = per channel), ``sym``, ``desc_act``,
    ``checkpoint_format`` (newer writers also ``format``; absent = ``"gptq"``), ``pack_dtype: "int32"``, ``meta``
    (``static_groups``, ...), ``dynamic`` (GPTQModel per-module overrides, ``-:`` = left unquantised), ``lm_head``.
    Tensors per quantised module ``<base>``:

    * ``<base>.qweight`` int32 [in / 8, out]: packed along the *input* dimension, q[o, i] in bits 4 * (i % 8) of
      word [i // 8, o].
    * ``<base>.qzeros`` int32 [groups, out / 8]: packed along the *output* dimension, zero[g, o] in bits
      4 * (o % 8) of word [g, o // 8].
    * ``<base>.scales`` fp16 [groups, out]; ``<base>.g_idx`` int32 [in], the group of each input column (i // group
      unless act-order); ``<base>.bias`` fp16 when the module has one.

    W[:, i] = scales[g_idx[i]] * (q[:, i] - zeros[g_idx[i]]). ``checkpoint_format: "gptq_v2"`` stores the zero points
    as they are; ``"gptq"`` (v1, the default of every writer, and what a config without the key means) stores them
    minus one, computed on the packed words: the stored int32 word is the v2 word minus 0x11111111 (mod 2^32), so
    reading adds 0x11111111 back to the whole word (GPTQModel's conversion; it is exact even where a zero point of 0
    borrowed from its neighbour, where adding 1 per nibble would not be). A symmetric v1 checkpoint therefore holds
    0x77777777 (zero point 8). Quantiser (GPTQModel's ``find_params``, round to nearest without the Hessian update):
    symmetric scale = 2 * amax / 15 and zero 8; asymmetric scale = (max - min) / 15 over a range including 0 and
    zero = round(-min / scale); q = clamp(round((w + zero * scale) / scale), 0, 15) with the fp32 scale, which is then
    stored in fp16.
    Sources (github.com/ModelCloud/GPTQModel at f4c327a1): gptqmodel/nn_modules/qlinear/__init__.py (``pack_block``,
    ``pack_original``, ``dequantize_weight``), gptqmodel/utils/model.py (``convert_gptq_v1_to_v2_format_module``,
    ``convert_gptq_v2_to_v1_format_module``), gptqmodel/quantization/config.py (config keys, formats, ``to_dict``),
    gptqmodel/quantization/gptq.py (g_idx: i // group_size, permuted only by desc_act without static_groups),
    gptqmodel/quantization/quantizer.py (``find_params``); transformers/utils/quantization_config.py
    (``GPTQConfig``: ``format`` with the legacy alias ``checkpoint_format``, default ``"gptq"``); vLLM
    vllm/model_executor/layers/quantization/gptq.py (shapes, ``packed_dim``, v1 zeros + 1).

AWQ ``version: "gemm"`` (AutoAWQ, GPTQModel, transformers, vLLM)
    config.json ``quantization_config`` (AutoAWQ's ``AwqConfig.to_transformers_dict``): ``quant_method: "awq"``,
    ``bits: 4``, ``group_size`` (-1 = per channel), ``zero_point``, ``version: "gemm"``, ``modules_to_not_convert``
    (null, or names: a module is left unquantised when any of them is a *substring* of its name). vLLM also reads the
    older quant_config.json spellings ``w_bit`` and ``q_group_size``. GPTQModel adds ``format`` and
    ``checkpoint_format`` (= the version), ``sym``, ``desc_act``, ``pack_dtype``, ``dynamic``, ``meta``; newer
    transformers (``AwqConfig`` as a ``GPTQConfig``) add ``format``/``checkpoint_format``, ``backend`` (a load-time
    kernel choice, except ``"llm-awq"``, which names llm-awq's own layout) and GPTQConfig's fields, ``sym`` among
    them, so ``zero_point`` alone decides the symmetry (as in vLLM). Tensors per quantised module ``<base>``:

    * ``<base>.qweight`` int32 [in, out / 8]: packed along the *output* dimension in AWQ's interleaved order: nibble k
      (bits 4k .. 4k + 3) of word [i, j] holds output column 8j + AWQ_ORDER[k], AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7];
      so column 8j + c is read from nibble AWQ_REVERSE_ORDER[c], AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7].
    * ``<base>.qzeros`` int32 [groups, out / 8]: the zero points 0..15 as they are (no GPTQ v1 offset), packed along
      the output dimension in the same interleaved order.
    * ``<base>.scales`` fp16 [groups, out] (GPTQModel keeps bf16 scales bf16); ``<base>.bias`` fp16 when the module
      has one; no g_idx.

    W[o, i] = (q[i, o] - zeros[i // group, o]) * scales[i // group, o]. Quantiser (AutoAWQ's
    ``pseudo_quantize_tensor`` after its activation-aware scale search and clipping, which are not reproduced here):
    with ``zero_point`` scale = clamp(max - min, min=1e-5) / 15, zero = clamp(-round(min / scale), 0, 15), q =
    clamp(round(w / scale) + zero, 0, 15), the scale stored in fp16 and q recomputed with it by
    ``WQLinear_GEMM.from_linear``; AutoAWQ's min and max do not include 0, write_int4_checkpoint's do (as the other
    formats' quantisers), so that zero stays exact. ``zero_point: false`` is GPTQModel's ``sym: true``: scale =
    clamp(amax, min=1e-5) / 7, q = clamp(round(w / scale), -8, 7) + 8, and qzeros still holds 8 everywhere (AutoAWQ
    itself cannot write it: its GEMM module asserts zero points). AutoAWQ and vLLM need in % group_size == 0 and out %
    8 == 0; write_int4_checkpoint needs the latter.
    Sources (github.com/casper-hansen/AutoAWQ at 88e4c76b): awq/modules/linear/gemm.py (``WQLinear_GEMM``: buffer
    shapes and dtypes, ``from_linear``'s ``order_map``), awq/utils/packing_utils.py (``AWQ_ORDER``,
    ``AWQ_REVERSE_ORDER``, ``dequantize_gemm``), awq/quantize/quantizer.py (``pseudo_quantize_tensor``,
    ``_apply_quant``), awq/models/_config.py (``AwqConfig``, ``to_transformers_dict``), awq/utils/module.py
    (``exclude_layers_to_not_quantize``: substring match). GPTQModel (at f4c327a1): gptqmodel/quantization/config.py
    (``AWQConfig``: ``zero_point = not sym``, ``version`` = ``format``; AWQ formats gemm, gemv, gemv_fast, marlin,
    bitblas, llm-awq), gptqmodel/looper/awq_processor.py (``pseudo_quantize_tensor``: symmetric zero point 8),
    gptqmodel/nn_modules/qlinear/gemm_awq.py (``pack``: the same order). transformers:
    src/transformers/utils/quantization_config.py (``AwqConfig``: versions gemm, gemv, exllama, ipex; ``backend``;
    exllama models are never saved), src/transformers/integrations/awq.py (``replace_with_awq_linear``: substring
    skip). vLLM: vllm/model_executor/layers/quantization/awq.py (``AWQConfig.from_config`` keys, shapes,
    ``is_layer_skipped_awq``), vllm/model_executor/layers/quantization/awq_triton.py (``awq_dequantize_kernel``: the
    reverse AWQ order [0, 4, 1, 5, 2, 6, 3, 7]), vllm/model_executor/layers/quantization/awq_marlin.py.

Refused, each with one CheckpointError sentence naming what is supported: other bit widths (8-bit pack-quantized,
2/3/8-bit GPTQ), float 4-bit (nvfp4/mxfp4) and the other compressed-tensors formats (marlin-24, nvfp4-pack-quantized,
int-quantized, float-quantized, dense, sparse ones), activation or KV-cache quantisation, tensor/block strategies,
dynamic weights, config groups that differ in group size or symmetry, rotations (``transform_config``, GPTQModel
``rotation``), GPTQ ``desc_act`` without static groups and any act-order g_idx (compressed-tensors ``actorder:
"group"``; a stored g_idx that is not i // group), GPTQ marlin/bitblas/qqq checkpoint formats and non-int32
``pack_dtype``, AWQ versions other than gemm (gemv, gemv_fast, marlin and llm-awq have their own layouts; exllama
and ipex are load-time kernels that transformers or AutoAWQ repack on load, not verified here as stored layouts),
AWQ with desc_act, and AutoRound, bitsandbytes-4bit, HQQ and the like. Ragged groups (in not a multiple of the group
size) are read and written with ceil(in / group) groups, the last one short; the real kernels (Marlin, exllama) want
in to be a multiple of the group size, so published checkpoints have none.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpoint import INDEX_FILE, CheckpointReader
from .errors import CheckpointError

COMPRESSED_TENSORS = "compressed-tensors"
GPTQ = "gptq"
AWQ = "awq"
METHODS = (COMPRESSED_TENSORS, GPTQ, AWQ)
PACK_QUANTIZED = "pack-quantized"
GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_GEMM = "gemm"
# AutoAWQ's packing_utils.py: nibble k of a word holds element AWQ_ORDER[k] of its eight; element c is read from
# nibble AWQ_REVERSE_ORDER[c] (the inverse permutation, vLLM's awq_triton.py)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
SYMMETRIC_ZERO = 8
SUPPORTED = (
    "supported: compressed-tensors 'pack-quantized' 4-bit int weight-only (group or channel strategy, symmetric or "
    "not), GPTQ 4-bit (checkpoint_format 'gptq' or 'gptq_v2', desc_act false or with static_groups) and AWQ 4-bit "
    "(version 'gemm', with or without zero_point)"
)
# other low-bit weight-only families: refused here, so that the sentence names what is read instead of "not fp8"
OTHER_FOUR_BIT_METHODS = ("awq_marlin", "gptq_marlin", "marlin", "bitblas", "mxfp4", "hqq", "auto-round",
                          "intel/auto-round", "autoround", "exl2", "aqlm", "qqq")
CT_FORMATS_KNOWN = ("dense", "sparse-bitmask", "sparse-24-bitmask", "int-quantized", "float-quantized",
                    "naive-quantized", "pack-quantized", "marlin-24", "mixed-precision", "nvfp4-pack-quantized",
                    "mxfp4-pack-quantized")
CT_PRESETS = {"W4A16": True, "W4A16_ASYM": False}  # 4-bit int weight-only presets -> symmetric
CT_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
GPTQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
AWQ_SUFFIXES = ("qweight", "qzeros", "scales")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
# what write_int4_checkpoint leaves unquantised by default: the output head and the MoE routers (mlp.gate,
# block_sparse_moe.gate, shared_expert_gate), as llm-compressor's MoE recipes do
DEFAULT_IGNORE = ("lm_head", r"re:.*\.gate$", r"re:.*shared_expert_gate$")


# ---- configuration ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Int4CheckpointArgs:
    """A 4-bit weight-only checkpoint's quantisation, parsed from config.json's quantization_config."""

    method: str  # "compressed-tensors" | "gptq" | "awq"
    group_size: int  # input columns per scale group; 0 = per channel (one group spanning all inputs)
    symmetric: bool
    # modules left unquantised: compressed-tensors names / "re:" patterns, AWQ modules_to_not_convert; () for GPTQ
    ignore: tuple[str, ...] = ()
    # "pack-quantized" | "gptq" (v1: zeros stored minus one) | "gptq_v2" | "gemm" (AWQ)
    checkpoint_format: str = PACK_QUANTIZED

    @property
    def gptq_zero_offset(self) -> int:
        """What a stored GPTQ zero point lacks: 1 for v1 ("gptq") checkpoints, 0 for v2 and compressed-tensors."""
        return 1 if self.method == GPTQ and self.checkpoint_format == "gptq" else 0

    def group_for(self, in_features: int) -> int:
        """Input columns per group of a weight with `in_features` inputs (per channel: all of them)."""
        if self.group_size <= 0:
            return in_features
        return min(self.group_size, in_features)

    def is_ignored(self, module: str) -> bool:
        if self.method == AWQ:  # AutoAWQ, transformers and vLLM skip a module when an entry is a substring of its name
            return any(key in module for key in self.ignore)
        return matches_any(module, self.ignore)


def matches_any(module: str, patterns: Sequence[str]) -> bool:
    """compressed-tensors' name matching: a "re:" pattern matches with re.match (from the start), others exactly."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module) is not None:
                return True
        elif pattern == module:
            return True
    return False


def _refuse(message: str) -> CheckpointError:
    return CheckpointError(f"{message} ({SUPPORTED})")


def parse_int4_config(quantization_config: dict | None) -> Int4CheckpointArgs | None:
    """The 4-bit checkpoint format a quantization_config describes; None when it is not one of this module's methods
    (no config, FP8, an unknown method: the FP8 path decides); CheckpointError with one sentence naming what is
    supported for a compressed-tensors, GPTQ or AWQ config this module cannot read, or another 4-bit method."""
    if not quantization_config:
        return None
    if not isinstance(quantization_config, dict):
        raise CheckpointError(f"quantization_config must be a JSON object, not {type(quantization_config).__name__}")
    method = str(quantization_config.get("quant_method", "")).lower()
    if method == COMPRESSED_TENSORS:
        return _parse_compressed_tensors(quantization_config)
    if method == GPTQ:
        return _parse_gptq(quantization_config)
    if method == AWQ:
        return _parse_awq(quantization_config)
    if method in OTHER_FOUR_BIT_METHODS or (method == "bitsandbytes" and quantization_config.get("load_in_4bit")):
        raise _refuse(f"quantization method {method!r} is not supported")
    return None


def _parse_compressed_tensors(qc: dict) -> Int4CheckpointArgs:
    fmt = qc.get("format")
    if fmt not in (PACK_QUANTIZED, "mixed-precision"):
        known = "" if fmt in CT_FORMATS_KNOWN else "an unknown format, "
        raise _refuse(f"compressed-tensors format {fmt!r} is {known}not supported")
    if qc.get("sparsity_config"):
        raise _refuse("a compressed-tensors checkpoint with a sparsity_config (sparse weights) is not supported")
    if qc.get("transform_config"):
        raise _refuse("a compressed-tensors checkpoint with a transform_config (rotated weights) is not supported")
    if qc.get("kv_cache_scheme"):
        raise _refuse("compressed-tensors KV-cache quantisation (kv_cache_scheme) is not supported")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError("compressed-tensors quantization_config has no config_groups object")
    seen: set[tuple[int, bool]] = set()
    for name, scheme in groups.items():
        seen.add(_parse_ct_scheme(name, scheme, fmt))
    if len(seen) > 1:
        raise _refuse(f"compressed-tensors config groups with different group sizes or symmetry {sorted(seen)} are "
                      f"not supported")
    ((group_size, symmetric),) = seen
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise CheckpointError(f"compressed-tensors quantization_config.ignore must be a list of strings, not "
                              f"{ignore!r}")
    return Int4CheckpointArgs(COMPRESSED_TENSORS, group_size, symmetric, tuple(ignore), PACK_QUANTIZED)


def _parse_ct_scheme(name: str, scheme: Any, fmt: str) -> tuple[int, bool]:
    if isinstance(scheme, list):  # a preset name with its targets
        if name.upper() not in CT_PRESETS:
            raise _refuse(f"compressed-tensors preset scheme {name!r} is not supported")
        return 128, CT_PRESETS[name.upper()]
    if not isinstance(scheme, dict):
        raise CheckpointError(f"compressed-tensors config group {name!r} must be an object or a target list")
    group_fmt = scheme.get("format") or fmt
    if group_fmt != PACK_QUANTIZED:
        raise _refuse(f"compressed-tensors config group {name!r} has format {group_fmt!r}, which is not supported")
    if scheme.get("input_activations") or scheme.get("output_activations"):
        raise _refuse(f"compressed-tensors config group {name!r} quantises activations, which is not supported")
    weights = scheme.get("weights")
    if not isinstance(weights, dict):
        raise _refuse(f"compressed-tensors config group {name!r} does not quantise weights")
    bits, kind = weights.get("num_bits", 8), str(weights.get("type", "int")).lower()
    if bits != 4:
        raise _refuse(f"compressed-tensors config group {name!r} has {bits}-bit weights, which are not supported")
    if kind != "int":
        raise _refuse(f"compressed-tensors config group {name!r} has 4-bit {kind} weights, which are not supported")
    if weights.get("dynamic"):
        raise _refuse(f"compressed-tensors config group {name!r} has dynamic weight quantisation")
    group_size = weights.get("group_size")
    strategy = weights.get("strategy")
    if strategy is None:  # quant_args.py: inferred from group_size
        strategy = "tensor" if group_size is None else "group" if group_size > 0 else "channel"
    strategy = str(strategy).lower()
    if strategy == "group":
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
            raise CheckpointError(f"compressed-tensors config group {name!r} has the group strategy without a "
                                  f"positive group_size (got {group_size!r})")
    elif strategy == "channel":
        group_size = 0
    else:
        raise _refuse(f"compressed-tensors config group {name!r} has the {strategy!r} strategy, which is not "
                      f"supported")
    actorder = weights.get("actorder")
    if actorder is True or str(actorder).lower() in ("group", "dynamic"):
        raise _refuse(f"compressed-tensors config group {name!r} uses activation ordering 'group' (a permuted g_idx), "
                      f"which is not supported")
    return group_size, bool(weights.get("symmetric", True))


def _parse_gptq(qc: dict) -> Int4CheckpointArgs:
    bits = qc.get("bits")
    if bits != 4:
        raise _refuse(f"GPTQ with {bits}-bit weights is not supported")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if qc.get("is_marlin_format"):
        fmt = "marlin"
    if fmt not in GPTQ_FORMATS:
        raise _refuse(f"GPTQ checkpoint_format {fmt!r} is not supported")
    _check_packing("GPTQ", qc)
    group_size = _group_size("GPTQ", qc.get("group_size", 128))
    meta = qc.get("meta") if isinstance(qc.get("meta"), dict) else {}
    static_groups = bool(qc.get("static_groups") or meta.get("static_groups"))
    if qc.get("desc_act") and not static_groups:
        raise _refuse("GPTQ desc_act (act-order: a permuted g_idx) without static_groups is not supported")
    symmetric = bool(qc.get("sym", True))
    _check_dynamic("GPTQ", qc, group_size, symmetric, static_groups)
    return Int4CheckpointArgs(GPTQ, 0 if group_size == -1 else group_size, symmetric, (), fmt)


def _check_packing(label: str, qc: dict) -> None:
    """GPTQModel's pack_dtype and rotation (GPTQ and AWQ alike): only int32 words of unrotated weights are read."""
    pack_dtype = str(qc.get("pack_dtype", "int32")).lower().removeprefix("torch.")
    if pack_dtype != "int32":
        raise _refuse(f"{label} pack_dtype {pack_dtype!r} is not supported")
    if qc.get("rotation"):
        raise _refuse(f"a {label} checkpoint with rotation {qc['rotation']!r} (rotated weights) is not supported")


def _group_size(label: str, group_size: Any) -> int:
    """A GPTQ or AWQ group_size, checked: positive, or -1 for one group a row."""
    if not isinstance(group_size, int) or isinstance(group_size, bool) or (group_size <= 0 and group_size != -1):
        raise CheckpointError(f"{label} group_size must be a positive int or -1, got {group_size!r}")
    return group_size


def _check_dynamic(label: str, qc: dict, group_size: int, symmetric: bool, static_groups: bool = False) -> None:
    """GPTQModel's per-module overrides (``dynamic``, GPTQ and AWQ alike): refused when one changes the layout."""
    for pattern, override in (qc.get("dynamic") or {}).items():
        if str(pattern).startswith("-:") or not isinstance(override, dict):
            continue  # "-:" = that module is left unquantised
        for key, value in (("bits", 4), ("group_size", group_size), ("sym", symmetric), ("desc_act", False)):
            if key in override and override[key] != value and not (key == "desc_act" and static_groups):
                raise _refuse(f"{label} dynamic override {pattern!r} sets {key}={override[key]!r}, which differs from "
                              f"the checkpoint's and is not supported")


def _parse_awq(qc: dict) -> Int4CheckpointArgs:
    bits = qc.get("bits", qc.get("w_bit"))  # w_bit / q_group_size: AutoAWQ's quant_config.json spellings
    if bits != 4:
        raise _refuse(f"AWQ with {bits}-bit weights is not supported")
    # the stored layout: version (AutoAWQ, GPTQModel), else format / checkpoint_format (GPTQModel, newer transformers)
    version = str(qc.get("version") or qc.get("format") or qc.get("checkpoint_format") or AWQ_GEMM).lower()
    if str(qc.get("backend", "")).lower() == "llm-awq":  # transformers: llm-awq's own packing
        version = "llm-awq"
    if version != AWQ_GEMM:
        raise _refuse(f"AWQ version {version!r} is not supported")
    _check_packing("AWQ", qc)
    if qc.get("desc_act"):
        raise _refuse("AWQ with desc_act (act-order: a permuted input order) is not supported")
    group_size = _group_size("AWQ", qc.get("group_size", qc.get("q_group_size", 128)))
    zero_point = qc.get("zero_point", True)  # AutoAWQ's and transformers' default
    if not isinstance(zero_point, bool):
        raise CheckpointError(f"AWQ zero_point must be true or false, got {zero_point!r}")
    ignore = qc.get("modules_to_not_convert") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise CheckpointError(f"AWQ quantization_config.modules_to_not_convert must be null or a list of strings, "
                              f"not {ignore!r}")
    _check_dynamic("AWQ", qc, group_size, not zero_point)
    return Int4CheckpointArgs(AWQ, 0 if group_size == -1 else group_size, not zero_point, tuple(ignore), AWQ_GEMM)


# ---- decoded weights ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Int4Parts:
    """One 4-bit weight decoded from its published layout. W[o, i] = (q[o, i] - zero[o, i // group]) * scale[o, i //
    group], zero = 8 when None (symmetric)."""

    q: torch.Tensor  # uint8 [out, in], values 0..15
    scale: torch.Tensor  # float32 [out, ceil(in / group)]
    zero: torch.Tensor | None  # float32 [out, ceil(in / group)] (integer values 0..15), None = symmetric (zero 8)
    group: int  # input columns per group (per channel: in)

    def __post_init__(self):
        out, cols = self.q.shape
        expected = (out, -(-cols // self.group))
        if self.q.dtype != torch.uint8 or tuple(self.scale.shape) != expected or self.scale.dtype != torch.float32:
            raise ValueError(f"Int4Parts: q {tuple(self.q.shape)} {self.q.dtype} and scale {tuple(self.scale.shape)} "
                             f"{self.scale.dtype} do not fit groups of {self.group} (scale must be fp32 {expected})")
        if self.zero is not None and (tuple(self.zero.shape) != expected or self.zero.dtype != torch.float32):
            raise ValueError(f"Int4Parts: zero {tuple(self.zero.shape)} {self.zero.dtype} must be fp32 {expected}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def zero_or_default(self) -> torch.Tensor:
        return self.zero if self.zero is not None else torch.full_like(self.scale, float(SYMMETRIC_ZERO))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[out, in] in `dtype`, computed in fp32 ((q - zero) is exact there)."""
        columns = torch.arange(self.q.shape[1]) // self.group
        zero = float(SYMMETRIC_ZERO) if self.zero is None else self.zero[:, columns]
        return ((self.q.float() - zero) * self.scale[:, columns]).to(dtype)


# ---- bit packing (the published orders) ---------------------------------------------------------------------------
_SHIFTS = torch.arange(8, dtype=torch.int64) * 4
_WORD = 1 << 32


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in 0 .. 2^32 - 1 -> the int32 with the same bits."""
    return torch.where(words >= 1 << 31, words - _WORD, words).to(torch.int32)


def _to_unsigned(words: torch.Tensor) -> torch.Tensor:
    return words.to(torch.int64) & (_WORD - 1)


def pack_int4(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """uint8 codes 0..15 [R, C] -> int32 words, eight codes per word along `dim` (element 8j + k in bits 4k..4k+3 of
    word j), the ragged last word padded with zero nibbles: compressed-tensors' weight_packed (dim 1) and
    weight_zero_point (dim 0), GPTQ's qweight (dim 0) and qzeros (dim 1)."""
    if codes.dim() != 2:
        raise ValueError(f"pack_int4 packs 2-D codes, got shape {tuple(codes.shape)}")
    values = codes.to(torch.int64)
    if dim == 0:
        values = values.t()
    rows, cols = values.shape
    pad = -cols % 8
    if pad:
        values = torch.cat((values, values.new_zeros(rows, pad)), dim=1)
    words = (values.view(rows, -1, 8) << _SHIFTS).sum(dim=2)
    packed = _to_int32(words)
    return packed.t().contiguous() if dim == 0 else packed.contiguous()


def unpack_int4(words: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """The inverse of pack_int4: int32 words -> uint8 codes with `length` elements along `dim`."""
    if words.dtype != torch.int32 or words.dim() != 2:
        raise ValueError(f"unpack_int4 takes 2-D int32 words, got {words.dtype} {tuple(words.shape)}")
    if dim == 0:
        words = words.t()
    rows, count = words.shape
    codes = torch.empty(rows, count * 8, dtype=torch.uint8)
    for k in range(8):  # an arithmetic shift of a negative word smears its sign bit, which the mask drops
        codes[:, k::8] = ((words >> (4 * k)) & 15).to(torch.uint8)
    codes = codes[:, :length]
    return codes.t().contiguous() if dim == 0 else codes.contiguous()


def gptq_v1_words(words: torch.Tensor) -> torch.Tensor:
    """v2 qzeros words -> v1 (every stored zero point minus one, on the word: minus 0x11111111 mod 2^32)."""
    return _to_int32((_to_unsigned(words) - 0x11111111) % _WORD)


def gptq_v2_words(words: torch.Tensor) -> torch.Tensor:
    """v1 qzeros words -> v2 (plus 0x11111111 mod 2^32), GPTQModel's convert_gptq_v1_to_v2_format_module."""
    return _to_int32((_to_unsigned(words) + 0x11111111) % _WORD)


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [R, C], C a multiple of 8 -> int32 [R, C / 8] in AWQ's interleaved order: nibble k of word j
    holds element 8j + AWQ_ORDER[k] (AWQ's qweight [in, out / 8] and qzeros [groups, out / 8])."""
    if codes.dim() != 2 or codes.shape[1] % 8:
        raise ValueError(f"pack_awq packs 2-D codes with a multiple of 8 columns, got shape {tuple(codes.shape)}")
    rows, cols = codes.shape
    interleaved = codes.reshape(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)].reshape(rows, cols)
    return pack_int4(interleaved, 1)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_awq: int32 [R, W] -> uint8 codes [R, 8W], element 8j + c from nibble AWQ_REVERSE_ORDER[c]."""
    nibbles = unpack_int4(words, 1, words.shape[-1] * 8)  # nibble k of word j at 8j + k
    rows = nibbles.shape[0]
    return nibbles.view(rows, -1, 8)[:, :, list(AWQ_REVERSE_ORDER)].reshape(rows, -1).contiguous()


# ---- reading ------------------------------------------------------------------------------------------------------
class Int4Tensors:
    """The 4-bit weights of one checkpoint: which modules are quantised, and each one decoded into Int4Parts."""

    def __init__(self, reader: CheckpointReader, args: Int4CheckpointArgs):
        if args.method not in METHODS:
            raise CheckpointError(f"4-bit checkpoint method {args.method!r} is unknown ({SUPPORTED})")
        self.reader = reader
        self.args = args
        self._marker = "weight_packed" if args.method == COMPRESSED_TENSORS else "qweight"
        self._suffixes = {COMPRESSED_TENSORS: CT_SUFFIXES, GPTQ: GPTQ_SUFFIXES, AWQ: AWQ_SUFFIXES}[args.method]
        tail = "." + self._marker
        self._bases = tuple(sorted(n[: -len(tail)] for n in reader.tensors if n.endswith(tail)))

    # ---- what is where ----------------------------------------------------------------------------------------
    def bases(self) -> tuple[str, ...]:
        """Every quantised module in the checkpoint (names without '.weight')."""
        return self._bases

    def scale_dtype(self) -> torch.dtype:
        """The dtype the checkpoint stores its routed experts' scales in (fp16 or bf16; fp32 for anything wider), so
        expert records can keep them verbatim (the first quantised expert's, else the first module's)."""
        if not self._bases:
            return torch.float32
        base = next((b for b in self._bases if ".experts." in b), self._bases[0])
        dtype = self._need(base, "weight_scale" if self.args.method == COMPRESSED_TENSORS else "scales").torch_dtype
        return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32

    def is_quantized(self, base: str) -> bool:
        """Whether `base` ("model.layers.1.mlp.experts.3.gate_proj") is stored quantised (else as `<base>.weight`)."""
        return f"{base}.{self._marker}" in self.reader

    def tensor_names(self, base: str) -> tuple[str, ...]:
        """The stored tensors that stand in for `<base>.weight` (those present)."""
        return tuple(f"{base}.{s}" for s in self._suffixes if f"{base}.{s}" in self.reader)

    def weight_names(self) -> dict[str, tuple[str, ...]]:
        """'<base>.weight' -> the stored tensor names that replace it, for every quantised module."""
        return {f"{base}.weight": self.tensor_names(base) for base in self._bases}

    def weight_shape(self, base: str) -> tuple[int, int]:
        """(out, in) of a quantised weight, from the headers (compressed-tensors: its weight_shape, 16 bytes)."""
        if self.args.method == COMPRESSED_TENSORS:
            return self._ct_shape(base, self._need(base, "weight_packed"))
        qweight = self._need(base, "qweight")
        if self.args.method == AWQ:  # [in, out / 8]
            return qweight.shape[-1] * 8, qweight.shape[0]
        scales = self._need(base, "scales")
        return scales.shape[-1], qweight.shape[0] * 8

    def _need(self, base: str, suffix: str):
        name = f"{base}.{suffix}"
        if name not in self.reader:
            raise CheckpointError(
                f"tensor {name!r} is missing from checkpoint {self.reader.path}: a {self.args.method} 4-bit weight "
                f"needs {', '.join(self._required(base))}")
        return self.reader.info(name)

    def _required(self, base: str) -> list[str]:
        if self.args.method == COMPRESSED_TENSORS:
            names = ["weight_packed", "weight_scale", "weight_shape"] + ([] if self.args.symmetric
                                                                         else ["weight_zero_point"])
        else:
            names = ["qweight", "qzeros", "scales"]
        return [f"{base}.{n}" for n in names]

    def _read(self, base: str, suffix: str, dtypes: tuple[torch.dtype, ...], ndim: int) -> torch.Tensor:
        info = self._need(base, suffix)
        if info.torch_dtype not in dtypes or len(info.shape) != ndim:
            kinds = "/".join(str(d).removeprefix("torch.") for d in dtypes)
            raise CheckpointError(f"tensor {info.name!r} is {info.dtype} {list(info.shape)}, expected a {ndim}-D "
                                  f"{kinds} tensor")
        return self.reader.read(info.name)

    @staticmethod
    def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
        if tuple(tensor.shape) != expected:
            raise CheckpointError(f"tensor {name!r} has shape {list(tensor.shape)}, expected {list(expected)} {what}")

    @staticmethod
    def _check_scale(name: str, scale: torch.Tensor) -> None:
        if not torch.isfinite(scale).all():
            raise CheckpointError(f"tensor {name!r} holds non-finite scales")

    def _check_g_idx(self, base: str, suffix: str, in_features: int, group: int) -> None:
        name = f"{base}.{suffix}"
        if name not in self.reader:
            return
        g_idx = self._read(base, suffix, INT_DTYPES, 1)
        trivial = torch.arange(in_features) // group
        if g_idx.shape[0] != in_features or not torch.equal(g_idx.to(torch.int64), trivial):
            raise CheckpointError(
                f"tensor {name!r} is not the contiguous group index i // {group} (act-order checkpoints with a "
                f"permuted g_idx are not supported)")

    def _ct_shape(self, base: str, packed_info) -> tuple[int, int]:
        name = f"{base}.weight_shape"
        shape = self._read(base, "weight_shape", INT_DTYPES, 1)
        if shape.numel() != 2 or len(packed_info.shape) != 2:
            raise CheckpointError(f"tensor {name!r} must hold the 2 numbers (out, in), got {shape.tolist()}")
        out, cols = (int(v) for v in shape.tolist())
        if out <= 0 or cols <= 0 or (out, -(-cols // 8)) != tuple(packed_info.shape):
            raise CheckpointError(
                f"tensor {name!r} says [{out}, {cols}] but {packed_info.name!r} is {list(packed_info.shape)} "
                f"(expected [out, ceil(in / 8)])")
        return out, cols

    # ---- decoding ---------------------------------------------------------------------------------------------
    def read_parts(self, base: str) -> Int4Parts:
        """The codes, scales and zero points of `<base>`, validated; CheckpointError naming the tensor on any defect."""
        if self.args.method == COMPRESSED_TENSORS:
            return self._read_compressed_tensors(base)
        if self.args.method == AWQ:
            return self._read_awq(base)
        return self._read_gptq(base)

    def read_float(self, base: str) -> torch.Tensor:
        """`<base>`'s weight dequantised, fp32 [out, in]."""
        return self.read_parts(base).dequantize(torch.float32)

    def _read_compressed_tensors(self, base: str) -> Int4Parts:
        packed = self._read(base, "weight_packed", (torch.int32,), 2)
        out, cols = self._ct_shape(base, self.reader.info(f"{base}.weight_packed"))
        group = self.args.group_for(cols)
        groups = -(-cols // group)
        scale_name = f"{base}.weight_scale"
        scale = self._read(base, "weight_scale", FLOAT_DTYPES, 2)
        self._check_shape(scale_name, scale, (out, groups), f"for a [{out}, {cols}] weight in groups of {group}")
        scale = scale.float()
        self._check_scale(scale_name, scale)
        zero = None
        if not self.args.symmetric:
            zp_name = f"{base}.weight_zero_point"
            info = self._need(base, "weight_zero_point")
            if info.torch_dtype == torch.int32:  # packed along the output dimension (compressed-tensors >= 0.9.4)
                stored = self._read(base, "weight_zero_point", (torch.int32,), 2)
                self._check_shape(zp_name, stored, (-(-out // 8), groups),
                                  f"(int32 zero points packed eight to a word along the {out} output rows)")
                zero = unpack_int4(stored, 0, out).float()
            elif info.torch_dtype == torch.int8:  # older: unpacked signed zero points
                stored = self._read(base, "weight_zero_point", (torch.int8,), 2)
                self._check_shape(zp_name, stored, (out, groups), "(unpacked int8 zero points)")
                if stored.min() < -8 or stored.max() > 7:
                    raise CheckpointError(f"tensor {zp_name!r} holds zero points outside the 4-bit range -8..7")
                zero = stored.float() + SYMMETRIC_ZERO
            else:
                raise CheckpointError(f"tensor {zp_name!r} is {info.dtype}, expected packed int32 or int8 zero points")
        self._check_g_idx(base, "weight_g_idx", cols, group)
        return Int4Parts(unpack_int4(packed, 1, cols), scale.contiguous(), zero, group)

    def _scales_and_qzeros(self, base: str, out: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """GPTQ's and AWQ's scales (fp32 [groups, out]) and qzeros words ([groups, out / 8]), validated; the group."""
        group = self.args.group_for(cols)
        groups = -(-cols // group)
        what = f"for a [{out}, {cols}] weight in groups of {group}"
        scales_name = f"{base}.scales"
        scales = self._read(base, "scales", FLOAT_DTYPES, 2)
        self._check_shape(scales_name, scales, (groups, out), what)
        scales = scales.float()
        self._check_scale(scales_name, scales)
        qzeros = self._read(base, "qzeros", (torch.int32,), 2)
        self._check_shape(f"{base}.qzeros", qzeros, (groups, -(-out // 8)), what + " (eight zero points per int32)")
        return scales, qzeros, group

    def _grouped_parts(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> Int4Parts:
        """Int4Parts from codes [out, in] and [groups, out] scales and zero points; a symmetric checkpoint's zero
        points are all 8 (GPTQ v1 0x77777777 words, AWQ without zero_point) and are dropped."""
        zero = zeros.t().float().contiguous()
        if self.args.symmetric and bool((zeros == SYMMETRIC_ZERO).all()):
            zero = None
        return Int4Parts(q, scales.t().contiguous(), zero, group)

    def _read_gptq(self, base: str) -> Int4Parts:
        qweight = self._read(base, "qweight", (torch.int32,), 2)
        cols, out = qweight.shape[0] * 8, qweight.shape[1]
        scales, qzeros, group = self._scales_and_qzeros(base, out, cols)
        if self.args.gptq_zero_offset:
            qzeros = gptq_v2_words(qzeros)
        zeros = unpack_int4(qzeros, 1, out)  # [groups, out]
        self._check_g_idx(base, "g_idx", cols, group)
        q = unpack_int4(qweight, 0, cols).t().contiguous()  # [in, out] -> [out, in]
        return self._grouped_parts(q, scales, zeros, group)

    def _read_awq(self, base: str) -> Int4Parts:
        qweight = self._read(base, "qweight", (torch.int32,), 2)
        cols, out = qweight.shape[0], qweight.shape[1] * 8  # [in, out / 8]: packed along the outputs
        scales, qzeros, group = self._scales_and_qzeros(base, out, cols)
        zeros = unpack_awq(qzeros)  # [groups, out]
        q = unpack_awq(qweight).t().contiguous()  # [in, out] -> [out, in]
        return self._grouped_parts(q, scales, zeros, group)


# ---- quantising and writing (fixtures) ----------------------------------------------------------------------------
def _grouped(weight: torch.Tensor, group: int) -> torch.Tensor:
    """[out, in] fp32 -> [out, groups, group], the ragged last group padded with its own last column (which changes
    neither its min nor its max)."""
    rows, cols = weight.shape
    pad = -cols % group
    if pad:
        weight = torch.cat((weight, weight[:, -1:].expand(rows, pad)), dim=1)
    return weight.view(rows, -1, group)


def quantize_int4(weight: torch.Tensor, method: str, group_size: int = 128, symmetric: bool = True,
                  scale_dtype: torch.dtype | None = None) -> Int4Parts:
    """Round-to-nearest 4-bit quantisation of one weight [out, in] as `method`'s tools do it (module docstring), with
    the scales rounded to the dtype they are stored in (compressed-tensors: `scale_dtype`, default the weight's;
    GPTQ and AWQ: fp16). group_size <= 0 = per channel."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_int4 takes a 2-D weight, got shape {tuple(weight.shape)}")
    cols = weight.shape[1]
    group = cols if group_size <= 0 else min(group_size, cols)
    w = _grouped(weight.float(), group)
    low = w.amin(dim=2).clamp(max=0.0)
    high = w.amax(dim=2).clamp(min=0.0)
    if method == COMPRESSED_TENSORS:
        stored = scale_dtype or (weight.dtype if weight.dtype in FLOAT_DTYPES else torch.bfloat16)
        codes, scale, zero = _rtn_compressed_tensors(w, low, high, symmetric, stored)
    elif method == GPTQ:
        codes, scale, zero = _rtn_gptq(w, low, high, symmetric)
    elif method == AWQ:
        codes, scale, zero = _rtn_awq(w, low, high, symmetric)
    else:
        raise ValueError(f"unknown 4-bit method {method!r} (compressed-tensors, gptq or awq)")
    q = codes.flatten(1)[:, :cols].to(torch.uint8)
    return Int4Parts(q, scale.contiguous(), zero, group)


# each _rtn_* takes grouped fp32 weights [out, groups, group] and their range (including 0) [out, groups]; returns
# the codes 0..15 (same shape as w), the scales as stored (fp32 values) and the zero points (None = symmetric)
def _rtn_compressed_tensors(w: torch.Tensor, low: torch.Tensor, high: torch.Tensor, symmetric: bool,
                            stored: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    eps = torch.finfo(torch.float32).eps
    if symmetric:
        scale = (torch.maximum(-low, high) / 7.5).clamp(min=eps).to(stored).float()
        signed = torch.round(w / scale[..., None]).clamp(-8, 7)
        zero = None
    else:
        scale = ((high - low) / 15.0).clamp(min=eps).to(stored).float()
        zp = torch.round(-8.0 - low / scale).clamp(-8, 7)
        signed = (torch.round(w / scale[..., None]) + zp[..., None]).clamp(-8, 7)
        zero = zp + SYMMETRIC_ZERO
    return signed + SYMMETRIC_ZERO, scale, zero


def _rtn_gptq(w: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
              symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if symmetric:
        low = -torch.maximum(-low, high)
        high = -low
    both_zero = (low == 0) & (high == 0)
    low = torch.where(both_zero, -1.0, low)
    high = torch.where(both_zero, 1.0, high)
    scale32 = (high - low) / 15.0
    zp = torch.full_like(scale32, float(SYMMETRIC_ZERO)) if symmetric else torch.round(-low / scale32)
    codes = torch.round((w + (zp * scale32)[..., None]) / scale32[..., None]).clamp(0, 15)
    return codes, scale32.to(torch.float16).float(), None if symmetric else zp


def _rtn_awq(w: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
             symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """AutoAWQ's pseudo_quantize_tensor (GPTQModel's for zero_point false) with the fp16 scale that
    WQLinear_GEMM.from_linear rounds the codes with; `low`/`high` include 0, which AutoAWQ's range does not."""
    if symmetric:
        scale = (torch.maximum(-low, high).clamp(min=1e-5) / 7.0).to(torch.float16).float()
        codes = torch.round(w / scale[..., None]).clamp(-8, 7) + SYMMETRIC_ZERO
        return codes, scale, None
    scale = ((high - low).clamp(min=1e-5) / 15.0).to(torch.float16).float()
    zp = (-torch.round(low / scale)).clamp(0, 15)
    codes = (torch.round(w / scale[..., None]) + zp[..., None]).clamp(0, 15)
    return codes, scale, zp


def compressed_tensors_tensors(base: str, parts: Int4Parts, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors compressed-tensors' PackedQuantizationCompressor saves for one module."""
    out, cols = parts.shape
    tensors = {
        f"{base}.weight_packed": pack_int4(parts.q, 1),
        f"{base}.weight_scale": parts.scale.to(scale_dtype),
        f"{base}.weight_shape": torch.tensor([out, cols], dtype=torch.int64),
    }
    if parts.zero is not None:
        tensors[f"{base}.weight_zero_point"] = pack_int4(parts.zero.to(torch.uint8), 0)
    return tensors


def gptq_tensors(base: str, parts: Int4Parts, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """The tensors GPTQModel saves for one module (v1 zero points minus one unless checkpoint_format is gptq_v2)."""
    out, cols = parts.shape
    if cols % 8 or out % 8:
        raise ValueError(f"GPTQ packs weights whose in and out are multiples of 8, {base} is [{out}, {cols}]; "
                         f"leave it unquantised with ignore")
    qzeros = pack_int4(parts.zero_or_default().t().to(torch.uint8), 1)  # [groups, out / 8]
    if checkpoint_format == "gptq":
        qzeros = gptq_v1_words(qzeros)
    return {
        f"{base}.qweight": pack_int4(parts.q.t(), 0),  # [in / 8, out]
        f"{base}.qzeros": qzeros,
        f"{base}.scales": parts.scale.t().to(torch.float16).contiguous(),
        f"{base}.g_idx": (torch.arange(cols) // parts.group).to(torch.int32),
    }


def awq_tensors(base: str, parts: Int4Parts) -> dict[str, torch.Tensor]:
    """The tensors AutoAWQ's WQLinear_GEMM saves for one module (GPTQModel's gemm format is the same)."""
    out, cols = parts.shape
    if out % 8:
        raise ValueError(f"AWQ packs weights whose out is a multiple of 8, {base} is [{out}, {cols}]; leave it "
                         f"unquantised with ignore")
    return {
        f"{base}.qweight": pack_awq(parts.q.t().contiguous()),  # [in, out / 8]
        f"{base}.qzeros": pack_awq(parts.zero_or_default().t().to(torch.uint8)),  # [groups, out / 8]
        f"{base}.scales": parts.scale.t().to(torch.float16).contiguous(),
    }


def compressed_tensors_config(group_size: int, symmetric: bool, ignore: Sequence[str]) -> dict[str, Any]:
    """The quantization_config llm-compressor writes for a W4A16 (symmetric) / W4A16_ASYM scheme; `version` names
    the compressed-tensors release whose layout this follows (readers ignore it)."""
    weights = {
        "actorder": None, "block_structure": None, "dynamic": False,
        "group_size": group_size if group_size > 0 else None, "num_bits": 4, "observer": "minmax",
        "observer_kwargs": {}, "strategy": "group" if group_size > 0 else "channel", "symmetric": symmetric,
        "type": "int",
    }
    return {
        "config_groups": {"group_0": {"format": PACK_QUANTIZED, "input_activations": None,
                                      "output_activations": None, "targets": ["Linear"], "weights": weights}},
        "format": PACK_QUANTIZED,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quant_method": COMPRESSED_TENSORS,
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.12.2",
    }


def gptq_config(group_size: int, symmetric: bool, checkpoint_format: str = "gptq") -> dict[str, Any]:
    """The quantization_config (and quantize_config.json) GPTQModel writes, without the calibration-only fields."""
    return {
        "bits": 4, "group_size": group_size if group_size > 0 else -1, "desc_act": False, "sym": symmetric,
        "lm_head": False, "quant_method": GPTQ, "checkpoint_format": checkpoint_format, "format": checkpoint_format,
        "pack_dtype": "int32", "true_sequential": True, "static_groups": False, "damp_percent": 0.05,
        "meta": {"quantizer": ["moeprefetch.int4_checkpoints:rtn"], "static_groups": False,
                 "true_sequential": True, "damp_percent": 0.05, "mse": 0.0},
    }


def awq_config(group_size: int, symmetric: bool, ignore: Sequence[str]) -> dict[str, Any]:
    """The quantization_config AutoAWQ writes (AwqConfig.to_transformers_dict); symmetric = zero_point false, as
    GPTQModel writes it; `ignore` = the modules left unquantised, by full name."""
    return {
        "quant_method": AWQ, "zero_point": not symmetric, "group_size": group_size if group_size > 0 else -1,
        "bits": 4, "version": AWQ_GEMM, "modules_to_not_convert": list(ignore) or None,
    }


def is_linear_weight(name: str, tensor_shape: Sequence[int]) -> bool:
    """A 2-D '<module>.weight' of a Linear layer: not an embedding, not a norm (the writer's candidates)."""
    if not name.endswith(".weight") or len(tensor_shape) != 2:
        return False
    leaf = name[: -len(".weight")].rsplit(".", 1)[-1]
    return "embed" not in leaf and "norm" not in leaf


def write_int4_checkpoint(src_dir: str | Path, out_dir: str | Path, method: str, group_size: int = 128,
                          symmetric: bool = True, ignore: Sequence[str] = DEFAULT_IGNORE,
                          checkpoint_format: str | None = None) -> Path:
    """Copy the float checkpoint `src_dir` to `out_dir` with every Linear weight (2-D `*.weight`, not an embedding or
    norm) quantised to 4 bits in `method`'s published layout ("compressed-tensors" pack-quantized, "gptq" or "awq"
    gemm), except the modules `ignore` names (names or "re:" patterns, for every method; by default lm_head and the
    MoE routers), and the matching quantization_config in config.json (GPTQ also quantize_config.json; AWQ lists the
    ignored modules in modules_to_not_convert, symmetric = zero_point false). group_size <= 0 = per channel. GPTQ
    writes checkpoint_format "gptq" (v1) unless "gptq_v2" is asked for. Shards, the index and every other file are
    kept."""
    src, out = Path(src_dir), Path(out_dir)
    checkpoint_format = _writer_format(method, checkpoint_format)
    if src.resolve() == out.resolve():
        raise ValueError("write_int4_checkpoint needs an output directory other than its source")
    config_file = src / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_file} cannot be read as JSON ({exc})") from None
    if config.get("quantization_config"):
        raise CheckpointError(f"{src} is already quantised; write_int4_checkpoint needs a float checkpoint")
    from safetensors.torch import save_file

    reader = CheckpointReader(src)
    out.mkdir(parents=True, exist_ok=True)
    quantised, ignored = _writer_targets(reader, ignore)
    weight_map: dict[str, str] = {}
    total = 0
    by_file: dict[Path, list[str]] = {}
    for name, info in reader.tensors.items():
        by_file.setdefault(info.file, []).append(name)
    for file, names in by_file.items():
        tensors: dict[str, torch.Tensor] = {}
        for name in sorted(names, key=lambda n: reader.tensors[n].offset):
            base = name.rsplit(".", 1)[0]
            tensors.update(_stored_tensors(name, reader.read(name), base in quantised, method, group_size, symmetric,
                                           checkpoint_format))
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        save_file(tensors, str(out / file.name), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = file.name
            total += tensor.numel() * tensor.element_size()
    if (src / INDEX_FILE).is_file():
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    for item in src.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name not in (INDEX_FILE, "config.json"):
            shutil.copy2(item, out / item.name)
    if method == COMPRESSED_TENSORS:
        config["quantization_config"] = compressed_tensors_config(group_size, symmetric, ignored)
    elif method == AWQ:
        config["quantization_config"] = awq_config(group_size, symmetric, ignored)
    else:
        config["quantization_config"] = gptq_config(group_size, symmetric, checkpoint_format)
        (out / "quantize_config.json").write_text(json.dumps(config["quantization_config"], indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _writer_format(method: str, checkpoint_format: str | None) -> str:
    """The checkpoint_format write_int4_checkpoint writes for `method` (its default when None), validated."""
    if method not in METHODS:
        raise ValueError(f"unknown 4-bit method {method!r} (compressed-tensors, gptq or awq)")
    default = {COMPRESSED_TENSORS: PACK_QUANTIZED, GPTQ: "gptq", AWQ: AWQ_GEMM}[method]
    checkpoint_format = checkpoint_format or default
    if method == GPTQ and checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"GPTQ checkpoint_format must be one of {GPTQ_FORMATS}, got {checkpoint_format!r}")
    if method != GPTQ and checkpoint_format != default:
        raise ValueError(f"{method} is written as {default!r} only, got checkpoint_format {checkpoint_format!r}")
    return checkpoint_format


def _writer_targets(reader: CheckpointReader, ignore: Sequence[str]) -> tuple[set[str], list[str]]:
    """The Linear modules to quantise and those `ignore` leaves unquantised (float weights only)."""
    quantised: set[str] = set()
    ignored: list[str] = []
    for name, info in reader.tensors.items():
        if is_linear_weight(name, info.shape) and info.dtype in ("F64", "F32", "F16", "BF16"):
            base = name[: -len(".weight")]
            if matches_any(base, ignore):
                ignored.append(base)
            else:
                quantised.add(base)
    return quantised, ignored


def _stored_tensors(name: str, tensor: torch.Tensor, quantised: bool, method: str, group_size: int, symmetric: bool,
                    checkpoint_format: str) -> dict[str, torch.Tensor]:
    """What the writer saves for one source tensor: a quantised module's weight as `method`'s tensors, its bias in
    fp16 for GPTQ and AWQ (GPTQModel and AutoAWQ store it so), anything else as it is."""
    if quantised and name.endswith(".weight"):
        base = name[: -len(".weight")]
        parts = quantize_int4(tensor, method, group_size, symmetric)
        if method == COMPRESSED_TENSORS:
            return compressed_tensors_tensors(base, parts, tensor.dtype)
        if method == AWQ:
            return awq_tensors(base, parts)
        return gptq_tensors(base, parts, checkpoint_format)
    if quantised and name.endswith(".bias") and method in (GPTQ, AWQ):
        return {name: tensor.to(torch.float16)}
    return {name: tensor}


__all__ = [
    "DEFAULT_IGNORE", "Int4CheckpointArgs", "Int4Parts", "Int4Tensors", "awq_config", "awq_tensors",
    "compressed_tensors_config", "compressed_tensors_tensors", "gptq_config", "gptq_tensors", "gptq_v1_words",
    "gptq_v2_words", "is_linear_weight", "matches_any", "pack_awq", "pack_int4", "parse_int4_config", "quantize_int4",
    "unpack_awq", "unpack_int4", "write_int4_checkpoint",
]


# ---- loading --------------------------------------------------------------------------------------------------------
def present_int4_weights(reader: CheckpointReader, args: Int4CheckpointArgs) -> Int4Tensors:
    """Show every 4-bit weight of `reader`'s checkpoint as its dequantised `<base>.weight` (fp32 on read), so the
    loaders of plain weights read attention, shared experts and dense layers unchanged; the returned Int4Tensors
    (over a second reader of the same files, which still lists the stored tensors) gives routed experts' codes
    verbatim. Close it with `.reader.close()`."""
    int4 = Int4Tensors(CheckpointReader(reader.path), args)
    for base in int4.bases():
        reader.substitute(f"{base}.weight", int4.weight_shape(base), int4.tensor_names(base),
                          lambda base=base: int4.read_float(base))
    return int4
