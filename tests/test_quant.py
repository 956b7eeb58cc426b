"""quant.py and the expert record format: FP8 / int8 block formats against float64 references, ragged blocks,
the record layout, and FP8 checkpoints end to end."""

from __future__ import annotations

import pytest
import torch

from moeprefetch import MoEPrefetchEngine
from moeprefetch.experts import ExpertFormat
from moeprefetch.quant import dequantize_blocks, quantize_fp8_blocks, quantize_int8_blocks, scale_grid_shape

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
