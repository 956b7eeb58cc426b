"""Tests for reference/train_reference.py and reference/evaluate_reference.py (CPU, tiny shapes, a few seconds).

The key guarantees: the saved checkpoint is a real DeepSeek-V3 HF checkpoint (transformers reproduces our main
and MTP logits), the sharding/index is consistent, the training-time dense-masked MoE equals a sparse per-expert
MoE, and the auxiliary-loss-free bias update moves routing toward balance.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "reference"

TINY_SHAPE = [
    "--hidden-size", "32", "--num-layers", "3", "--num-heads", "2", "--qk-nope-dim", "8", "--qk-rope-dim", "4",
    "--v-head-dim", "8", "--kv-lora-rank", "16", "--intermediate-size", "64", "--moe-intermediate-size", "16",
    "--n-routed-experts", "8", "--experts-per-tok", "2", "--n-group", "2", "--topk-group", "1",
    "--max-position-embeddings", "128",
]
TINY_TRAIN = ["--seq-len", "32", "--batch-size", "4", "--warmup-steps", "2", "--log-every", "4", "--eval-every", "4",
              "--device", "cpu", "--no-progress", "--shard-size-mb", "0.1"]


def _load_script(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tr() -> ModuleType:
    return _load_script("train_reference")


@pytest.fixture(scope="module")
def ev() -> ModuleType:
    return _load_script("evaluate_reference")


def make_fake_corpus(out: Path, vocab: int = 300, n_docs: int = 300, seed: int = 0) -> Path:
    """Synthetic text -> byte-level BPE tokenizer (bos <s>=0, eos </s>=1) -> uint16 train/held-out ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "kernel", "expert", "router", "token", "cache", "memory",
             "prefetch", "layer", "the", "a", "of", "and", "to", "in"]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) + "." for _ in range(n_docs)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    ids: list[int] = []
    for doc in docs:
        ids += tok.encode(doc).ids + [1]
    arr = np.asarray(ids, dtype=np.uint16)
    cut = int(len(arr) * 0.9)
    np.save(out / "train_ids.npy", arr[:cut])
    np.save(out / "heldout_ids.npy", arr[cut:])
    (out / "manifest.json").write_text(json.dumps({"sources": [{"name": "synthetic", "license": "CC0"}]}))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_fake_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def checkpoint(tr: ModuleType, corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    # lr 1e-2 so a few steps move weights well away from init (a stronger parity check than a random model).
    tr.main(["--corpus", str(corpus), "--out", str(out), "--max-steps", "8", "--lr", "1e-2",
             "--bias-update-gamma", "0.05", *TINY_SHAPE, *TINY_TRAIN])
    return out


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path):
    from transformers import DeepseekV3ForCausalLM

    model, info = DeepseekV3ForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, experts_implementation="eager", attn_implementation="eager",
        output_loading_info=True,
    )
    return model.eval(), info


def tiny_config(tr: ModuleType, **overrides) -> object:
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=8, kv_lora_rank=16, intermediate_size=64, moe_intermediate_size=16,
                n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, max_position_embeddings=128)
    base.update(overrides)
    return tr.ModelConfig(**base)


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint format
# ----------------------------------------------------------------------------------------------------------------


def test_checkpoint_files_and_index(checkpoint: Path, tr: ModuleType) -> None:
    from safetensors import safe_open

    cfg = json.loads((checkpoint / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["scoring_func"] == "sigmoid"
    assert cfg["topk_method"] == "noaux_tc" and cfg["rope_interleave"] is True
    assert cfg["bos_token_id"] == 0 and cfg["eos_token_id"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16" and cfg["q_lora_rank"] is None

    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    shards = sorted(checkpoint.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1, "tiny shard limit should force several shards"
    assert sorted(set(index["weight_map"].values())) == [p.name for p in shards]
    total, seen, dtypes = 0, {}, {}
    for shard in shards:
        assert shard.stat().st_size <= 0.1e6
        assert shard.name.endswith(f"-of-{len(shards):05d}.safetensors")
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                seen[key] = shard.name
                dtypes[key] = tensor.dtype
                total += tensor.numel() * tensor.element_size()
    assert seen == index["weight_map"]
    assert index["metadata"]["total_size"] == total

    n = cfg["num_hidden_layers"]
    for e in range(cfg["n_routed_experts"]):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.1.mlp.experts.{e}.{proj}.weight" in seen
            assert f"model.layers.{n}.mlp.experts.{e}.{proj}.weight" in seen
    for key in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.kv_b_proj.weight",
                "mlp.gate.weight", "mlp.gate.e_score_correction_bias", "mlp.shared_experts.down_proj.weight"):
        assert f"model.layers.{n}.{key}" in seen
    assert f"model.layers.{n}.embed_tokens.weight" not in seen
    assert f"model.layers.{n}.shared_head.head.weight" not in seen
    assert "model.layers.0.mlp.gate_proj.weight" in seen and "lm_head.weight" in seen
    for key, dtype in dtypes.items():
        expected = torch.float32 if key.endswith(tr.FP32_SUFFIXES) else torch.bfloat16
        assert dtype == expected, key

    assert (checkpoint / "tokenizer.json").exists() and (checkpoint / "tokenizer_config.json").exists()
    log = json.loads((checkpoint / "training_log.json").read_text())
    for key in ("tokens_seen", "train_wall_time_s", "tokens_per_s", "loss_curve", "final_train_loss",
                "routing", "environment", "parameters", "command"):
        assert key in log
    assert log["tokens_seen"] == 8 * 4 * 32 and log["loss_curve"][-1]["step"] == 8
    assert "heldout_loss" in log["loss_curve"][-1]
    # The bias moved (gamma 0.05 for 8 steps) and was saved.
    assert any(abs(r["bias_max"]) > 0 for r in log["routing"])


def test_loader_round_trip(checkpoint: Path, tr: ModuleType) -> None:
    model = tr.load_checkpoint(checkpoint)
    again = tr.to_hf_state_dict(model)
    saved = tr.read_checkpoint_tensors(checkpoint)
    assert again.keys() == saved.keys()
    for key, tensor in saved.items():
        assert torch.equal(again[key], tensor), key


# ----------------------------------------------------------------------------------------------------------------
# Parity with transformers
# ----------------------------------------------------------------------------------------------------------------


def test_hf_main_logits_match(checkpoint: Path, tr: ModuleType, hf_model) -> None:
    hf, info = hf_model
    n = hf.config.num_hidden_layers
    assert not info["missing_keys"]
    assert all(k.startswith(f"model.layers.{n}.") for k in info["unexpected_keys"])  # only the MTP layer
    ours = tr.load_checkpoint(checkpoint)
    ids = torch.randint(0, hf.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden, _, _ = ours.main_hidden(ids)
        diff = (ours.logits(hidden) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4


def test_hf_mtp_logits_match(checkpoint: Path, tr: ModuleType, hf_model) -> None:
    from transformers.modeling_layers import MtpModel

    hf, _ = hf_model
    n = hf.config.num_hidden_layers
    # MtpModel finds MTP keys through this regex, hard-coded to layer 61 for DeepSeek-V3.
    hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}\..*"]
    mtp = MtpModel.from_pretrained(hf).eval()
    ours = tr.load_checkpoint(checkpoint)
    window = torch.randint(0, hf.config.vocab_size, (2, 34), generator=torch.Generator().manual_seed(2))
    seq = window.shape[1] - 2
    with torch.no_grad():
        hf_hidden = hf.model(window[:, :seq]).last_hidden_state  # after model.norm
        # MtpModel convention: tokens shifted by one, at their own positions (1..seq), main hidden unshifted.
        positions = torch.arange(1, seq + 1)[None].expand(2, -1)
        hf_mtp = mtp._project_to_logits(
            mtp.forward_layer(0, hf_hidden, positions, None, input_ids=window[:, 1 : seq + 1]))
        hidden, _, _ = ours.main_hidden(window[:, :seq])
        mtp_hidden, _, _ = ours.mtp_hidden(hidden, window[:, 1 : seq + 1])
        assert (ours.logits(mtp_hidden) - hf_mtp).abs().max().item() <= 1e-4
        # The training objective uses the same alignment: MTP logits at i are scored against token i+2.
        _, main_loss, mtp_loss, _, _ = ours(window)
        ce = torch.nn.functional.cross_entropy
        hf_main = hf(window[:, :seq]).logits
        assert torch.allclose(main_loss, ce(hf_main.flatten(0, 1), window[:, 1:-1].flatten()), atol=1e-5)
        assert torch.allclose(mtp_loss, ce(hf_mtp.flatten(0, 1), window[:, 2:].flatten()), atol=1e-5)


def test_router_matches_hf_with_bias(tr: ModuleType) -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = tiny_config(tr, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
    ours = tr.Router(cfg)
    hf = DeepseekV3TopkRouter(DeepseekV3Config(**{k: v for k, v in cfg.to_hf_config().items() if k != "architectures"}))
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(16, cfg.hidden_size, generator=gen)
    bias = torch.randn(16, generator=gen) * 0.5  # includes negative biases: group masking must use -inf
    with torch.no_grad():
        for module in (ours, hf):
            module.weight.copy_(weight)
            module.e_score_correction_bias.copy_(bias)
        x = torch.randn(64, cfg.hidden_size, generator=gen)
        _, idx, w = ours(x)
        _, hf_w, hf_idx = hf(x)
    ours_sorted, order = idx.sort(dim=-1)
    hf_sorted, hf_order = hf_idx.sort(dim=-1)
    assert torch.equal(ours_sorted, hf_sorted)
    assert torch.allclose(w.gather(1, order), hf_w.gather(1, hf_order), atol=1e-6)


def test_rope_matches_hf_interleave(tr: ModuleType) -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        apply_rotary_pos_emb_interleave,
    )

    cfg = tiny_config(tr, qk_rope_head_dim=8)
    hf_cfg = DeepseekV3Config(**{k: v for k, v in cfg.to_hf_config().items() if k != "architectures"})
    q = torch.randn(2, 3, 10, 8)
    k = torch.randn(2, 1, 10, 8)
    positions = torch.arange(5, 15)[None]
    cos, sin = DeepseekV3RotaryEmbedding(hf_cfg)(q, positions)
    hf_q, hf_k = apply_rotary_pos_emb_interleave(q, k, cos, sin)
    our_cos, our_sin = tr.rope_tables(cfg, 20)
    assert torch.allclose(tr.apply_rope_interleave(q, our_cos[5:15], our_sin[5:15]), hf_q, atol=1e-6)
    assert torch.allclose(tr.apply_rope_interleave(k, our_cos[5:15], our_sin[5:15]), hf_k, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# MoE mechanics
# ----------------------------------------------------------------------------------------------------------------


def test_dense_masked_moe_equals_sparse_reference(tr: ModuleType) -> None:
    torch.manual_seed(4)
    cfg = tiny_config(tr, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
    moe = tr.MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe.gate.e_score_correction_bias.normal_(std=0.1)
    x = torch.randn(3, 10, cfg.hidden_size)
    outputs, grads = {}, {}
    for impl in ("dense", "sparse"):
        moe.impl = impl
        moe.zero_grad()
        xi = x.clone().requires_grad_(True)
        out, load, _ = moe(xi)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outputs[impl] = out.detach()
        grads[impl] = [xi.grad] + [p.grad.clone() for p in moe.parameters()]
        assert load.sum().item() == 30 * cfg.num_experts_per_tok
    assert torch.allclose(outputs["dense"], outputs["sparse"], atol=1e-5)
    for dense_g, sparse_g in zip(grads["dense"], grads["sparse"]):
        assert torch.allclose(dense_g, sparse_g, atol=1e-5)


def test_bias_update_moves_load_toward_balance(tr: ModuleType) -> None:
    torch.manual_seed(5)
    cfg = tiny_config(tr, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, num_hidden_layers=2)
    model = tr.ReferenceModel(cfg)
    router = model.routers()[0]
    with torch.no_grad():
        router.weight.normal_(std=1.0)
        router.weight[:2] += 1.0  # experts 0 and 1 are strongly preferred
    x = torch.randn(512, cfg.hidden_size).abs()

    def loads() -> torch.Tensor:
        _, idx, _ = router(x)
        return torch.zeros(cfg.n_routed_experts).index_add_(0, idx.flatten(), torch.ones(idx.numel()))

    def cv(load: torch.Tensor) -> float:
        return float(load.std(unbiased=False) / load.mean())

    before = loads()
    for _ in range(300):
        all_loads = torch.stack([loads()] + [torch.zeros(cfg.n_routed_experts)] * (len(model.routers()) - 1))
        model.update_routing_bias(all_loads, gamma=0.01)
    after = loads()
    assert cv(after) < 0.5 * cv(before)
    assert after.max() < before.max()
    # Only selection changed: the bias is a buffer, not a parameter the optimizer would touch.
    assert "e_score_correction_bias" not in dict(model.named_parameters())


# ----------------------------------------------------------------------------------------------------------------
# CLI behaviour
# ----------------------------------------------------------------------------------------------------------------


def test_time_budget_stops_and_saves(tr: ModuleType, corpus: Path, tmp_path: Path) -> None:
    log = tr.main(["--corpus", str(corpus), "--out", str(tmp_path), "--max-steps", "1000",
                   "--time-budget-s", "1e-6", *TINY_SHAPE, *TINY_TRAIN])
    assert log["stopped_by"] == "time_budget" and log["steps"] == 1
    assert (tmp_path / "model.safetensors.index.json").exists()


def test_size_limit_is_enforced(tr: ModuleType, corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max-size-mb"):
        tr.main(["--corpus", str(corpus), "--out", str(tmp_path), "--max-steps", "1", "--max-size-mb", "0.01",
                 *TINY_SHAPE, *TINY_TRAIN])


def test_default_shape_fits_25mb_and_15mb_shards(tr: ModuleType) -> None:
    model = tr.ReferenceModel(tr.ModelConfig())
    tensors = tr.to_hf_state_dict(model)
    assert tr.tensor_nbytes(tensors) <= 25 * tr.MB
    for shard in tr.plan_shards(tensors, 15 * tr.MB - tr.SHARD_HEADER_RESERVE):
        header = sum(len(k) + 128 for k in shard)  # generous per-tensor JSON header estimate
        assert sum(tr.tensor_nbytes({k: tensors[k]}) for k in shard) + header <= 15 * tr.MB


def test_evaluate_reference_writes_eval_and_card(checkpoint: Path, corpus: Path, ev: ModuleType) -> None:
    result = ev.main(["--checkpoint", str(checkpoint), "--corpus", str(corpus), "--device", "cpu",
                      "--max-tokens", "1000", "--num-prompts", "4", "--prompt-len", "8", "--new-tokens", "6"])
    saved = json.loads((checkpoint / "eval.json").read_text())
    assert saved["heldout"] == pytest.approx(result["heldout"])
    for key in ("main_loss", "main_ppl", "mtp_loss", "mtp_ppl", "mtp_top1_teacher_forced", "main_top1"):
        assert np.isfinite(saved["heldout"][key])
    assert saved["greedy_mtp"]["drafts_compared"] == 4 * 5
    assert 0.0 <= saved["greedy_mtp"]["acceptance"] <= 1.0
    assert [r["layer"] for r in saved["load_balance"]] == ["layer 1", "layer 2", "mtp (layer 3)"]
    for row in saved["load_balance"]:
        assert row["max_over_mean"] >= 1.0 >= row["min_over_mean"] and 0 < row["entropy_normalised"] <= 1.0
    card = (checkpoint / "README.md").read_text()
    for heading in ("## Data", "## Tokenizer", "## Architecture", "## Training", "## Held-out evaluation",
                    "## Expert load balance", "## Reproduce", "Greedy MTP draft acceptance", "synthetic",
                    "python reference/train_reference.py", "python reference/evaluate_reference.py"):
        assert heading in card


def test_evaluate_dense_and_sparse_agree(checkpoint: Path, corpus: Path, ev: ModuleType, tr: ModuleType) -> None:
    model = tr.load_checkpoint(checkpoint)
    windows = ev.heldout_windows(np.load(corpus / "heldout_ids.npy"), 32, 256)
    results = {}
    for impl in ("dense", "sparse"):
        model.set_moe_impl(impl)
        results[impl] = ev.evaluate_heads(model, windows, 4, torch.device("cpu"), None)
    assert results["dense"][0]["main_loss"] == pytest.approx(results["sparse"][0]["main_loss"], abs=1e-5)
    assert torch.equal(results["dense"][1], results["sparse"][1])


def test_the_deep_preset_builds_the_benchmark_shape_and_keeps_tokens_offloaded(tr: ModuleType, corpus: Path,
                                                                                tmp_path: Path) -> None:
    """--preset deep (issue 36's benchmark model, trained on the H200): 26 MoE layers of 64 experts top-6, 2 shared,
    an MTP layer; explicit options still override the preset; the checkpoint loads in the engine, whose greedy
    tokens at 30 % cached with the MTP predictor are the all-resident ones."""
    from moeprefetch import MoEPrefetchEngine

    tr.main(["--preset", "deep", "--corpus", str(corpus), "--out", str(tmp_path), "--device", "cpu",
             "--max-steps", "1", "--batch-size", "2", "--seq-len", "32", "--eval-every", "0", "--no-progress",
             "--kv-lora-rank", "32"])
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["first_k_dense_replace"], cfg["n_routed_experts"],
            cfg["num_experts_per_tok"], cfg["n_shared_experts"], cfg["n_group"], cfg["topk_group"],
            cfg["hidden_size"], cfg["kv_lora_rank"]) == (27, 1, 64, 6, 2, 8, 4, 128, 32)
    resident = MoEPrefetchEngine.from_pretrained(tmp_path, progress=False, max_seq_len=64)
    assert len(resident.args.moe_layers) == 26 and resident.has_mtp
    expected = resident.generate([[5, 6, 7]], max_new_tokens=8, stop_at_eos=False).sequences
    offloaded = MoEPrefetchEngine.from_pretrained(tmp_path, progress=False, max_seq_len=64, expert_cache_fraction=0.3)
    result = offloaded.generate([[5, 6, 7]], max_new_tokens=8, stop_at_eos=False, predictor="mtp+next_layer_gate")
    assert result.sequences == expected and result.stats.to_dict()["prefetch_issued"] > 0
