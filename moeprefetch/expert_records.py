"""Routed experts: the packed byte format of one expert, reading experts from a checkpoint, and the expert math.

One expert is one contiguous byte record (gate rows, then up rows, then down, then block scales when quantised), so
moving it host->device is a single DMA and a VRAM slot is one row of a `[n_slots, record_bytes]` uint8 pool. Typed
views over the pool give `gate_up [n, 2I, H]` and `down [n, H, I]` without copies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from .checkpoint import FLOAT_DTYPES, CheckpointReader
from .config import ModelArgs
from .errors import CheckpointError
from .families import family_of
from .quant import (FP8_DTYPE, dequantize_blocks, dequantize_int4_groups, pack_nibbles, quantize_fp8_blocks,
                    quantize_int4_groups, quantize_int8_blocks, scale_grid_shape)

if TYPE_CHECKING:
    from .int4_checkpoints import Int4Tensors

logger = logging.getLogger(__name__)

ALIGN = 64  # byte alignment of each region inside a record (and of the record stride)
EXPERT_DTYPES = ("model", "fp8", "int8", "int4")  # "model" = the engine's compute dtype
INT4_GROUP_SIZE = 128  # inputs per 4-bit scale group by default (experiments/results: quality against bytes)
# 4-bit scales and zero points are stored in fp16 by default (as GPTQ stores its scales): fp32 metadata made 11 % of
# a V2-Lite record (4.87 MB against 4.33 MB of codes), fp16 makes 6 %, and every byte of a record crosses the link
INT4_SCALE_DTYPE = torch.float16
SCALE_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
SCALE_DTYPES = tuple(SCALE_DTYPE_NAMES)
METADATA_SUFFIXES = ("_scale", "_zero")  # regions that describe a payload region


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Region:
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = torch.tensor([], dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ExpertFormat:
    """Byte layout of one packed expert: payload regions and, when quantised, their scales (and 4-bit zero points).

    8-bit formats scale 2-D blocks (`block`, DeepSeek-V3's layout); 4-bit ones scale groups of `block[1]` inputs of
    one row (block = (1, group)), with codes packed two to a byte along the inputs (quant.py)."""

    hidden: int
    intermediate: int
    payload_dtype: torch.dtype  # compute dtype, float8_e4m3fn, int8, or uint8 (packed 4-bit codes)
    compute_dtype: torch.dtype
    block: tuple[int, int] | None  # quantisation block, None for unquantised
    regions: dict[str, Region]
    record_bytes: int
    bits: int = 16  # bits per weight of the payload (4 for packed codes)
    zero_points: bool = False  # 4-bit asymmetric groups carry a zero point per group
    scale_dtype: torch.dtype = torch.float32  # the metadata regions' dtype (4-bit: scales and zero points alike)

    @property
    def quantized(self) -> bool:
        return self.block is not None

    @property
    def int4(self) -> bool:
        return self.bits == 4

    @property
    def payload_bytes(self) -> int:
        return sum(r.nbytes for name, r in self.regions.items() if not name.endswith(METADATA_SUFFIXES))

    @property
    def scale_bytes(self) -> int:
        """Bytes of the scales and zero points of one record."""
        return sum(r.nbytes for name, r in self.regions.items() if name.endswith(METADATA_SUFFIXES))

    def describe(self) -> str:
        if self.int4:
            kind = "asymmetric" if self.zero_points else "symmetric"
            scales = SCALE_DTYPE_NAMES[self.scale_dtype]
            return f"int4 ({kind}, groups of {self.block[1]} inputs, {scales} scales)"  # type: ignore[index]
        return {torch.float8_e4m3fn: "fp8", torch.int8: "int8"}.get(self.payload_dtype, str(self.payload_dtype))

    @staticmethod
    def build(
        hidden: int,
        intermediate: int,
        compute_dtype: torch.dtype,
        expert_dtype: str = "model",
        block: tuple[int, int] = (128, 128),
        group_size: int = INT4_GROUP_SIZE,
        symmetric: bool = False,
        scale_dtype: torch.dtype = INT4_SCALE_DTYPE,
    ) -> "ExpertFormat":
        """`block` scales the 8-bit formats (fp32 block scales, as DeepSeek-V3's checkpoints ship them);
        `group_size`, `symmetric` and `scale_dtype` shape the 4-bit one."""
        if expert_dtype not in EXPERT_DTYPES:
            raise ValueError(f"expert_dtype must be one of {EXPERT_DTYPES}, got {expert_dtype!r}")
        if expert_dtype == "int4":
            if scale_dtype not in SCALE_DTYPES:
                raise ValueError(f"4-bit scales are stored as one of {SCALE_DTYPES}, got {scale_dtype}")
            return ExpertFormat._build_int4(hidden, intermediate, compute_dtype, group_size, symmetric, scale_dtype)
        payload_dtype = {"model": compute_dtype, "fp8": FP8_DTYPE, "int8": torch.int8}[expert_dtype]
        quant_block = None if expert_dtype == "model" else block
        regions: dict[str, Region] = {}
        offset = 0
        # gate and up are adjacent with no padding so that gate_up is one [2I, H] view for unquantised experts
        for name, shape in (("gate", (intermediate, hidden)), ("up", (intermediate, hidden))):
            regions[name] = Region(offset, payload_dtype, shape)
            offset += regions[name].nbytes
        offset = _align(offset)
        regions["down"] = Region(offset, payload_dtype, (hidden, intermediate))
        offset = _align(offset + regions["down"].nbytes)
        if quant_block is not None:
            for name in ("gate", "up", "down"):
                grid = scale_grid_shape(*regions[name].shape, quant_block)
                regions[f"{name}_scale"] = Region(offset, torch.float32, grid)
                offset = _align(offset + regions[f"{name}_scale"].nbytes)
        bits = 8 * torch.tensor([], dtype=payload_dtype).element_size()
        return ExpertFormat(hidden, intermediate, payload_dtype, compute_dtype, quant_block, regions, _align(offset),
                            bits=bits)

    @staticmethod
    def _build_int4(hidden: int, intermediate: int, compute_dtype: torch.dtype, group: int,
                    symmetric: bool, scale_dtype: torch.dtype) -> "ExpertFormat":
        if hidden % 2 or intermediate % 2:
            raise ValueError(f"int4 experts pack two inputs to a byte: hidden ({hidden}) and moe intermediate "
                             f"({intermediate}) sizes must be even")
        if group < 2 or group % 2:
            raise ValueError(f"the int4 group size must be an even number of inputs >= 2, got {group}")
        widest = max(hidden, intermediate)  # even, as checked above
        if group > widest:  # every row would be padded to the group (and each read repeat its scale as often)
            raise ValueError(f"int4_group_size={group} is wider than the experts' rows ({hidden} and {intermediate} "
                             f"inputs): at most {widest}, one group a row")
        shapes = {"gate": (intermediate, hidden), "up": (intermediate, hidden), "down": (hidden, intermediate)}
        regions: dict[str, Region] = {}
        offset = 0
        for name, (rows, cols) in shapes.items():
            regions[name] = Region(offset, torch.uint8, (rows, cols // 2))
            offset = _align(offset + regions[name].nbytes)
        for suffix in ("_scale",) + (() if symmetric else ("_zero",)):
            for name, (rows, cols) in shapes.items():
                regions[name + suffix] = Region(offset, scale_dtype, (rows, -(-cols // group)))
                offset = _align(offset + regions[name + suffix].nbytes)
        return ExpertFormat(hidden, intermediate, torch.uint8, compute_dtype, (1, group), regions, _align(offset),
                            bits=4, zero_points=not symmetric, scale_dtype=scale_dtype)

    # ---- views ----------------------------------------------------------------------------------------------------
    def view(self, records: torch.Tensor, name: str) -> torch.Tensor:
        """records uint8 [n, record_bytes] -> typed view [n, *shape] of one region (no copy)."""
        region = self.regions[name]
        raw = records[:, region.offset : region.offset + region.nbytes]
        return raw.view(region.dtype).unflatten(1, region.shape)

    def gate_up_view(self, records: torch.Tensor) -> torch.Tensor:
        """[n, 2I, H] over gate and up (unquantised formats only)."""
        assert not self.quantized
        gate = self.regions["gate"]
        raw = records[:, gate.offset : gate.offset + 2 * gate.nbytes]
        return raw.view(gate.dtype).unflatten(1, (2 * self.intermediate, self.hidden))

    def pack(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, out: torch.Tensor) -> None:
        """Write one expert (float tensors [I,H], [I,H], [H,I]) into `out` (uint8 [record_bytes]), quantising if needed."""
        record = out.view(1, -1)
        for name, tensor in (("gate", gate), ("up", up), ("down", down)):
            if self.int4:
                packed, scale, zero = quantize_int4_groups(tensor, self.block[1], symmetric=not self.zero_points,
                                                           scale_dtype=self.scale_dtype)
                self.write_int4(record, name, packed, scale, zero)
            elif self.block is None:
                self.view(record, name)[0].copy_(tensor.to(self.payload_dtype))
            else:
                quantize = quantize_fp8_blocks if self.payload_dtype == FP8_DTYPE else quantize_int8_blocks
                payload, scale = quantize(tensor.float(), self.block)
                self.view(record, name)[0].copy_(payload)
                self.view(record, f"{name}_scale")[0].copy_(scale)

    def pack_quantized(self, parts: dict[str, tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor) -> None:
        """Write FP8 payloads with their checkpoint scales verbatim (no requantisation)."""
        record = out.view(1, -1)
        for name, (payload, scale) in parts.items():
            self.view(record, name)[0].copy_(payload.view(self.payload_dtype))
            self.view(record, f"{name}_scale")[0].copy_(scale)

    def write_int4(self, record: torch.Tensor, name: str, packed: torch.Tensor, scale: torch.Tensor,
                   zero: torch.Tensor | None) -> None:
        """Write one projection's packed codes, scales and zero points (None: symmetric) into record [1, bytes]. The
        scales must be exactly representable in the format's `scale_dtype` (`stores_exactly`)."""
        if (zero is None) == self.zero_points:
            raise ValueError(f"this int4 format is {'a' if self.zero_points else ''}symmetric: zero points "
                             f"{'missing' if zero is None else 'given'} for {name}")
        self.view(record, name)[0].copy_(packed)
        self.view(record, f"{name}_scale")[0].copy_(scale)
        if zero is not None:
            self.view(record, f"{name}_zero")[0].copy_(zero)

    def stores_exactly(self, scale: torch.Tensor) -> bool:
        """Whether fp32 `scale` values survive this format's metadata dtype unchanged (a checkpoint's own scales)."""
        return bool(torch.equal(scale.to(self.scale_dtype).float(), scale.float()))

    def dequantize(self, records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """records uint8 [n, record_bytes] -> (gate_up [n, 2I, H], down [n, H, I]) in the compute dtype."""
        if self.block is None:
            return self.gate_up_view(records), self.view(records, "down")
        if self.int4:
            parts = {name: dequantize_int4_groups(
                self.view(records, name), self.view(records, f"{name}_scale"),
                self.view(records, f"{name}_zero") if self.zero_points else None, self.block[1], self.compute_dtype)
                for name in ("gate", "up", "down")}
            return torch.cat((parts["gate"], parts["up"]), dim=1), parts["down"]
        parts = {}
        for name in ("gate", "up", "down"):
            payload = self.view(records, name)  # [n, M, N]
            scale = self.view(records, f"{name}_scale")  # [n, ceil(M/br), ceil(N/bc)]
            rows, cols = payload.shape[1:]
            full = scale.repeat_interleave(self.block[0], dim=1)[:, :rows].repeat_interleave(self.block[1], dim=2)
            parts[name] = (payload.float() * full[:, :, :cols]).to(self.compute_dtype)
        return torch.cat((parts["gate"], parts["up"]), dim=1), parts["down"]


# ---- reading experts from a checkpoint -----------------------------------------------------------------------------


class CheckpointExperts:
    """Reads routed expert (layer, e) from per-expert or fused checkpoint tensors, validated against the config."""

    def __init__(self, reader: CheckpointReader, args: ModelArgs, block: tuple[int, int],
                 int4: "Int4Tensors | None" = None):
        self.reader = reader
        self.args = args
        self.block = block
        self.int4 = int4  # a 4-bit checkpoint's codes, for int4 records that keep them verbatim
        self._requantised_noted = False
        family = family_of(args)
        self.prefix = f"{family.moe_prefix}.experts"
        self.projections = dict(zip(("gate_proj", "up_proj", "down_proj"), family.expert_projections))
        self._fused: dict[int, bool] = {}

    def _name(self, layer: int, expert: int, proj: str) -> str:
        """The checkpoint name of one expert's projection (`proj`: gate_proj, up_proj or down_proj)."""
        return f"model.layers.{layer}.{self.prefix}.{expert}.{self.projections[proj]}.weight"

    def _is_fused(self, layer: int) -> bool:
        if layer not in self._fused:
            p = f"model.layers.{layer}.{self.prefix}"
            fused = any(f"{p}.{n}" in self.reader for n in ("gate_up_proj", "gate_up_proj.weight"))
            per_expert = self._name(layer, 0, "gate_proj") in self.reader
            if not fused and not per_expert:
                raise CheckpointError(
                    f"routed experts of layer {layer} are missing: expected {self._name(layer, 0, 'gate_proj')} "
                    f"(per expert) or {p}.gate_up_proj (fused)"
                )
            self._fused[layer] = fused
        return self._fused[layer]

    def _fused_name(self, layer: int, base: str) -> str:
        p = f"model.layers.{layer}.{self.prefix}.{base}"
        return p if p in self.reader else f"{p}.weight"

    def _check(self, name: str, shape: tuple[int, ...]) -> str:
        info = self.reader.info(name)
        if info.shape != shape:
            raise CheckpointError(
                f"tensor {name!r} in {info.file.name} has shape {list(info.shape)}, but the config implies {list(shape)}"
            )
        if info.dtype not in FLOAT_DTYPES and info.dtype not in ("F8_E4M3",):
            raise CheckpointError(
                f"tensor {name!r} in {info.file.name} has dtype {info.dtype}; expert weights must be float or FP8"
            )
        return info.dtype

    def is_fp8(self, layer: int) -> bool:
        if self._is_fused(layer):
            return False
        return self.reader.info(self._name(layer, 0, "gate_proj")).dtype == "F8_E4M3"

    def read_float(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I,H], up [I,H], down [H,I]) in fp32 (FP8 dequantised)."""
        a = self.args
        h, i = a.hidden_size, a.moe_intermediate_size
        if self._is_fused(layer):
            gu_name = self._fused_name(layer, "gate_up_proj")
            d_name = self._fused_name(layer, "down_proj")
            self._check(gu_name, (a.n_routed_experts, 2 * i, h))
            self._check(d_name, (a.n_routed_experts, h, i))
            gate_up = self.reader.read_slice(gu_name, expert).float()
            down = self.reader.read_slice(d_name, expert).float()
            tensors = (gate_up[:i], gate_up[i:], down)
        else:
            tensors = tuple(self._read_one(layer, expert, proj).float() for proj in ("gate_proj", "up_proj", "down_proj"))
        for t, proj in zip(tensors, ("gate", "up", "down")):
            if not torch.isfinite(t).all():
                raise CheckpointError(f"expert {expert} of layer {layer} ({proj}) holds NaN or infinite values")
        return tensors  # type: ignore[return-value]

    def _read_one(self, layer: int, expert: int, proj: str) -> torch.Tensor:
        a = self.args
        shape = (a.hidden_size, a.moe_intermediate_size) if proj == "down_proj" else (a.moe_intermediate_size, a.hidden_size)
        name = self._name(layer, expert, proj)
        dtype = self._check(name, shape)
        tensor = self.reader.read(name)
        if dtype == "F8_E4M3":
            payload, scale = self._fp8_parts(name, tensor)
            return dequantize_blocks(payload, scale, self.block, torch.float32)
        return tensor

    def _fp8_parts(self, name: str, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale_name = name.removesuffix(".weight") + ".weight_scale_inv"
        if scale_name not in self.reader:
            raise CheckpointError(f"FP8 tensor {name!r} has no {scale_name!r} scale tensor")
        scale = self.reader.read(scale_name).float()
        expected = scale_grid_shape(*payload.shape, self.block)
        if tuple(scale.shape) != expected:
            raise CheckpointError(f"scale tensor {scale_name!r} has shape {list(scale.shape)}, expected {list(expected)}")
        return payload, scale

    def read_fp8(self, layer: int, expert: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Raw FP8 payloads and scales of an FP8 checkpoint's expert, for storing without requantisation."""
        parts = {}
        for proj, short in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            a = self.args
            shape = (a.hidden_size, a.moe_intermediate_size) if proj == "down_proj" else (a.moe_intermediate_size, a.hidden_size)
            name = self._name(layer, expert, proj)
            self._check(name, shape)
            parts[short] = self._fp8_parts(name, self.reader.read(name))
        return parts

    def pack(self, fmt: ExpertFormat, layer: int, expert: int, out: torch.Tensor) -> None:
        """Read and pack one expert into `out` (uint8 [record_bytes])."""
        if fmt.quantized and fmt.payload_dtype == FP8_DTYPE and fmt.block == self.block and self.is_fp8(layer):
            fmt.pack_quantized(self.read_fp8(layer, expert), out)  # keep the checkpoint's own FP8 bytes
        elif not (fmt.int4 and self._pack_int4_verbatim(fmt, layer, expert, out)):
            fmt.pack(*self.read_float(layer, expert), out)

    def _pack_int4_verbatim(self, fmt: ExpertFormat, layer: int, expert: int, out: torch.Tensor) -> bool:
        """A 4-bit checkpoint's codes, scales and zero points as they are, when its groups are the format's (same
        scale grid, same symmetry): no requantisation. False (and one log line) when they differ."""
        if self.int4 is None or self._is_fused(layer):
            return False
        bases = {short: self._name(layer, expert, proj).removesuffix(".weight")
                 for proj, short in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))}
        if not all(self.int4.is_quantized(base) for base in bases.values()):
            return False
        parts = {short: self.int4.read_parts(base) for short, base in bases.items()}
        record = out.view(1, -1)
        fits = all((p.zero is None) == (not fmt.zero_points)
                   and tuple(p.scale.shape) == tuple(fmt.view(record, f"{short}_scale").shape[1:])
                   and fmt.stores_exactly(p.scale)
                   and (p.group == fmt.block[1] or p.scale.shape[1] == 1)  # type: ignore[index]
                   for short, p in parts.items())
        if not fits:
            if not self._requantised_noted:
                self._requantised_noted = True
                logger.info("the checkpoint's 4-bit groups (%s, groups of %d) differ from the engine's %s: routed "
                            "experts are dequantised and quantised again", "symmetric" if self.int4.args.symmetric
                            else "asymmetric", parts["gate"].group, fmt.describe())
            return False
        for short, p in parts.items():
            fmt.write_int4(record, short, pack_nibbles(p.q), p.scale, p.zero)
        return True


# ---- expert math --------------------------------------------------------------------------------------------------


# elements: a multiple of the block every CPU elementwise loop vectorises (AVX-512's 16 floats, unrolled twice)
CPU_VECTOR_BLOCK = 64


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation a checkpoint names, computed so that an element's bits never depend on the rows beside it.
    torch's CPU loops compute a tensor's last elements (its size modulo their vector block) on a scalar path that
    rounds transcendental functions differently: on a Xeon with AVX-512, F.silu gave one element of the last row of a
    [9, 48] batch other bits than the same row elsewhere in it, so a verify step's draft row and the plain step's
    real row disagreed (tests/test_decode.py, shared rows). On the CPU, rows are padded to whole blocks."""
    act = {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "relu": F.relu,
    }[name]

    def rowwise(x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        if x.device.type != "cpu" or width % CPU_VECTOR_BLOCK == 0:
            return act(x)
        return act(F.pad(x, (0, -width % CPU_VECTOR_BLOCK)))[..., :width]

    return rowwise


def gathered_expert_ffn(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Callable
) -> torch.Tensor:
    """One (row, expert) pair per batch entry: x [N, H], gate_up [N, 2I, H], down [N, H, I] -> [N, H].

    Each entry is an independent batched GEMV, so an entry's result does not depend on the other entries — which is
    what keeps decode outputs bit-identical whatever the cache holds."""
    gu = torch.bmm(gate_up, x.unsqueeze(-1)).squeeze(-1)  # [N, 2I]
    gate, up = gu.chunk(2, dim=-1)
    return torch.bmm(down, (act(gate) * up).unsqueeze(-1)).squeeze(-1)
