"""Families beyond DeepSeek (families.py): Qwen3-MoE, Mixtral and GLM-4.5 (grouped-query attention) and GLM-4.7-Flash
(MLA), on tiny random checkpoints written by transformers' own classes. Logits against transformers are in
test_parity.py (MTP logits for GLM-4.5 too); here: cached decode against the uncached forward, and the offload runtime,
predictors (MTP ones where the checkpoint has an MTP layer), speculation, layer streaming and quantised experts."""

from __future__ import annotations

import pytest
import torch

from moeprefetch import MoEPrefetchEngine
from moeprefetch.errors import RequestError

GQA_VARIANTS = ["qwen3", "qwen3_sparse_step", "mixtral", "mixtral_window", "glm4", "glm4_plain"]
MTP_VARIANTS = ["glm4", "glm4_lite"]
PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [11, 12]]


def _greedy_by_forward(engine: MoEPrefetchEngine, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens from the uncached forward over the whole sequence at every step."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(engine.forward([ids])[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("variant", GQA_VARIANTS)
def test_cached_decode_equals_the_uncached_forward(checkpoint_factory, variant):
    path = checkpoint_factory(variant)
    engine = MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64)
    assert engine.args.attention == "gqa" and engine.has_mtp == variant.startswith("glm4")
    result = engine.generate(PROMPTS, max_new_tokens=9, stop_at_eos=False, predictor="none")
    for prompt, got in zip(PROMPTS, result.sequences):
        assert got == _greedy_by_forward(engine, prompt, 9)


@pytest.mark.parametrize("variant", ["qwen3", "mixtral_window", "glm4"])
def test_offloaded_generation_gives_the_resident_tokens_for_every_predictor(checkpoint_factory, variant):
    path = checkpoint_factory(variant)
    resident = MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64)
    expected = resident.generate(PROMPTS, max_new_tokens=10, stop_at_eos=False).sequences
    top_k = resident.args.num_experts_per_tok
    for slots in (top_k, top_k + 3, resident.plan.total_experts // 2):
        engine = MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64, expert_cache_slots=slots)
        for predictor in ("none", "previous", "next_layer_gate", "oracle"):
            result = engine.generate(PROMPTS, max_new_tokens=10, stop_at_eos=False, predictor=predictor)
            assert result.sequences == expected, (slots, predictor)
            stats = result.stats.to_dict()
            assert stats["hits"] + stats["misses"] == stats["expert_uses"] > 0
        assert not engine.residency.problems()
        engine.close()


@pytest.mark.parametrize("variant", MTP_VARIANTS)
def test_glm_mtp_predictors_and_speculation_keep_the_tokens(checkpoint_factory, variant):
    """GLM-4.5 and GLM-4.7-Flash ship an MTP layer: every MTP predictor and MTP speculation, at small caches, give
    the all-resident tokens; the first drafts agree with the MTP head over the uncached forward."""
    path = checkpoint_factory(variant)
    resident = MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64)
    assert resident.has_mtp and resident.options.predictor == "none"  # reactive by default
    expected = resident.generate(PROMPTS, max_new_tokens=10, stop_at_eos=False, predictor="none").sequences
    assert resident.generate(PROMPTS, max_new_tokens=10, stop_at_eos=False, speculative="mtp").sequences == expected
    _, mtp_logits = resident.forward([PROMPTS[0]], return_mtp=True)
    assert mtp_logits.shape == (1, len(PROMPTS[0]) - 1, resident.args.vocab_size)
    for slots in (resident.args.num_experts_per_tok, 7):
        engine = MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64, expert_cache_slots=slots)
        for predictor in ("mtp", "mtp_router", "mtp+next_layer_gate"):
            result = engine.generate(PROMPTS, max_new_tokens=10, stop_at_eos=False, predictor=predictor)
            assert result.sequences == expected, (slots, predictor)
            assert result.stats.mtp_drafts_checked > 0
        assert engine.generate(PROMPTS, max_new_tokens=10, stop_at_eos=False, speculative="mtp").sequences == expected
        assert not engine.residency.problems()


def test_mtp_predictors_and_speculation_need_an_mtp_layer(checkpoint_factory):
    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory("qwen3"), progress=False, max_seq_len=64)
    assert engine.options.predictor == "none"  # the default, with an MTP layer or without
    with pytest.raises(RequestError, match="needs an MTP layer"):
        engine.generate(PROMPTS, max_new_tokens=2, predictor="mtp")
    assert engine.generate(PROMPTS, max_new_tokens=2).sequences  # still usable


@pytest.mark.parametrize("variant", ["qwen3_sparse_step", "mixtral", "glm4", "glm4_lite"])
def test_streamed_layers_and_quantised_experts_on_gqa_families(checkpoint_factory, variant):
    path = checkpoint_factory(variant)
    resident = MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64)
    expected = resident.generate(PROMPTS, max_new_tokens=8, stop_at_eos=False).sequences
    streamed = MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64, stream_layers=2,
                                                 stream_ahead=1, expert_cache_slots=6)
    assert streamed.generate(PROMPTS, max_new_tokens=8, stop_at_eos=False).sequences == expected
    quantised = MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64, expert_dtype="int8")
    offloaded = MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64, expert_dtype="int8",
                                                  expert_cache_slots=5)
    assert quantised.generate(PROMPTS, max_new_tokens=8, stop_at_eos=False).sequences == \
        offloaded.generate(PROMPTS, max_new_tokens=8, stop_at_eos=False).sequences


def test_memory_plan_counts_the_gqa_kv_cache(checkpoint_factory):
    from moeprefetch.runner import KVCaches

    engine = MoEPrefetchEngine.from_pretrained(checkpoint_factory("qwen3"), progress=False, max_seq_len=64,
                                               max_batch_size=2, vram_budget="1GiB")
    args = engine.args
    per_token = 2 * args.num_key_value_heads * args.qk_head_dim * 4 * args.num_hidden_layers  # fp32 K and V
    assert KVCaches.bytes_per_token(args, torch.float32, False) == per_token
    assert engine.plan.kv_bytes == per_token * 64 * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", ["qwen3", "mixtral_window", "glm4", "glm4_lite"])
def test_gqa_families_on_gpu_keep_the_tokens_across_cache_sizes_and_predictors(checkpoint_factory, variant):
    """bf16 on CUDA, decode steps captured as graphs: every cache size and predictor gives the all-resident tokens,
    with one synchronisation per step; layer streaming too."""
    path = checkpoint_factory(variant)
    kwargs = dict(device="cuda", dtype=torch.bfloat16, progress=False, max_seq_len=128)
    resident = MoEPrefetchEngine.from_pretrained(path, **kwargs)
    expected = resident.generate(PROMPTS, max_new_tokens=12, stop_at_eos=False).sequences
    total = resident.plan.total_experts
    resident.close()
    for extra in (dict(expert_cache_slots=3), dict(expert_cache_slots=total // 2),
                  dict(expert_cache_slots=4, stream_layers=2, stream_ahead=1)):
        engine = MoEPrefetchEngine.from_pretrained(path, **kwargs, **extra)
        for predictor in ("none", "next_layer_gate", "oracle") + (("mtp+next_layer_gate",) if engine.has_mtp else ()):
            for _ in range(2):  # the second call replays the captured graphs
                result = engine.generate(PROMPTS, max_new_tokens=12, stop_at_eos=False, predictor=predictor)
                assert result.sequences == expected, (extra, predictor)
                assert result.stats.decode_syncs == result.stats.decode_steps
        assert any(step.captured for step in engine._steps.values())
        assert not engine.residency.problems()
        engine.close()


@pytest.mark.parametrize("variant,field", [("qwen3", "num_experts"), ("qwen3", "moe_intermediate_size"),
                                           ("mixtral", "num_local_experts"), ("mixtral", "intermediate_size")])
def test_a_missing_shape_field_is_one_clear_error(checkpoint_factory, tmp_path, variant, field):
    import json
    import shutil

    from moeprefetch.errors import CheckpointError

    path = tmp_path / variant
    shutil.copytree(checkpoint_factory(variant), path)
    config = json.loads((path / "config.json").read_text())
    # the expert count is read from either name (published Qwen3 configs say num_experts; transformers may write
    # num_local_experts): without both it is missing
    for name in ((field, "num_experts", "num_local_experts") if "experts" in field else (field,)):
        config.pop(name, None)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"missing required field.*{field}"):
        MoEPrefetchEngine.from_pretrained(path, progress=False)


@pytest.mark.parametrize("variant,overrides", [
    ("qwen3", dict(decoder_sparse_step=5, intermediate_size=64)),  # 3 layers, none on the stride
    ("v2_greedy", dict(first_k_dense_replace=3, intermediate_size=64)),
    ("glm4_lite", dict(mlp_layer_types=["dense"] * 3, with_mtp=False))])
def test_a_checkpoint_without_an_moe_layer_is_one_sentence(checkpoint_factory, variant, overrides):
    """transformers runs a config whose every layer is dense; it has no experts to offload, which loading says."""
    from moeprefetch.errors import CheckpointError

    path = checkpoint_factory(variant, num_hidden_layers=3, **overrides)
    with pytest.raises(CheckpointError, match="has no MoE layer .*a dense model has no experts to offload"):
        MoEPrefetchEngine.from_pretrained(path, progress=False)


def test_cli_info_and_generate_on_a_gqa_checkpoint(checkpoint_factory, capsys):
    from moeprefetch.cli import main

    path = str(checkpoint_factory("mixtral_window"))
    assert main(["info", path]) == 0
    out = capsys.readouterr().out
    assert "mixtral" in out and "GQA attention, 4 query / 1 key-value heads of 8" in out
    assert main(["generate", path, "--prompt-ids", "3,4,5", "--max-new-tokens", "4", "--cache-slots", "4"]) == 0


def test_an_fp8_block_quantised_qwen3_checkpoint_loads_and_offloads(checkpoint_factory):
    """Qwen3-30B-A3B-FP8 ships block-quantised weights with `weight_scale_inv` as DeepSeek-V3 does: the same loader
    dequantises them (experts kept in FP8 with expert_dtype='fp8'), and offload gives the resident tokens."""
    path = checkpoint_factory("qwen3", fp8=True, with_mtp=False)
    assert "quantization_config" in (path / "config.json").read_text()
    resident = MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64, expert_dtype="fp8")
    expected = resident.generate(PROMPTS, max_new_tokens=8, stop_at_eos=False).sequences
    offloaded = MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64, expert_dtype="fp8",
                                                  expert_cache_slots=4)
    assert offloaded.generate(PROMPTS, max_new_tokens=8, stop_at_eos=False).sequences == expected
    bf16_like = MoEPrefetchEngine.from_pretrained(path, progress=False, max_seq_len=64)  # dequantised experts
    logits = bf16_like.forward([PROMPTS[0]])
    assert torch.isfinite(logits).all() and logits.abs().max() > 0.1
