"""quant.py and the expert record format: FP8 / int8 block formats and 4-bit groups against float64 references,
ragged blocks and groups, the record layout, FP8 checkpoints and int4 experts end to end."""

from __future__ import annotations

import pytest
import torch

from moeprefetch import MoEPrefetchEngine
from moeprefetch.expert_records import INT4_GROUP_SIZE, ExpertFormat, activation
from moeprefetch.errors import RequestError
from moeprefetch.quant import (dequantize_blocks, dequantize_int4_groups, pack_nibbles, quantize_fp8_blocks,
                               quantize_int4_groups, quantize_int8_blocks, scale_grid_shape, unpack_nibbles)

SHAPES = [((576, 7168), (128, 128)), ((40, 24), (16, 16)), ((17, 130), (8, 64)), ((128, 256), (128, 128))]


def _reference_dequant(payload: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """float64, element by element over the blocks (no repeat_interleave)."""
    out = payload.double().clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] *= scale[i, j].double()
    return out


@pytest.mark.parametrize("shape,block", SHAPES)
def test_fp8_dequantisation_matches_float64_reference(shape, block):
    generator = torch.Generator().manual_seed(sum(shape))
    payload = (torch.randn(shape, generator=generator) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(scale_grid_shape(*shape, block), generator=generator) * 1e-2 + 1e-4
    assert scale.shape == ((shape[0] + block[0] - 1) // block[0], (shape[1] + block[1] - 1) // block[1])
    got = dequantize_blocks(payload, scale, block, torch.float64)
    torch.testing.assert_close(got, _reference_dequant(payload, scale, block), rtol=1e-6, atol=0)


@pytest.mark.parametrize("shape,block", SHAPES)
def test_round_trips_stay_within_the_format_error(shape, block):
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(shape, generator=generator) * torch.rand(shape[0], 1, generator=generator)
    payload, scale = quantize_fp8_blocks(weight, block)
    assert payload.dtype == torch.float8_e4m3fn and scale.shape == scale_grid_shape(*shape, block)
    back = dequantize_blocks(payload, scale, block, torch.float64)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each value, plus subnormal rounding near zero
    bound = weight.abs().double() * 2**-4 + _reference_dequant(torch.ones(shape), scale, block) * 2**-9
    assert ((back - weight.double()).abs() <= bound + 1e-12).all()
    payload, scale = quantize_int8_blocks(weight, block)
    back = dequantize_blocks(payload, scale, block, torch.float64)
    half_step = _reference_dequant(torch.ones(shape), scale, block) / 2
    assert ((back - weight.double()).abs() <= half_step * (1 + 1e-4)).all()  # fp32 division rounding


def test_scale_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="block scales have shape"):
        dequantize_blocks(torch.zeros(576, 256), torch.ones(4, 2), (128, 128), torch.float32)


@pytest.mark.parametrize("expert_dtype", ["model", "fp8", "int8"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_expert_record_round_trip_and_layout(expert_dtype, compute):
    hidden, inter = 96, 40
    fmt = ExpertFormat.build(hidden, inter, compute, expert_dtype, block=(16, 32))
    generator = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(s, generator=generator) for s in ((inter, hidden), (inter, hidden), (hidden, inter)))
    records = torch.zeros(3, fmt.record_bytes, dtype=torch.uint8)
    fmt.pack(gate, up, down, records[1])
    gate_up, down_back = fmt.dequantize(records)
    assert gate_up.shape == (3, 2 * inter, hidden) and down_back.shape == (3, hidden, inter)
    assert gate_up.dtype == compute
    tolerance = {"model": 1e-2 if compute == torch.bfloat16 else 0, "fp8": 0.07, "int8": 0.02}[expert_dtype]
    expected = torch.cat((gate, up))
    assert ((gate_up[1].float() - expected).abs() <= tolerance * expected.abs().max() + 1e-6).all()
    assert ((down_back[1].float() - down).abs() <= tolerance * down.abs().max() + 1e-6).all()
    assert not gate_up[0].any() and not gate_up[2].any()  # neighbours untouched
    assert fmt.record_bytes % 64 == 0
    assert all(r.offset % 64 == 0 or name == "up" for name, r in fmt.regions.items())
    if expert_dtype == "model":
        assert fmt.scale_bytes == 0
        assert fmt.payload_bytes == 3 * hidden * inter * torch.tensor([], dtype=compute).element_size()
    else:
        assert fmt.payload_bytes == 3 * hidden * inter  # one byte per weight
        assert fmt.scale_bytes == 2 * 4 * 3 * 3 + 4 * 6 * 2  # gate/up 3x3 blocks each, down 6x2 blocks, fp32


def test_fp8_checkpoint_matches_its_dequantised_weights(checkpoint_factory):
    """A DeepSeek-style FP8 checkpoint (block 16x16, ragged edges) computes what its dequantised weights do."""
    from safetensors.torch import load_file

    fp8 = checkpoint_factory("v3", fp8=True)
    engine = MoEPrefetchEngine.from_pretrained(fp8, progress=False)
    state = {}
    for file in fp8.glob("*.safetensors"):
        state.update(load_file(file))
    scales = [k for k in state if k.endswith("_scale_inv")]
    assert scales and any(state[k.removesuffix("_scale_inv")].shape[0] % 16 for k in scales)  # ragged rows exist
    # reference: a float copy of the checkpoint with every FP8 tensor dequantised in float64
    import tempfile
    from pathlib import Path

    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        dense = {}
        for name, tensor in state.items():
            if name.endswith("_scale_inv"):
                continue
            scale_name = name.removesuffix(".weight") + ".weight_scale_inv"
            if scale_name in state:
                tensor = _reference_dequant(tensor, state[scale_name], (16, 16)).float()
            dense[name] = tensor
        save_file(dense, out / "model.safetensors")
        import json

        config = json.loads((fp8 / "config.json").read_text())
        del config["quantization_config"]
        (out / "config.json").write_text(json.dumps(config))
        reference = MoEPrefetchEngine.from_pretrained(out, progress=False)
        ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(engine.forward(ids), reference.forward(ids), rtol=1e-5, atol=1e-5)
        a, am = engine.forward(ids, return_mtp=True)
        b, bm = reference.forward(ids, return_mtp=True)
        torch.testing.assert_close(am, bm, rtol=1e-5, atol=1e-5)


def test_fp8_checkpoint_keeps_fp8_bytes_on_the_host(checkpoint_factory):
    fp8 = checkpoint_factory("v3", fp8=True)
    dense = MoEPrefetchEngine.from_pretrained(fp8, progress=False, expert_cache_slots=8, dtype=torch.bfloat16)
    compact = MoEPrefetchEngine.from_pretrained(fp8, progress=False, expert_cache_slots=8, dtype=torch.bfloat16,
                                                expert_dtype="fp8")
    ratio = compact.memory_stats()["host_expert_bytes"] / dense.memory_stats()["host_expert_bytes"]
    assert 0.45 < ratio < 0.65  # FP8 payload + fp32 block scales, against bf16 (small experts: scales weigh more)
    # the checkpoint's FP8 bytes are stored verbatim, so the compact engine equals the dequantising one exactly
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    assert torch.equal(dense.forward(ids), compact.forward(ids))
    assert dense.generate([[3, 4, 5]], max_new_tokens=6).sequences == compact.generate([[3, 4, 5]], max_new_tokens=6).sequences


def test_load_time_compression_costs_little_accuracy(checkpoint_factory):
    path = checkpoint_factory("v3")
    exact = MoEPrefetchEngine.from_pretrained(path, progress=False)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(3))
    reference = exact.forward(ids).log_softmax(-1)
    for expert_dtype, max_kl in (("int8", 1e-3), ("fp8", 1e-2)):
        engine = MoEPrefetchEngine.from_pretrained(path, progress=False, expert_dtype=expert_dtype, expert_cache_slots=8)
        out = engine.forward(ids).log_softmax(-1)
        kl = (reference.exp() * (reference - out)).sum(-1).mean().item()
        assert 0 < kl < max_kl
        assert engine.memory_stats()["host_expert_bytes"] < exact.residency.expert_bytes * engine.plan.total_experts


# ---- 4-bit groups -------------------------------------------------------------------------------------------------


def _int4_reference(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int) -> torch.Tensor:
    """float64, byte by byte with explicit bit arithmetic: input 2j is byte j's low nibble, 2j+1 its high one."""
    rows, half = packed.shape
    out = torch.zeros(rows, 2 * half, dtype=torch.float64)
    for r in range(rows):
        for j in range(half):
            byte = int(packed[r, j])
            for n, code in ((2 * j, byte & 0xF), (2 * j + 1, byte >> 4)):
                z = 8.0 if zero is None else float(zero[r, n // group])
                out[r, n] = (code - z) * float(scale[r, n // group])
    return out


def test_nibbles_are_packed_low_first():
    codes = torch.tensor([[1, 2, 15, 0, 7, 8]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F, 0x87]]
    assert torch.equal(unpack_nibbles(packed), codes)
    with pytest.raises(ValueError, match="even number"):
        pack_nibbles(torch.zeros(2, 5, dtype=torch.uint8))


@pytest.mark.parametrize("symmetric,scale_dtype", [(False, torch.float32), (True, torch.float32),
                                                   (False, torch.float16), (True, torch.bfloat16)])
@pytest.mark.parametrize("shape,group", [((6, 40), 16), ((5, 64), 64), ((3, 18), 128), ((4, 34), 8)])
def test_int4_groups_match_float64_and_stay_within_half_a_step(shape, group, symmetric, scale_dtype):
    """Ragged last groups (40 = 2 x 16 + 8, 34 = 4 x 8 + 2) and groups wider than the row; the dequantised weight is
    within half a quantisation step of the original everywhere (RTN), and the kernel formula's float64 value. Scales
    rounded to a 16-bit dtype are coded with the rounded scale, so the half-step bound still holds."""
    generator = torch.Generator().manual_seed(sum(shape) + group + symmetric)
    weight = torch.randn(shape, generator=generator) * torch.rand(shape[0], 1, generator=generator) * 3
    weight[0, :3] = 0.0  # exact zeros stay exact
    weight[-1] *= 1e-4  # a row of small weights: the scales near fp16's smallest normal numbers
    packed, scale, zero = quantize_int4_groups(weight, group, symmetric, scale_dtype=scale_dtype)
    assert torch.equal(scale.to(scale_dtype).float(), scale)
    groups = -(-shape[1] // group)
    assert packed.shape == (shape[0], shape[1] // 2) and packed.dtype == torch.uint8
    assert scale.shape == (shape[0], groups) and (zero is None) == symmetric
    expected = _int4_reference(packed, scale, zero, group)
    got = dequantize_int4_groups(packed, scale, zero, group, torch.float32)
    assert torch.allclose(got.double(), expected, rtol=1e-6, atol=1e-7)
    step = scale.repeat_interleave(group, dim=1)[:, : shape[1]].double()
    assert ((expected - weight.double()).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all()
    assert (got[0, :3] == 0).all()
    if not symmetric:
        assert zero is not None and torch.equal(zero, zero.round()) and zero.min() >= 0 and zero.max() <= 15


@pytest.mark.parametrize("symmetric,scale_dtype", [(False, None), (True, None), (False, torch.float32),
                                                   (True, torch.bfloat16)])
def test_int4_expert_record_layout_and_round_trip(symmetric, scale_dtype):
    hidden, inter, group = 96, 40, 32
    extra = {} if scale_dtype is None else dict(scale_dtype=scale_dtype)
    fmt = ExpertFormat.build(hidden, inter, torch.bfloat16, "int4", group_size=group, symmetric=symmetric, **extra)
    assert fmt.int4 and fmt.quantized and fmt.block == (1, group) and fmt.zero_points != symmetric
    assert fmt.scale_dtype == (scale_dtype or torch.float16)  # fp16 metadata unless asked otherwise
    assert fmt.payload_bytes == 3 * hidden * inter // 2  # half a byte per weight
    # gate/up: 3 groups of 32 per row; down: 2 (40 = 32 + 8) per row
    per_kind = fmt.scale_dtype.itemsize * (2 * inter * 3 + hidden * 2)
    assert fmt.scale_bytes == per_kind * (1 if symmetric else 2)
    assert fmt.record_bytes % 64 == 0 and all(r.offset % 64 == 0 for r in fmt.regions.values())
    generator = torch.Generator().manual_seed(1)
    gate, up, down = (torch.randn(s, generator=generator) for s in ((inter, hidden), (inter, hidden), (hidden, inter)))
    records = torch.zeros(3, fmt.record_bytes, dtype=torch.uint8)
    fmt.pack(gate, up, down, records[1])
    gate_up, down_back = fmt.dequantize(records)
    assert gate_up.dtype == torch.bfloat16 and gate_up.shape == (3, 2 * inter, hidden)
    for name, original, back in (("gate", gate, gate_up[1, :inter]), ("up", up, gate_up[1, inter:]),
                                 ("down", down, down_back[1])):
        packed, scale, zero = quantize_int4_groups(original, group, symmetric, scale_dtype=fmt.scale_dtype)
        assert fmt.stores_exactly(scale)
        assert torch.equal(fmt.view(records[1:2], name)[0], packed)
        assert torch.equal(fmt.view(records[1:2], f"{name}_scale")[0].float(), scale)
        assert torch.equal(back, _int4_reference(packed, scale, zero, group).to(torch.bfloat16))
    assert not records[0].any() and not records[2].any()


def test_int4_options_are_checked_before_loading(checkpoint_factory):
    path = checkpoint_factory("v3")
    for options, message in ((dict(int4_group_size=7), "int4_group_size must be an even number"),
                             (dict(int4_group_size=True), "int4_group_size"),
                             (dict(int4_symmetric="yes"), "int4_symmetric must be True or False"),
                             (dict(expert_dtype="int3"), "expert_dtype must be one of"),
                             (dict(expert_dtype="int4", int4_group_size=65536), "wider than the experts' rows"),
                             (dict(expert_dtype="fp8", int4_group_size=64), "int4_group_size shapes int4 experts, but this engine.s experts are fp8: add expert_dtype='int4'"),
                             (dict(int4_symmetric=True), "int4_symmetric shapes int4 experts")):
        with pytest.raises(RequestError, match=message):
            MoEPrefetchEngine.from_pretrained(path, progress=False, **options)


def test_the_default_int4_group_narrows_to_experts_narrower_than_it(checkpoint_factory):
    """The default group (128) on a model whose expert rows are narrower (64 and 32 inputs here) takes one group a
    row as wide as the widest; a group the user gives is never changed, and too wide is refused."""
    path = checkpoint_factory("v3")
    with MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=32, expert_dtype="int4") as engine:
        widest = max(engine.args.hidden_size, engine.args.moe_intermediate_size)
        assert widest < INT4_GROUP_SIZE and engine.residency.fmt.block[1] == widest
        assert len(engine.generate([[3, 4, 5]], max_new_tokens=3, stop_at_eos=False).sequences[0]) == 3
    with MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=32, expert_dtype="int4",
                                           int4_group_size=16) as engine:
        assert engine.residency.fmt.block[1] == 16


def test_int4_experts_need_even_sizes():
    with pytest.raises(ValueError, match="must be even"):
        ExpertFormat.build(96, 41, torch.float32, "int4")


@pytest.mark.slow
@pytest.mark.parametrize("variant,symmetric", [("v3", False), ("qwen3", True), ("mixtral", False)])
def test_int4_experts_give_the_same_tokens_at_every_cache_size(checkpoint_factory, variant, symmetric):
    """Within the int4 format, a cache of any size (and a predictor) changes speed, never tokens; the records are
    about a quarter of the fp32 ones, and the engine's logits stay close to the float experts'."""
    path = checkpoint_factory(variant)
    options = dict(progress=False, max_seq_len=64, expert_dtype="int4", int4_group_size=16,
                   int4_symmetric=symmetric)
    prompts = [[3, 4, 5, 6], [7, 8]]
    with MoEPrefetchEngine.from_pretrained(path, **options) as resident:
        expected = resident.generate(prompts, max_new_tokens=8, stop_at_eos=False).sequences
        int4_logits = resident.forward([prompts[0]])
        record = resident.residency.expert_bytes
        memory = resident.memory_stats()
        assert memory["expert_record_bytes"] == record
        fmt = resident.residency.fmt
        groups = -(-fmt.hidden // 16) * 2 * fmt.intermediate + -(-fmt.intermediate // 16) * fmt.hidden
        # one fp16 scale a group, and a zero point when asymmetric
        assert memory["expert_record_scale_bytes"] == groups * 2 * (1 if symmetric else 2)
    for slots in (2, 5):
        with MoEPrefetchEngine.from_pretrained(path, expert_cache_slots=slots, **options) as offloaded:
            for predictor in ("none", "next_layer_gate"):
                got = offloaded.generate(prompts, max_new_tokens=8, stop_at_eos=False, predictor=predictor)
                assert got.sequences == expected, (slots, predictor)
    with MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64) as full:
        float_logits = full.forward([prompts[0]])
        float_record = full.residency.expert_bytes
        assert full.memory_stats()["expert_record_scale_bytes"] == 0
    assert record < 0.3 * float_record
    error = ((int4_logits - float_logits).norm() / float_logits.norm()).item()
    assert 0 < error < 0.15, error


@pytest.mark.parametrize("name", ["silu", "gelu", "gelu_pytorch_tanh", "relu"])
def test_an_activations_row_has_the_same_bits_wherever_it_sits(name):
    """`expert_records.activation` on the CPU: a row's result does not depend on the rows beside it or on where it
    sits in the batch (torch's scalar tail rounds transcendental functions otherwise than its vector loop: the
    thirty-first session's CI host gave F.silu's last 16 elements of a [9, 48] batch other bits), and it is the
    function, to fp32's rounding against float64."""
    import torch.nn.functional as F

    act = activation(name)
    exact = {"silu": lambda v: v * torch.sigmoid(v), "gelu": F.gelu,
             "gelu_pytorch_tanh": lambda v: F.gelu(v, approximate="tanh"), "relu": F.relu}[name]
    g = torch.Generator().manual_seed(5)
    for width in (48, 64, 72, 1408):
        x = torch.randn(9, width, generator=g) * 4
        together = act(x)
        assert all(torch.equal(together[r], act(x[r : r + 1])[0]) for r in range(9)), width
        moved = act(torch.roll(x, 1, 0))  # every row one place down, the last one first
        assert all(torch.equal(moved[(r + 1) % 9], together[r]) for r in range(9)), width
        assert torch.allclose(together.double(), exact(x.double()), rtol=1e-5, atol=1e-6), width

