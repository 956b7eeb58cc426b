"""Safetensors checkpoint access: index and header validation, tensor-by-tensor reads, FP8 scales.

Every file header is parsed and checked here before any tensor is read, so a truncated shard, a corrupt header or an
index that names a tensor no shard holds becomes one `CheckpointError` that names the file and the tensor. Tensors are
read one at a time through safetensors' `safe_open`; nothing here keeps a whole checkpoint in memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from .errors import CheckpointError

logger = logging.getLogger(__name__)

# the small trained model shipped with the package: the CLI's and from_pretrained's default
REFERENCE_MODEL = Path(__file__).resolve().parent / "reference_model"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit

SAFETENSORS_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return SAFETENSORS_DTYPES[self.dtype][0]


def read_safetensors_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header; raise CheckpointError naming the file on any defect."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file} is truncated: it is shorter than the 8-byte safetensors header length")
            (header_len,) = struct.unpack("<Q", head)
            if header_len == 0 or header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(
                    f"{file} has a corrupt safetensors header: it declares {header_len} header bytes "
                    f"in a file of {size} bytes"
                )
            raw = fh.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{file} cannot be read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{file} has a corrupt safetensors header: it is not valid UTF-8 JSON") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file} has a corrupt safetensors header: it is not a JSON object")
    data_start = 8 + header_len
    data_size = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _parse_entry(file, name, entry, data_start, data_size)
    _check_no_overlap(file, tensors)
    return tensors


def _parse_entry(file: Path, name: str, entry: object, data_start: int, data_size: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise CheckpointError(f"{file} has a corrupt header entry for tensor {name!r}: not an object")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise CheckpointError(f"{file}: tensor {name!r} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CheckpointError(f"{file}: tensor {name!r} has invalid data_offsets {offsets!r}")
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * SAFETENSORS_DTYPES[dtype][1]
    if offsets[1] - offsets[0] != nbytes:
        raise CheckpointError(
            f"{file}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes but dtype {dtype} and shape {shape} "
            f"need {nbytes}"
        )
    if offsets[1] > data_size:
        raise CheckpointError(
            f"{file} is truncated: tensor {name!r} ends at byte {data_start + offsets[1]} of a {data_start + data_size}"
            f"-byte file"
        )
    return TensorInfo(name, file, dtype, tuple(shape), data_start + offsets[0], nbytes)


def _check_no_overlap(file: Path, tensors: dict[str, TensorInfo]) -> None:
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        if start < end:
            raise CheckpointError(f"{file} has a corrupt header: tensors {name!r} and {other!r} overlap")


class CheckpointReader:
    """All tensors of a checkpoint directory, validated, read one at a time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tensors: dict[str, TensorInfo] = {}
        self._handles: dict[Path, object] = {}
        # pre-quantised weights shown decoded (`substitute`): their stored tensors, and how to decode each
        self._encoded: dict[str, TensorInfo] = {}
        self._decoders: dict[str, Callable[[], torch.Tensor]] = {}
        files = self._weight_files()
        index_map = self._index_map()
        headers = {f: read_safetensors_header(f) for f in files}
        for file, entries in headers.items():
            for name, info in entries.items():
                if name in self.tensors:
                    raise CheckpointError(f"tensor {name!r} appears in both {self.tensors[name].file} and {file}")
                self.tensors[name] = info
        if index_map is not None:
            for name, shard in index_map.items():
                info = self.tensors.get(name)
                if info is None:
                    raise CheckpointError(
                        f"{self.path / INDEX_FILE} names tensor {name!r} in {shard}, but no shard holds it"
                    )
                if info.file.name != shard:
                    raise CheckpointError(
                        f"{self.path / INDEX_FILE} places tensor {name!r} in {shard}, but it is in {info.file.name}"
                    )

    def _index_map(self) -> dict[str, str] | None:
        index_file = self.path / INDEX_FILE
        if not index_file.is_file():
            return None
        try:
            index = json.loads(index_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{index_file} is not valid JSON ({exc})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(f"{index_file} has no valid 'weight_map' object of tensor name -> shard file")
        if not weight_map:
            raise CheckpointError(f"{index_file} has an empty 'weight_map': it names no tensors")
        return weight_map

    def _weight_files(self) -> list[Path]:
        index_map = self._index_map()
        if index_map is not None:
            shards = sorted(set(index_map.values()))
            for shard in shards:
                if Path(shard).name != shard:
                    raise CheckpointError(f"{self.path / INDEX_FILE} names shard {shard!r} outside the directory")
            missing = [s for s in shards if not (self.path / s).is_file()]
            if missing:
                raise CheckpointError(f"shard {missing[0]} named in {self.path / INDEX_FILE} is missing")
            return [self.path / s for s in shards]
        single = self.path / SINGLE_FILE
        if single.is_file():
            return [single]
        found = sorted(self.path.glob("*.safetensors"))
        if not found:
            raise CheckpointError(f"{self.path} holds no safetensors weights (no {INDEX_FILE}, no {SINGLE_FILE})")
        return found

    # ---- access ---------------------------------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        info = self.tensors.get(name) or self._encoded.get(name)
        if info is None:
            raise CheckpointError(f"tensor {name!r} is missing from checkpoint {self.path}")
        return info

    def substitute(self, name: str, shape: tuple[int, ...], stored: Sequence[str],
                   decode: Callable[[], torch.Tensor]) -> None:
        """Show `name` as an fp32 tensor of `shape` that `decode()` produces (a pre-quantised weight, dequantised), in
        place of the `stored` tensors that encode it: every reader of plain weights then loads it unchanged. The
        stored tensors leave the listing (`tensors`, `in`) but stay readable by name."""
        infos = [self.tensors.pop(n) for n in stored]
        self._encoded.update({i.name: i for i in infos})
        self.tensors[name] = TensorInfo(name, infos[0].file, "F32", tuple(shape), -1, sum(i.nbytes for i in infos))
        self._decoders[name] = decode

    def _handle(self, file: Path):
        handle = self._handles.get(file)
        if handle is None:
            from safetensors import safe_open

            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{file} cannot be opened by safetensors: {exc}") from None
            self._handles[file] = handle
        return handle

    def read(self, name: str) -> torch.Tensor:
        """One tensor, on the CPU, in its stored dtype (a substituted one decoded, in fp32)."""
        if name in self._decoders:
            return self._decoders[name]()
        info = self.info(name)
        try:
            return self._handle(info.file).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"tensor {name!r} in {info.file} cannot be read: {exc}") from None

    def read_slice(self, name: str, index: int) -> torch.Tensor:
        """`tensor[index]` of a stacked tensor (fused experts) without reading the rest."""
        if name in self._decoders:
            return self._decoders[name]()[index]
        info = self.info(name)
        try:
            return self._handle(info.file).get_slice(name)[index]
        except Exception as exc:
            raise CheckpointError(f"tensor {name!r} in {info.file} cannot be read: {exc}") from None

    def close(self) -> None:
        self._handles.clear()

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


# the routers' tensors in every family's naming: mlp.gate (DeepSeek, Qwen3, GLM), block_sparse_moe.gate (Mixtral),
# and V3's selection bias; `gate_proj` (an MLP's) does not match. What a routing predictor learned.
ROUTER_TENSOR = re.compile(r"\.gate\.(weight|e_score_correction_bias)$")


def checkpoint_fingerprint(path: str | Path) -> str:
    """sha256 over config.json and every router tensor's name and stored bytes: a predictor learned the routing of
    exactly these routers (the experts' bytes may be requantised without changing it)."""
    path = Path(path)
    digest = hashlib.sha256((path / "config.json").read_bytes())
    reader = CheckpointReader(path)
    try:
        for name in sorted(n for n in reader.tensors if ROUTER_TENSOR.search(n)):
            tensor = reader.read(name).contiguous()
            digest.update(name.encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())  # bf16 has no numpy dtype
    finally:
        reader.close()
    return digest.hexdigest()
