"""Shared fixtures: tiny random checkpoints in real Hugging Face format, built once per session."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors in the interpreter (tests of their logic); must be set before they are
    # defined. The engine itself runs the references on the CPU either way.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread: the tests' tensors are tiny, and on a 2-core machine that runs anything else at the same time,
# two OpenMP threads spin-waiting on each other made small ops tens of times slower (test_streaming 13 s -> 100 s).
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

logging.getLogger("transformers").setLevel(logging.ERROR)


def full_only(*values):
    """A parameter set of the full suite only: `-m "not slow"` (the fast lane) samples a parameter product, the full
    suite enumerates it (issue 41)."""
    return pytest.param(*values, marks=pytest.mark.slow)


def load_script(name: str):
    """Import a module from scripts/ by file name."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is being defined
    spec.loader.exec_module(module)
    return module


YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 32,
    "beta_slow": 1,
}

GQA_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "mscale_all_dim": 1.0}

# name -> (model_type, overrides). Together they cover every router variant, groups on and off, q_lora on and
# off, YaRN, interleaved and plain RoPE, dense prefixes and shared-expert counts.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "v3": ("deepseek_v3", {}),
    "v3_groups_qlora_yarn": (
        "deepseek_v3",
        dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3, q_lora_rank=24, rope_parameters=YARN),
    ),
    "v3_nogroup_plainrope": (
        "deepseek_v3",
        dict(
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            n_shared_experts=2,
            first_k_dense_replace=0,
            num_experts_per_tok=3,
            rope_interleave=False,
        ),
    ),
    "v2_greedy": ("deepseek_v2", {}),
    "v2_group_limited": (
        "deepseek_v2",
        dict(topk_method="group_limited_greedy", n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3),
    ),
    "v2_qlora_yarn_norm": (
        "deepseek_v2",
        dict(q_lora_rank=24, rope_parameters=YARN, norm_topk_prob=True, routed_scaling_factor=1.5),
    ),
    # grouped-query families (scripts/make_tiny_checkpoint.make_tiny_gqa_checkpoint)
    "qwen3": ("qwen3_moe", {}),
    "qwen3_sparse_step": ("qwen3_moe", dict(decoder_sparse_step=2, mlp_only_layers=[], num_hidden_layers=4,
                                            norm_topk_prob=False, num_key_value_heads=4, num_experts_per_tok=3)),
    "mixtral": ("mixtral", {}),
    "mixtral_window": ("mixtral", dict(sliding_window=5, num_key_value_heads=1, head_dim=8)),
    # GLM-4.5 (GQA with bias, q/k norm, half rotary, V3 router, MTP) and GLM-4.7-Flash (MLA, mlp_layer_types, MTP)
    "glm4": ("glm4_moe", {}),
    "glm4_plain": ("glm4_moe", dict(use_qk_norm=False, attention_bias=False, partial_rotary_factor=1.0, n_group=1,
                                    norm_topk_prob=False)),
    "glm4_lite": ("glm4_moe_lite", {}),
    # router fields transformers ignores (DeepseekV3 routes with sigmoid and noaux_tc, DeepseekV2 with softmax), and
    # moe_layer_freq, which its DeepSeek models ignore too (an MoE block in every layer past the dense prefix)
    "v3_ignored_router_fields": ("deepseek_v3", dict(scoring_func="softmax", topk_method="greedy", moe_layer_freq=2,
                                                     first_k_dense_replace=0, num_hidden_layers=3)),
    "v2_ignored_router_fields": ("deepseek_v2", dict(scoring_func="sigmoid", moe_layer_freq=2)),
    # YaRN with mscale_all_dim on grouped-query attention: transformers scales cos and sin only (the softmax scale
    # takes mscale^2 in the MLA families alone)
    "qwen3_yarn_mscale": ("qwen3_moe", dict(rope_parameters=GQA_YARN, max_position_embeddings=64)),
    "glm4_yarn_mscale": ("glm4_moe", dict(rope_parameters=dict(GQA_YARN, partial_rotary_factor=0.5),
                                          max_position_embeddings=64)),
}


@pytest.fixture(scope="session")
def tiny_script():
    return load_script("make_tiny_checkpoint")


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory, tiny_script):
    """factory(name, **options) -> path; identical requests share one directory."""
    made: dict[tuple, Path] = {}

    def make(variant: str = "v3", **options: Any) -> Path:
        key = (variant, tuple(sorted((k, repr(v)) for k, v in options.items())))
        if key not in made:
            model_type, overrides = VARIANTS[variant]
            kwargs = {**overrides, **options}
            out = tmp_path_factory.mktemp(variant)
            if model_type == "deepseek_v2":
                kwargs.setdefault("with_mtp", False)
            made[key] = tiny_script.make_tiny_checkpoint(out, model_type, **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A small byte-level BPE tokenizer (vocab 256) saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = (
        "the quick brown fox jumps over the lazy dog. In the beginning was the word. "
        "def main(): return 0. Linux kernel documentation describes the memory manager. "
    ) * 50
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        # sorted: alphabet() comes from a hash set, in another order in every process (a flaky tokenizer)
        initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet())[:200],
    )
    tokenizer.train_from_iterator([text], trainer)
    out = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", '
        '"eos_token": "<|end_of_text|>", "add_bos_token": false}'
    )
    return out


def hf_model(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' reference model of a checkpoint (eager experts and attention)."""
    import json

    import transformers

    model_type = json.loads((path / "config.json").read_text())["model_type"]
    cls = getattr(transformers, {"deepseek_v3": "DeepseekV3", "deepseek_v2": "DeepseekV2", "qwen3_moe": "Qwen3Moe",
                                 "mixtral": "Mixtral", "glm4_moe": "Glm4Moe",
                                 "glm4_moe_lite": "Glm4MoeLite"}[model_type] + "ForCausalLM")
    return cls.from_pretrained(path, dtype=dtype, experts_implementation="eager", attn_implementation="eager").eval()


def hf_mtp_model(path: Path, main_model, dtype: torch.dtype = torch.float32):
    """transformers' MtpModel for a checkpoint whose MTP layer sits at model.layers.{N} (any N, not only 61)."""
    import json

    from safetensors.torch import load_file
    from transformers.modeling_layers import MtpModel

    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update({k: v for k, v in load_file(file).items() if k.startswith(f"model.layers.{n}.")})
    mtp = MtpModel(main_model, 1).to(dtype).eval()
    renamed: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        rest = name[len(f"model.layers.{n}.") :]
        if rest.startswith(("enorm", "hnorm", "eh_proj")):
            renamed[f"layers.0.{rest}"] = tensor
        elif rest.startswith("shared_head.norm"):
            renamed["layers.0.post_norm.weight"] = tensor
        elif rest.startswith("mlp.experts."):
            _, _, e, proj, _ = rest.split(".")
            experts.setdefault(int(e), {})[proj] = tensor
        else:
            renamed[f"layers.0.mtp_block.{rest}"] = tensor
    ids = sorted(experts)
    renamed["layers.0.mtp_block.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat((experts[e]["gate_proj"], experts[e]["up_proj"])) for e in ids]
    )
    renamed["layers.0.mtp_block.mlp.experts.down_proj"] = torch.stack([experts[e]["down_proj"] for e in ids])
    missing, unexpected = mtp.load_state_dict({k: v.to(dtype) for k, v in renamed.items()}, strict=False)
    assert not unexpected, unexpected
    assert all(k in ("embed_tokens.weight", "shared_head.weight") for k in missing), missing
    return mtp


def hf_mtp_logits(mtp, main_model, ids: torch.Tensor) -> torch.Tensor:
    """MTP logits [B, T-1, V]: position i predicts token i+2 from the main hidden state at i and token i+1."""
    with torch.no_grad():
        hidden = main_model.model(ids).last_hidden_state
        t = ids.shape[1]
        positions = torch.arange(1, t).expand(ids.shape[0], -1)
        y = mtp.forward_layer(0, hidden[:, :-1], positions, None, input_ids=ids[:, 1:])
        return mtp._project_to_logits(y)


# (predictor, lookahead) pairs the learned predictor's token tests run, on the CPU and in the GPU's graphs, with the
# baseline its recall must beat last
LEARNED_ROWS = (("learned", 1), ("learned", 2), ("learned+next_layer_gate", 1), ("previous", 1))


def reference_adjusted(logits: torch.Tensor, logit_bias, presence: float, frequency: float,
                       generated: list[int]) -> torch.Tensor:
    """logits [V] in float64, biased and penalised by the tokens generated so far (OpenAI's formula, counting the
    generated tokens only)."""
    out = logits.double().clone()
    for token, bias in logit_bias:
        out[token] += bias
    for token in set(generated):
        out[token] -= presence + frequency * generated.count(token)
    return out


def cuda_available() -> bool:
    return torch.cuda.is_available()


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def serve_in_turn(batch, requests: list, order) -> dict[int, list[int]]:
    """Requests (prompt, max_new_tokens, sampling) through a ContinuousBatch, joining at token boundaries in `order`
    as rows free up -> each request's generated tokens."""
    waiting, got, rows = list(order), {}, {}
    while waiting or rows:
        while waiting and batch.free_rows:
            i = waiting.pop(0)
            row, _ = batch.admit(*requests[i])
            rows[row] = i
        for row in [r for r in rows if batch.finished(r)]:
            got[rows.pop(row)] = batch.state[row].generated
            batch.release(row)
        if rows:
            batch.step()
    return got
