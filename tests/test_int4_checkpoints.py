"""int4_checkpoints.py: compressed-tensors pack-quantized, GPTQ and AWQ (gemm) checkpoints in their published layouts.
Bit orders pinned by hand-built words (AWQ's interleaved packing also against a packer written here from the
documented order); written checkpoints read back to the quantiser's own codes, scales and zero points; reads against
a float64 decoder written here from the published formulas; quantisation error within half a step; the embedded
reference model end to end; every refusal one CheckpointError sentence."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import moeprefetch
from moeprefetch.checkpoint import CheckpointReader
from moeprefetch.errors import CheckpointError
from moeprefetch.int4_checkpoints import (DEFAULT_IGNORE, Int4CheckpointArgs, Int4Parts, Int4Tensors, awq_config,
                                          compressed_tensors_config, gptq_config, pack_awq, parse_int4_config,
                                          quantize_int4, unpack_awq, write_int4_checkpoint)

CT, GPTQ, AWQ = "compressed-tensors", "gptq", "awq"
REFERENCE = Path(moeprefetch.__file__).parent / "reference_model"
NOT_GPTQ_PACKABLE = "model.layers.0.self_attn.q_a_proj"  # [20, 40]: out is not a multiple of 8 (GPTQ and AWQ)
# AutoAWQ's WQLinear_GEMM.from_linear order_map: nibble k of a word holds element AWQ_PACK_ORDER[k] of its eight
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _int32(value: int) -> int:
    """The int32 with the bits of an unsigned 32-bit value."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _write_dir(path: Path, quantization_config: dict | None, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "toy"}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def _open(path: Path) -> Int4Tensors:
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    return Int4Tensors(CheckpointReader(path), parse_int4_config(qc))


# ---- bit order, pinned by hand ------------------------------------------------------------------------------------
def test_compressed_tensors_bit_order_is_pinned(tmp_path):
    """weight_packed: column 8j + k in nibble k of word j, stored as the signed code + 8; weight_zero_point packed
    along the output rows the same way; a ragged last word uses its low nibbles only."""
    packed = torch.tensor([[0x76543210, _int32(0xFEDCBA98)], [_int32(0x89ABCDEF), 0x00003210]], dtype=torch.int32)
    scale = torch.tensor([[1.0, 0.5], [2.0, 0.25]], dtype=torch.bfloat16)
    tensors = {"m.weight_packed": packed, "m.weight_scale": scale, "m.weight_shape": torch.tensor([2, 12])}
    sym = _open(_write_dir(tmp_path / "sym", compressed_tensors_config(8, True, []), tensors))
    parts = sym.read_parts("m")
    assert parts.q.tolist() == [list(range(12)), [15, 14, 13, 12, 11, 10, 9, 8, 0, 1, 2, 3]]
    assert parts.zero is None and parts.group == 8
    expected = [[c - 8 for c in range(8)] + [(c - 8) * 0.5 for c in range(8, 12)],
                [(c - 8) * 2.0 for c in (15, 14, 13, 12, 11, 10, 9, 8)] + [(c - 8) * 0.25 for c in (0, 1, 2, 3)]]
    assert sym.read_float("m").tolist() == expected
    # asymmetric: zero points (row 0, row 1) = (5, 3) in group 0 and (15, 0) in group 1, packed along the rows
    zp = torch.tensor([[0x35, 0x0F]], dtype=torch.int32)
    asym = _open(_write_dir(tmp_path / "asym", compressed_tensors_config(8, False, []),
                            {**tensors, "m.weight_zero_point": zp}))
    parts = asym.read_parts("m")
    assert parts.zero.tolist() == [[5.0, 15.0], [3.0, 0.0]]
    got = asym.read_float("m")
    assert got[0, :8].tolist() == [c - 5 for c in range(8)]
    assert got[1, 8:].tolist() == [c * 0.25 for c in (0, 1, 2, 3)]
    # compressed-tensors before 0.9.4: unpacked signed int8 zero points [out, groups]
    old = _open(_write_dir(tmp_path / "old", compressed_tensors_config(8, False, []),
                           {**tensors, "m.weight_zero_point": torch.tensor([[-3, 7], [-5, -8]], dtype=torch.int8)}))
    assert old.read_parts("m").zero.tolist() == [[5.0, 15.0], [3.0, 0.0]]


def test_gptq_bit_order_and_v1_zero_points_are_pinned(tmp_path):
    """qweight [in/8, out]: input row 8r + k in nibble k of word [r, o]; qzeros [groups, out/8]: output column 8c + k
    in nibble k of word [g, c]; v1 stores every zero point minus one on the word, borrows included (so it is read by
    adding 0x11111111 to the word: adding 1 to each nibble would read column 2 below as 4)."""
    qweight = torch.tensor([[0x76543210, 0x01234567] + [_int32(0x88888888)] * 6], dtype=torch.int32)  # in 8, out 8
    scales = torch.tensor([[1.0, 2.0] + [1.0] * 6, [0.5, 4.0] + [1.0] * 6], dtype=torch.float16)  # groups of 4
    zeros_v2 = [0x88888503, 0x88888888]  # group 0, columns 0..7: 3, 0, 5, 8, 8, 8, 8, 8; group 1: all 8
    zeros_v1 = [(word - 0x11111111) % (1 << 32) for word in zeros_v2]
    assert zeros_v1 == [0x777773F2, 0x77777777]  # column 1: 0 - 1 = 15, borrowing from column 2 (5 - 1 - 1 = 3)
    g_idx = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.int32)
    for fmt, words in (("gptq", zeros_v1), ("gptq_v2", zeros_v2)):
        qzeros = torch.tensor([[_int32(w)] for w in words], dtype=torch.int32)
        path = _write_dir(tmp_path / fmt, gptq_config(4, False, fmt),
                          {"m.qweight": qweight, "m.scales": scales, "m.qzeros": qzeros, "m.g_idx": g_idx})
        int4 = _open(path)
        parts = int4.read_parts("m")
        assert parts.q[:2].tolist() == [list(range(8)), list(range(7, -1, -1))] and parts.group == 4
        assert (parts.q[2:] == 8).all()
        assert parts.zero.tolist() == [[3.0, 8.0], [0.0, 8.0], [5.0, 8.0]] + [[8.0, 8.0]] * 5
        assert parts.scale[:2].tolist() == [[1.0, 0.5], [2.0, 4.0]]
        got = int4.read_float("m")
        assert got[0].tolist() == [(c - 3) * 1.0 for c in range(4)] + [(c - 8) * 0.5 for c in range(4, 8)]
        assert got[1].tolist() == [(c - 0) * 2.0 for c in (7, 6, 5, 4)] + [(c - 8) * 4.0 for c in (3, 2, 1, 0)]
        assert got[2].tolist() == [3.0] * 4 + [0.0] * 4
    # a symmetric v1 checkpoint holds 0x77777777: zero point 8 everywhere, read as symmetric
    sym = _write_dir(tmp_path / "sym", gptq_config(4, True), {
        "m.qweight": qweight, "m.scales": scales, "m.g_idx": g_idx,
        "m.qzeros": torch.full((2, 1), 0x77777777, dtype=torch.int32)})
    assert _open(sym).read_parts("m").zero is None


def test_awq_bit_order_is_pinned(tmp_path):
    """qweight [in, out/8] and qzeros [groups, out/8], packed along the outputs: nibble k of word [i, j] holds output
    column 8j + [0, 2, 4, 6, 1, 3, 5, 7][k], so the word 0x76543210 (nibble k = k) reads as columns 0..7 = 0, 4, 1,
    5, 2, 6, 3, 7 (vLLM's reverse AWQ order); no zero-point offset."""
    qweight = torch.tensor([[0x76543210], [_int32(0xFEDCBA98)], [0x11111111], [0]], dtype=torch.int32)  # in 4, out 8
    scales = torch.tensor([[1.0, 2.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.25], [4.0] * 8], dtype=torch.float16)  # groups of 2
    qzeros = torch.tensor([[0x00000053], [_int32(0x88888888)]], dtype=torch.int32)  # group 0: zero 3 (col 0), 5 (col 2)
    path = _write_dir(tmp_path / "asym", awq_config(2, False, []), {"m.qweight": qweight, "m.scales": scales,
                                                                      "m.qzeros": qzeros})
    int4 = _open(path)
    assert int4.weight_shape("m") == (8, 4) and int4.tensor_names("m") == ("m.qweight", "m.qzeros", "m.scales")
    parts = int4.read_parts("m")
    assert parts.q[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert parts.q[:, 1].tolist() == [8, 12, 9, 13, 10, 14, 11, 15]
    assert parts.q[:, 2].tolist() == [1] * 8 and parts.q[:, 3].tolist() == [0] * 8
    assert parts.zero.tolist() == [[3.0, 8.0], [0.0, 8.0], [5.0, 8.0]] + [[0.0, 8.0]] * 5
    got = int4.read_float("m")
    assert got[0].tolist() == [(0 - 3) * 1.0, (8 - 3) * 1.0, (1 - 8) * 4.0, (0 - 8) * 4.0]
    assert got[2].tolist() == [(1 - 5) * 0.5, (9 - 5) * 0.5, -28.0, -32.0]
    assert got[7].tolist() == [7 * 0.25, 15 * 0.25, -28.0, -32.0]
    # zero_point false (GPTQModel's sym): qzeros hold 8 everywhere and read as symmetric
    eights = torch.full((2, 1), _int32(0x88888888), dtype=torch.int32)
    sym = _write_dir(tmp_path / "sym", awq_config(2, True, []), {"m.qweight": qweight, "m.scales": scales,
                                                                  "m.qzeros": eights})
    parts = _open(sym).read_parts("m")
    assert parts.zero is None and parts.q[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def _reference_awq_pack(codes: torch.Tensor) -> torch.Tensor:
    """Pure torch from the documented layout: word [r, j] = sum_k codes[r, 8j + ORDER[k]] << 4k, as int32 bits."""
    rows, cols = codes.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for k, column in enumerate(AWQ_PACK_ORDER):
        words |= codes[:, column::8].to(torch.int64) << (4 * k)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _reference_awq_unpack(words: torch.Tensor) -> torch.Tensor:
    rows, count = words.shape
    codes = torch.empty(rows, count * 8, dtype=torch.uint8)
    for k, column in enumerate(AWQ_PACK_ORDER):
        codes[:, column::8] = ((words.to(torch.int64) >> (4 * k)) & 15).to(torch.uint8)
    return codes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_awq_packing_round_trips_against_a_reference_packer(seed):
    g = torch.Generator().manual_seed(seed)
    rows, cols = int(torch.randint(1, 40, (1,), generator=g)), 8 * int(torch.randint(1, 12, (1,), generator=g))
    codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    codes[0, :8] = 15  # a word with its top nibble >= 8 is a negative int32
    words = pack_awq(codes)
    assert words.dtype == torch.int32 and tuple(words.shape) == (rows, cols // 8)
    assert torch.equal(words, _reference_awq_pack(codes))
    assert torch.equal(unpack_awq(words), codes) and torch.equal(_reference_awq_unpack(words), codes)
    random_words = torch.randint(-2**31, 2**31, (rows, cols // 8), generator=g, dtype=torch.int64).to(torch.int32)
    assert torch.equal(unpack_awq(random_words), _reference_awq_unpack(random_words))
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_awq(codes[:, :7])


# ---- written checkpoints ------------------------------------------------------------------------------------------
def _toy_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(37)

    def w(out, cols, dtype=torch.bfloat16):
        scale = torch.rand(out, 1, generator=g) * 0.2 + 0.01
        x = torch.randn(out, cols, generator=g) * scale
        x[0, 3] *= 8  # an outlier
        return x.to(dtype)

    gate = w(48, 256)
    gate[1] = 0  # an all-zero row
    gate[2] = gate[2].abs()  # a row with no negative weights
    return {
        "model.embed_tokens.weight": w(64, 256),
        "model.norm.weight": torch.ones(256, dtype=torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.ones(256, dtype=torch.bfloat16),
        "model.layers.0.mlp.experts.0.gate_proj.weight": gate,
        "model.layers.0.mlp.experts.0.down_proj.weight": w(256, 48),  # in = 48: ragged for groups of 32
        "model.layers.0.mlp.gate.weight": w(8, 256, torch.float32),  # the router: ignored
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": w(80, 256),
        "model.layers.0.self_attn.o_proj.weight": w(24, 136, torch.float32),  # fp32, in = 136: ragged for 32 and 128
        "model.layers.0.self_attn.o_proj.bias": torch.randn(24, generator=g),
        NOT_GPTQ_PACKABLE + ".weight": w(20, 40),
        "lm_head.weight": w(64, 256),
    }


COMBOS = [(m, s, g) for m in (CT, GPTQ, AWQ) for s in (True, False) for g in (32, 128, 0)]


def _combo_id(combo) -> str:
    method, symmetric, group = combo
    return f"{'ct' if method == CT else method}-{'sym' if symmetric else 'asym'}-{'channel' if group == 0 else group}"


@pytest.fixture(scope="module")
def toy_source(tmp_path_factory) -> Path:
    path = _write_dir(tmp_path_factory.mktemp("toy_float"), None, _toy_weights())
    (path / "tokenizer_config.json").write_text("{}")
    return path


@pytest.fixture(scope="module", params=COMBOS, ids=_combo_id)
def written(request, toy_source, tmp_path_factory):
    method, symmetric, group = request.param
    ignore = DEFAULT_IGNORE + ((NOT_GPTQ_PACKABLE,) if method != CT else ())
    out = write_int4_checkpoint(toy_source, tmp_path_factory.mktemp(_combo_id(request.param)), method, group,
                                symmetric, ignore=ignore)
    return request.param, out, load_file(str(toy_source / "model.safetensors"))


def test_written_config_parses_to_the_arguments(written):
    (method, symmetric, group), path, _ = written
    config = json.loads((path / "config.json").read_text())
    args = parse_int4_config(config["quantization_config"])
    assert (args.method, args.group_size, args.symmetric) == (method, group, symmetric)
    if method == CT:
        assert set(args.ignore) == {"lm_head", "model.layers.0.mlp.gate"}
        weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
        assert weights["strategy"] == ("channel" if group == 0 else "group")
        assert weights["group_size"] == (None if group == 0 else group)
    elif method == AWQ:  # AutoAWQ's to_transformers_dict keys; the ignored modules by full name
        qc = config["quantization_config"]
        assert set(args.ignore) == {"lm_head", "model.layers.0.mlp.gate", NOT_GPTQ_PACKABLE}
        assert args.is_ignored("model.layers.0.mlp.gate")
        assert not args.is_ignored("model.layers.0.mlp.experts.0.up_proj")
        assert (qc["bits"], qc["version"], qc["zero_point"]) == (4, "gemm", not symmetric)
        assert qc["group_size"] == (-1 if group == 0 else group) and args.checkpoint_format == "gemm"
        assert args.gptq_zero_offset == 0 and not (path / "quantize_config.json").exists()
    else:
        assert args.ignore == () and args.checkpoint_format == "gptq" and args.gptq_zero_offset == 1
        assert json.loads((path / "quantize_config.json").read_text()) == config["quantization_config"]
        assert config["quantization_config"]["group_size"] == (-1 if group == 0 else group)
    assert (path / "tokenizer_config.json").is_file()


def test_written_tensors_have_the_published_names_dtypes_and_shapes(written):
    (method, symmetric, group), path, source = written
    reader = CheckpointReader(path)
    int4 = _open(path)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight"):
        kept = reader.read(name)
        assert kept.dtype == source[name].dtype and torch.equal(kept, source[name])  # left as it was
        assert not int4.is_quantized(name.removesuffix(".weight"))
    expected_bases = {n.removesuffix(".weight") for n in source if "_proj" in n and n.endswith(".weight")
                      and not (method != CT and n.startswith(NOT_GPTQ_PACKABLE))}
    assert len(expected_bases) == (5 if method == CT else 4)
    assert set(int4.bases()) == expected_bases
    for base in expected_bases:
        out, cols = source[base + ".weight"].shape
        g = cols if group == 0 else min(group, cols)
        groups = -(-cols // g)
        assert base + ".weight" not in reader and int4.is_quantized(base)
        assert int4.weight_shape(base) == (out, cols)
        info = {n.rsplit(".", 1)[1]: (reader.info(n).dtype, reader.info(n).shape) for n in int4.tensor_names(base)}
        assert int4.weight_names()[base + ".weight"] == int4.tensor_names(base)
        if method == CT:
            stored_scale = "F32" if source[base + ".weight"].dtype == torch.float32 else "BF16"
            want = {"weight_packed": ("I32", (out, -(-cols // 8))), "weight_scale": (stored_scale, (out, groups)),
                    "weight_shape": ("I64", (2,))}
            if not symmetric:
                want["weight_zero_point"] = ("I32", (-(-out // 8), groups))
        elif method == AWQ:  # zero points stored even without zero_point (all 8)
            want = {"qweight": ("I32", (cols, out // 8)), "qzeros": ("I32", (groups, out // 8)),
                    "scales": ("F16", (groups, out))}
        else:
            want = {"qweight": ("I32", (cols // 8, out)), "qzeros": ("I32", (groups, out // 8)),
                    "scales": ("F16", (groups, out)), "g_idx": ("I32", (cols,))}
        assert info == want, base
    bias = reader.info("model.layers.0.self_attn.o_proj.bias").dtype
    assert bias == ("F32" if method == CT else "F16")  # GPTQModel and AutoAWQ store a quantised module's bias in fp16


def test_written_parts_are_the_quantisers(written):
    """Writing then read_parts gives back exactly the codes, scales and zero points quantize_int4 computed."""
    (method, symmetric, group), path, source = written
    int4 = _open(path)
    for base in int4.bases():
        want = quantize_int4(source[base + ".weight"], method, group, symmetric)
        got = int4.read_parts(base)
        assert got.group == want.group and torch.equal(got.q, want.q), base
        assert torch.equal(got.scale, want.scale), base
        if symmetric:
            assert got.zero is None and want.zero is None
        else:
            assert torch.equal(got.zero, want.zero), base


def _reference_compressed_tensors(f, base: str, symmetric: bool, group: int) -> torch.Tensor:
    """float64 from the published formula: w = (c - z) * s, c and z signed -8..7 stored as nibble + 8."""
    out, cols = (int(v) for v in f.get_tensor(base + ".weight_shape").tolist())
    words = f.get_tensor(base + ".weight_packed").numpy().view(np.uint32)
    nibbles = np.stack([(words >> np.uint32(4 * k)) & np.uint32(0xF) for k in range(8)], axis=-1)
    codes = nibbles.reshape(out, -1)[:, :cols].astype(np.int64) - 8
    scale = f.get_tensor(base + ".weight_scale").double().numpy()
    g = cols if group == 0 else min(group, cols)
    cols_group = np.arange(cols) // g
    if symmetric:
        zero = np.zeros((out, scale.shape[1]), dtype=np.int64)
    else:
        zwords = f.get_tensor(base + ".weight_zero_point").numpy().view(np.uint32)  # [ceil(out/8), groups]
        znib = np.stack([(zwords >> np.uint32(4 * k)) & np.uint32(0xF) for k in range(8)], axis=1)  # [rows, 8, groups]
        zero = znib.reshape(-1, zwords.shape[1])[:out].astype(np.int64) - 8
    return torch.from_numpy((codes - zero[:, cols_group]) * scale[:, cols_group])


def _reference_gptq(f, base: str, v1: bool) -> torch.Tensor:
    """float64 from the published formula: w[o, i] = scales[g_idx[i], o] * (q[i, o] - zeros[g_idx[i], o])."""
    words = f.get_tensor(base + ".qweight").numpy().view(np.uint32)  # [in/8, out]
    q = np.stack([(words >> np.uint32(4 * k)) & np.uint32(0xF) for k in range(8)], axis=1)  # [in/8, 8, out]
    q = q.reshape(-1, words.shape[1]).astype(np.int64)  # [in, out]
    zwords = f.get_tensor(base + ".qzeros").numpy().view(np.uint32).astype(np.uint64)  # [groups, out/8]
    if v1:
        zwords = (zwords + 0x11111111) & 0xFFFFFFFF
    z = np.stack([(zwords >> np.uint64(4 * k)) & np.uint64(0xF) for k in range(8)], axis=-1)
    z = z.reshape(zwords.shape[0], -1).astype(np.int64)  # [groups, out]
    scales = f.get_tensor(base + ".scales").double().numpy()
    g_idx = f.get_tensor(base + ".g_idx").numpy().astype(np.int64)
    return torch.from_numpy((scales[g_idx] * (q - z[g_idx])).T.copy())


def _awq_nibbles(words: np.ndarray) -> np.ndarray:
    """int32 [R, W] -> [R, 8W]: nibble k of word j is element 8j + AWQ_PACK_ORDER[k]."""
    words = words.view(np.uint32)
    out = np.empty((words.shape[0], words.shape[1], 8), dtype=np.int64)
    for k, column in enumerate(AWQ_PACK_ORDER):
        out[:, :, column] = (words >> np.uint32(4 * k)) & np.uint32(0xF)
    return out.reshape(words.shape[0], -1)


def _reference_awq(f, base: str, group: int) -> torch.Tensor:
    """float64 from the published formula: w[o, i] = (q[i, o] - zeros[i // g, o]) * scales[i // g, o]."""
    q = _awq_nibbles(f.get_tensor(base + ".qweight").numpy())  # [in, out]
    z = _awq_nibbles(f.get_tensor(base + ".qzeros").numpy())  # [groups, out]
    scales = f.get_tensor(base + ".scales").double().numpy()
    cols = q.shape[0]
    rows_group = np.arange(cols) // (cols if group == 0 else min(group, cols))
    return torch.from_numpy(((q - z[rows_group]) * scales[rows_group]).T.copy())


def test_read_float_matches_a_float64_reference_of_the_published_formula(written):
    (method, symmetric, group), path, _ = written
    int4 = _open(path)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for base in int4.bases():
            if method == CT:
                ref = _reference_compressed_tensors(f, base, symmetric, group)
            elif method == AWQ:
                ref = _reference_awq(f, base, group)
            else:
                ref = _reference_gptq(f, base, v1=True)
            got = int4.read_float(base)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=0)
            torch.testing.assert_close(int4.read_parts(base).dequantize(torch.float64), ref, rtol=1e-6, atol=0)


def _bound_ratio(weight: torch.Tensor, parts: Int4Parts, stored_scale_dtype: torch.dtype) -> float:
    """max |w - w_hat| / (scale / 2 + eps), eps = 16 rounding units of the stored scale dtype times the scale: the
    quantisers round w / scale with the scale before (GPTQ) or after (compressed-tensors) it is stored, so the 15
    steps of a group can grow by 15 units of that rounding."""
    unit = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[stored_scale_dtype]
    scale = parts.scale[:, torch.arange(weight.shape[1]) // parts.group]
    error = (weight.float() - parts.dequantize()).abs()
    return (error / (scale * (0.5 + 16 * unit))).max().item()


def test_dequantised_error_is_within_half_a_step(written):
    (method, symmetric, group), path, source = written
    int4 = _open(path)
    for base in int4.bases():
        weight = source[base + ".weight"]
        stored = weight.dtype if method == CT else torch.float16
        assert _bound_ratio(weight, int4.read_parts(base), stored) <= 1.0, base
    zero_row = int4.read_float("model.layers.0.mlp.experts.0.gate_proj")[1]
    assert torch.equal(zero_row, torch.zeros_like(zero_row))  # zero is representable in every format


@pytest.mark.parametrize("method,symmetric,group", [(CT, False, 32), (GPTQ, True, 128), (AWQ, False, 128)],
                         ids=["ct-asym-32", "gptq-sym-128", "awq-asym-128"])
def test_the_reference_model_round_trips(tmp_path, method, symmetric, group):
    """The embedded model: every projection quantised (experts, shared experts, attention, MTP), the routers and
    lm_head kept, the shards and index rewritten, the tokenizer files copied."""
    out = write_int4_checkpoint(REFERENCE, tmp_path / "q", method, group, symmetric)
    source, reader = CheckpointReader(REFERENCE), CheckpointReader(out)  # the rewritten index validates
    int4 = _open(out)
    projections = [n.removesuffix(".weight") for n in source.tensors if "proj" in n and n.endswith(".weight")]
    assert sorted(int4.bases()) == sorted(projections) and len(projections) > 500
    assert "lm_head.weight" in reader and "model.layers.1.mlp.gate.weight" in reader
    assert reader.info("model.layers.1.mlp.gate.e_score_correction_bias").dtype == "F32"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (REFERENCE / name).read_bytes()
    for base in int4.bases():
        weight = source.read(base + ".weight")
        stored = weight.dtype if method == CT else torch.float16
        assert _bound_ratio(weight, int4.read_parts(base), stored) <= 1.0, base
    assert int4.is_quantized("model.layers.1.mlp.experts.3.gate_proj")


def test_gptq_writer_refuses_what_gptq_cannot_pack(toy_source, tmp_path):
    with pytest.raises(ValueError, match="multiples of 8"):
        write_int4_checkpoint(toy_source, tmp_path / "q", GPTQ)
    with pytest.raises(ValueError, match="out is a multiple of 8"):
        write_int4_checkpoint(toy_source, tmp_path / "a", AWQ)
    with pytest.raises(ValueError, match="'gemm' only"):
        write_int4_checkpoint(toy_source, tmp_path / "v", AWQ, checkpoint_format="gemv")


def test_gptq_v2_is_written_and_read_without_the_offset(toy_source, tmp_path):
    ignore = DEFAULT_IGNORE + (NOT_GPTQ_PACKABLE,)
    v1 = _open(write_int4_checkpoint(toy_source, tmp_path / "v1", GPTQ, 32, False, ignore=ignore))
    v2 = _open(write_int4_checkpoint(toy_source, tmp_path / "v2", GPTQ, 32, False, ignore=ignore,
                                     checkpoint_format="gptq_v2"))
    assert v2.args.checkpoint_format == "gptq_v2" and v2.args.gptq_zero_offset == 0
    base = "model.layers.0.mlp.experts.0.down_proj"
    a, b = v1.reader.read(base + ".qzeros"), v2.reader.read(base + ".qzeros")
    assert not torch.equal(a, b) and torch.equal(v1.read_float(base), v2.read_float(base))


# ---- refusals -----------------------------------------------------------------------------------------------------
def _ct(**weights) -> dict:
    config = compressed_tensors_config(128, True, ["lm_head"])
    config["config_groups"]["group_0"]["weights"].update(weights)
    return config


def _one_sentence(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message and message.count(". ") == 0, message
    return message


@pytest.mark.parametrize("config,match", [
    (_ct(num_bits=8), "8-bit weights"),
    (_ct(type="float"), "4-bit float weights"),
    ({**_ct(), "format": "marlin-24"}, "format 'marlin-24' is not supported"),
    ({**_ct(), "format": "nvfp4-pack-quantized"}, "format 'nvfp4-pack-quantized' is not supported"),
    ({**_ct(), "format": "bogus-format"}, "an unknown format"),
    (_ct(actorder="group"), "activation ordering"),
    (_ct(strategy="tensor", group_size=None), "'tensor' strategy"),
    (_ct(dynamic=True), "dynamic"),
    ({**_ct(), "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "KV-cache"),
    ({**_ct(), "transform_config": {"config_groups": {"u": {}}}}, "transform_config"),
    ({**_ct(), "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 128},
                                             "input_activations": {"num_bits": 8}}}}, "quantises activations"),
    ({**_ct(), "config_groups": {"W8A16": ["Linear"]}}, "preset scheme 'W8A16'"),
    ({**_ct(), "config_groups": {
        "a": {"targets": ["re:.*experts.*"], "weights": {"num_bits": 4, "group_size": 128, "symmetric": True}},
        "b": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32, "symmetric": True}}}},
     "different group sizes"),
    ({**gptq_config(128, True), "bits": 3}, "3-bit"),
    ({**gptq_config(128, True), "bits": 8}, "8-bit"),
    ({**gptq_config(128, True), "desc_act": True}, "desc_act"),
    ({**gptq_config(128, True), "checkpoint_format": "marlin", "format": "marlin"}, "checkpoint_format 'marlin'"),
    ({**gptq_config(128, True), "pack_dtype": "int16"}, "pack_dtype"),
    ({**gptq_config(128, True), "dynamic": {r"+:.*down_proj": {"bits": 8}}}, "dynamic override"),
    ({**awq_config(128, False, []), "bits": 8}, "AWQ with 8-bit weights"),
    ({"quant_method": "awq", "w_bit": 3, "q_group_size": 128, "zero_point": True}, "AWQ with 3-bit weights"),
    ({**awq_config(128, False, []), "version": "gemv"}, "AWQ version 'gemv'"),
    ({**awq_config(128, False, []), "version": "GEMV_FAST"}, "AWQ version 'gemv_fast'"),
    ({**awq_config(128, False, []), "version": "marlin"}, "AWQ version 'marlin'"),
    ({**awq_config(128, False, []), "version": "exllama"}, "AWQ version 'exllama'"),
    ({**awq_config(128, False, []), "version": "ipex"}, "AWQ version 'ipex'"),
    ({**awq_config(128, False, []), "version": None, "format": "gemv_fast"}, "AWQ version 'gemv_fast'"),
    ({**awq_config(128, False, []), "backend": "llm-awq"}, "AWQ version 'llm-awq'"),
    ({**awq_config(128, False, []), "desc_act": True}, "AWQ with desc_act"),
    ({**awq_config(128, False, []), "pack_dtype": "int16"}, "AWQ pack_dtype 'int16'"),
    ({**awq_config(128, False, []), "rotation": "hadamard"}, "rotation"),
    ({**awq_config(128, False, []), "dynamic": {r"+:.*down_proj": {"group_size": 32}}}, "AWQ dynamic override"),
    ({"quant_method": "awq_marlin", "bits": 4, "group_size": 128}, "'awq_marlin' is not supported"),
])
def test_unreadable_configs_are_refused_in_one_sentence(config, match):
    with pytest.raises(CheckpointError, match=match) as err:
        parse_int4_config(config)
    assert "supported: compressed-tensors 'pack-quantized'" in _one_sentence(err)


def test_configs_that_are_read():
    assert parse_int4_config(None) is None and parse_int4_config({}) is None
    assert parse_int4_config({"quant_method": "fp8", "weight_block_size": [128, 128]}) is None
    channel = parse_int4_config(_ct(strategy="channel", group_size=-1, symmetric=False))
    assert (channel.group_size, channel.symmetric, channel.group_for(136)) == (0, False, 136)
    assert parse_int4_config(_ct(strategy=None, group_size=64, actorder="weight")).group_size == 64
    preset = parse_int4_config({**_ct(), "config_groups": {"W4A16_ASYM": ["Linear"]}})
    assert (preset.group_size, preset.symmetric) == (128, False)
    assert parse_int4_config({**_ct(), "format": "mixed-precision"}).ignore == ("lm_head",)
    legacy = {"bits": 4, "group_size": 128, "damp_percent": 0.01, "desc_act": False, "static_groups": False,
              "sym": True, "true_sequential": True, "model_name_or_path": None, "model_file_base_name": "model",
              "quant_method": "gptq"}  # an AutoGPTQ-era config: no checkpoint_format means v1
    assert parse_int4_config(legacy) == Int4CheckpointArgs(GPTQ, 128, True, (), "gptq")
    assert parse_int4_config({**legacy, "desc_act": True, "static_groups": True}).group_size == 128
    assert parse_int4_config({**legacy, "group_size": -1}).group_size == 0
    v2 = parse_int4_config({**legacy, "format": "gptq_v2"})
    assert v2.checkpoint_format == "gptq_v2" and v2.gptq_zero_offset == 0
    skipping = parse_int4_config({**legacy, "dynamic": {"-:.*mlp.gate": {}}})
    assert skipping.symmetric


def test_awq_configs_that_are_read():
    autoawq = {"quant_method": "awq", "zero_point": True, "group_size": 128, "bits": 4, "version": "GEMM",
               "modules_to_not_convert": None}  # AutoAWQ's to_transformers_dict (older releases: version upper case)
    assert parse_int4_config(autoawq) == Int4CheckpointArgs(AWQ, 128, False, (), "gemm")
    old_keys = {"quant_method": "awq", "zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "gemm"}
    assert parse_int4_config(old_keys).group_size == 64
    assert parse_int4_config({"quant_method": "awq", "bits": 4}) == Int4CheckpointArgs(AWQ, 128, False, (), "gemm")
    assert parse_int4_config({**autoawq, "group_size": -1}).group_size == 0
    gptqmodel_sym = {"bits": 4, "group_size": 128, "desc_act": False, "quant_method": "awq", "format": "gemm",
                     "checkpoint_format": "gemm", "pack_dtype": "int32", "zero_point": False, "version": "gemm",
                     "dynamic": {"-:.*mlp.gate": {}, "+:.*down_proj": {"sym": True}}, "meta": {}}
    assert parse_int4_config(gptqmodel_sym) == Int4CheckpointArgs(AWQ, 128, True, (), "gemm")
    # newer transformers: AwqConfig as a GPTQConfig, with its sym field; zero_point decides, backend is a kernel
    newer = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "sym": True, "backend": "auto",
             "format": "gemm", "checkpoint_format": "gemm", "desc_act": False, "modules_to_not_convert": ["mlp.gate"]}
    args = parse_int4_config(newer)
    assert (args.group_size, args.symmetric, args.ignore) == (32, False, ("mlp.gate",))
    assert args.is_ignored("model.layers.3.mlp.gate") and not args.is_ignored("model.layers.3.mlp.experts.0.up_proj")
    for bad, match in ((0, "group_size"), (True, "group_size"), ("128", "group_size")):
        with pytest.raises(CheckpointError, match=match):
            parse_int4_config({**autoawq, "group_size": bad})
    with pytest.raises(CheckpointError, match="zero_point must be true or false"):
        parse_int4_config({**autoawq, "zero_point": "yes"})
    with pytest.raises(CheckpointError, match="modules_to_not_convert"):
        parse_int4_config({**autoawq, "modules_to_not_convert": "lm_head"})


def _tampered(source: Path, tmp_path: Path, edit) -> Int4Tensors:
    tensors = load_file(str(source / "model.safetensors"))
    edit(tensors)
    out = tmp_path / "tampered"
    qc = json.loads((source / "config.json").read_text())["quantization_config"]
    return _open(_write_dir(out, qc, tensors))


@pytest.fixture(scope="module")
def small_ct(tmp_path_factory, toy_source) -> Path:
    return write_int4_checkpoint(toy_source, tmp_path_factory.mktemp("small_ct"), CT, 32, False)


@pytest.fixture(scope="module")
def small_gptq(tmp_path_factory, toy_source) -> Path:
    return write_int4_checkpoint(toy_source, tmp_path_factory.mktemp("small_gptq"), GPTQ, 32, False,
                                 ignore=DEFAULT_IGNORE + (NOT_GPTQ_PACKABLE,))


BASE = "model.layers.0.mlp.experts.0.down_proj"  # [256, 48]


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop(BASE + ".weight_scale"), f"'{BASE}.weight_scale' is missing"),
    (lambda t: t.pop(BASE + ".weight_zero_point"), f"'{BASE}.weight_zero_point' is missing"),
    (lambda t: t.pop(BASE + ".weight_shape"), f"'{BASE}.weight_shape' is missing"),
    (lambda t: t.update({BASE + ".weight_scale": t[BASE + ".weight_scale"][:, :1]}), r"shape \[256, 1\], expected"),
    (lambda t: t.update({BASE + ".weight_shape": torch.tensor([256, 64])}), "says \\[256, 64\\]"),
    (lambda t: t.update({BASE + ".weight_packed": t[BASE + ".weight_packed"].long()}), "expected a 2-D int32"),
    (lambda t: t.update({BASE + ".weight_zero_point": t[BASE + ".weight_zero_point"][:1]}), "zero points packed"),
    (lambda t: t.update({BASE + ".weight_scale": t[BASE + ".weight_scale"] * float("nan")}), "non-finite"),
    (lambda t: t.update({BASE + ".weight_g_idx": torch.arange(48, dtype=torch.int32).flip(0) // 32}), "act-order"),
])
def test_defective_compressed_tensors_weights_name_the_tensor(small_ct, tmp_path, edit, match):
    int4 = _tampered(small_ct, tmp_path, edit)
    with pytest.raises(CheckpointError, match=match) as err:
        int4.read_parts(BASE)
    assert BASE in _one_sentence(err)


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop(BASE + ".scales"), f"'{BASE}.scales' is missing"),
    (lambda t: t.pop(BASE + ".qzeros"), f"'{BASE}.qzeros' is missing"),
    (lambda t: t.update({BASE + ".scales": t[BASE + ".scales"][:1]}), r"shape \[1, 256\], expected \[2, 256\]"),
    (lambda t: t.update({BASE + ".qzeros": t[BASE + ".qzeros"][:, :4]}), "eight zero points per int32"),
    (lambda t: t.update({BASE + ".qweight": t[BASE + ".qweight"].float()}), "expected a 2-D int32"),
    (lambda t: t.update({BASE + ".g_idx": t[BASE + ".g_idx"].flip(0)}), "act-order"),
])
def test_defective_gptq_weights_name_the_tensor(small_gptq, tmp_path, edit, match):
    int4 = _tampered(small_gptq, tmp_path, edit)
    with pytest.raises(CheckpointError, match=match) as err:
        int4.read_parts(BASE)
    assert BASE in _one_sentence(err)


@pytest.fixture(scope="module")
def small_awq(tmp_path_factory, toy_source) -> Path:
    return write_int4_checkpoint(toy_source, tmp_path_factory.mktemp("small_awq"), AWQ, 32, False,
                                 ignore=DEFAULT_IGNORE + (NOT_GPTQ_PACKABLE,))


@pytest.mark.parametrize("edit,match", [  # BASE: qweight [48, 32], scales [2, 256], qzeros [2, 32]
    (lambda t: t.pop(BASE + ".scales"), f"'{BASE}.scales' is missing"),
    (lambda t: t.pop(BASE + ".qzeros"), f"'{BASE}.qzeros' is missing"),
    (lambda t: t.update({BASE + ".scales": t[BASE + ".scales"][:1]}), r"shape \[1, 256\], expected \[2, 256\]"),
    (lambda t: t.update({BASE + ".qzeros": t[BASE + ".qzeros"][:, :4]}), "eight zero points per int32"),
    (lambda t: t.update({BASE + ".qweight": t[BASE + ".qweight"].float()}), "expected a 2-D int32"),
    (lambda t: t.update({BASE + ".scales": t[BASE + ".scales"] * float("inf")}), "non-finite"),
    # a GPTQ-shaped qweight [in / 8, out] under an AWQ config reads as another shape, which the scales refute
    (lambda t: t.update({BASE + ".qweight": t[BASE + ".qweight"][:6]}), r"expected \[1, 256\]"),
])
def test_defective_awq_weights_name_the_tensor(small_awq, tmp_path, edit, match):
    int4 = _tampered(small_awq, tmp_path, edit)
    with pytest.raises(CheckpointError, match=match) as err:
        int4.read_parts(BASE)
    assert BASE in _one_sentence(err)


def test_the_writer_refuses_a_quantised_source(small_ct, tmp_path):
    with pytest.raises(CheckpointError, match="already quantised"):
        write_int4_checkpoint(small_ct, tmp_path / "again", CT)


# ---- loading 4-bit checkpoints into the engine ----------------------------------------------------------------------


def _dequantised_copy(path: Path, out: Path) -> Path:
    """The float checkpoint that a 4-bit one means: every tensor as the engine's reader shows it (4-bit weights
    dequantised by the published formula), so the two must compute the same model."""
    import shutil

    from moeprefetch.config import load_model_args
    from moeprefetch.int4_checkpoints import present_int4_weights

    reader = CheckpointReader(path)
    int4 = present_int4_weights(reader, load_model_args(path).int4)
    out.mkdir()
    save_file({name: reader.read(name).contiguous() for name in reader.tensors}, str(out / "model.safetensors"))
    int4.reader.close()
    for file in path.iterdir():
        if file.suffix != ".safetensors" and file.name != "model.safetensors.index.json":
            shutil.copy(file, out / file.name)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("variant,method,symmetric,group", [("v3", CT, False, 16), ("qwen3", GPTQ, True, 32),
                                                           ("v3", GPTQ, False, 32), ("v3", AWQ, False, 32),
                                                           ("qwen3", AWQ, True, 16)])
def test_a_4bit_checkpoint_loads_with_its_codes_verbatim_and_computes_its_model(checkpoint_factory, tmp_path,
                                                                                 variant, method, symmetric, group):
    """A published-layout 4-bit checkpoint loads as int4 experts by default, with the checkpoint's own codes, scales
    and zero points in the records (no requantisation); attention, shared experts and dense layers dequantised; its
    logits are those of the float checkpoint it stands for; offloading changes no token."""
    from moeprefetch import MoEPrefetchEngine
    from moeprefetch.quant import pack_nibbles

    source = checkpoint_factory(variant)
    path = moeprefetch.int4_checkpoints.write_int4_checkpoint(source, tmp_path / "int4", method, group, symmetric)
    reference = _dequantised_copy(path, tmp_path / "float")
    prompts = [[3, 4, 5, 6], [7, 8]]
    with MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64) as engine:
        fmt = engine.residency.fmt
        assert engine.options.expert_dtype == "int4" and fmt.block == (1, group) and fmt.zero_points != symmetric
        logits = engine.forward([prompts[0]])
        expected = engine.generate(prompts, max_new_tokens=8, stop_at_eos=False).sequences
        layer = engine.args.moe_layers[0]
        record = engine.residency.pool[engine.residency.key(layer, 1)].cpu().view(1, -1)  # all resident: slot = key
        args = engine.args
    stored = _open(path)
    base = f"model.layers.{layer}.mlp.experts.1.gate_proj"
    parts = stored.read_parts(base)
    assert torch.equal(fmt.view(record, "gate")[0], pack_nibbles(parts.q))
    # the records keep the checkpoint's scale dtype (GPTQ, AWQ: fp16), so its scales are stored as they were published
    assert fmt.scale_dtype == stored.scale_dtype() and (method == CT or fmt.scale_dtype == torch.float16)
    assert torch.equal(fmt.view(record, "gate_scale")[0].float(), parts.scale)
    with MoEPrefetchEngine.from_pretrained(reference, progress=False, max_seq_len=64) as float_engine:
        float_logits = float_engine.forward([prompts[0]])
    error = ((logits - float_logits).abs().max() / float_logits.abs().max()).item()
    assert error < 1e-4, error
    with MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64, expert_cache_slots=3) as offloaded:
        assert offloaded.generate(prompts, max_new_tokens=8, stop_at_eos=False).sequences == expected
    assert args.int4 is not None and args.int4.method == method


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant,method,symmetric,group", [("v3", CT, False, 16), ("qwen3", GPTQ, True, 32),
                                                           ("v3", AWQ, False, 32)])
def test_a_4bit_checkpoint_on_cuda_keeps_its_tokens_offloaded_and_computes_its_model(checkpoint_factory, tmp_path,
                                                                                      variant, method, symmetric,
                                                                                      group):
    """On CUDA (bf16, the 4-bit expert kernels): each published layout's tokens are the same every expert resident
    and with 3 slots (slot reads, zero-copy host reads, admissions), and its logits are the dequantised float
    checkpoint's to bf16's precision."""
    from moeprefetch import MoEPrefetchEngine

    path = moeprefetch.int4_checkpoints.write_int4_checkpoint(checkpoint_factory(variant), tmp_path / "int4", method,
                                                              group, symmetric)
    reference = _dequantised_copy(path, tmp_path / "float")
    prompts = [[3, 4, 5, 6], [7, 8]]
    on_gpu = dict(progress=False, max_seq_len=64, device="cuda", dtype=torch.bfloat16)
    with MoEPrefetchEngine.from_pretrained(path, **on_gpu) as engine:
        assert engine.options.expert_dtype == "int4" and engine.residency.experts.use_kernels
        logits = engine.forward([prompts[0]]).float()
        expected = engine.generate(prompts, max_new_tokens=8, stop_at_eos=False).sequences
    with MoEPrefetchEngine.from_pretrained(path, expert_cache_slots=3, **on_gpu) as offloaded:
        assert offloaded.generate(prompts, max_new_tokens=8, stop_at_eos=False).sequences == expected
    with MoEPrefetchEngine.from_pretrained(reference, **on_gpu) as float_engine:
        float_logits = float_engine.forward([prompts[0]]).float()
    error = ((logits - float_logits).abs().max() / float_logits.abs().max()).item()
    assert error < 3e-2, error


def test_a_4bit_checkpoint_in_other_groups_or_dtypes_is_converted(checkpoint_factory, tmp_path, caplog):
    """Groups other than the checkpoint's requantise its experts (said once in the log); expert_dtype='model'
    dequantises them; both still compute nearly the checkpoint's model."""
    from moeprefetch import MoEPrefetchEngine

    path = moeprefetch.int4_checkpoints.write_int4_checkpoint(checkpoint_factory("v3"), tmp_path / "ct", CT, 32, True)
    prompt = [[3, 4, 5, 6]]
    with MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64) as verbatim:
        logits = verbatim.forward(prompt)
    with caplog.at_level("INFO", logger="moeprefetch.expert_records"):
        with MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64, int4_group_size=16,
                                               int4_symmetric=False) as regrouped:
            regrouped_logits = regrouped.forward(prompt)
    assert sum("quantised again" in r.getMessage() for r in caplog.records) == 1
    with MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64, expert_dtype="model") as dense:
        assert dense.residency.fmt.block is None
        dense_logits = dense.forward(prompt)
    assert (dense_logits - logits).abs().max() / logits.abs().max() < 1e-4
    error = ((regrouped_logits - logits).norm() / logits.norm()).item()
    assert 0 < error < 0.1, error


def test_an_unsupported_4bit_checkpoint_is_one_sentence_and_exit_2(checkpoint_factory, tmp_path, capsys):
    from moeprefetch import MoEPrefetchEngine
    from moeprefetch.cli import main

    path = moeprefetch.int4_checkpoints.write_int4_checkpoint(checkpoint_factory("v3"), tmp_path / "ct", CT, 32, True)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["format"] = "marlin-24"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="marlin-24") as err:
        MoEPrefetchEngine.from_pretrained(path, progress=False)
    assert "\n" not in str(err.value)
    assert main(["generate", str(path), "--prompt-ids", "3,4", "--max-new-tokens", "2"]) == 2
    assert "Traceback" not in capsys.readouterr().err
