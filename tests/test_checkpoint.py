"""Bad checkpoints: every defect is one CheckpointError naming the file or tensor; fuzzed headers and index files
never crash the loader with anything else."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeprefetch import CheckpointError, MoEPrefetchEngine
from moeprefetch.checkpoint import CheckpointReader, read_safetensors_header


@pytest.fixture()
def ckpt(checkpoint_factory, tmp_path) -> Path:
    """A private, writable copy of a sharded tiny checkpoint."""
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint_factory("v3"), dst)
    return dst


def _load(path: Path):
    return MoEPrefetchEngine.from_pretrained(path, progress=False)


def _index(path: Path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())


def _shard_of(path: Path, name: str) -> Path:
    return path / _index(path)["weight_map"][name]


def test_missing_shard(ckpt):
    shard = _shard_of(ckpt, "model.norm.weight")
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard.name} .* is missing"):
        _load(ckpt)


def test_truncated_shard(ckpt):
    shard = _shard_of(ckpt, "model.layers.1.mlp.experts.3.up_proj.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=rf"{shard.name} is truncated: tensor"):
        _load(ckpt)


def test_corrupt_header_json(ckpt):
    shard = _shard_of(ckpt, "model.norm.weight")
    data = bytearray(shard.read_bytes())
    data[12:20] = b"\xff\xfe{{{{{{"
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard.name} has a corrupt safetensors header"):
        _load(ckpt)


def test_header_length_beyond_file(ckpt):
    shard = _shard_of(ckpt, "model.norm.weight")
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 4)
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt safetensors header: it declares"):
        _load(ckpt)


def test_corrupt_tensor_data_is_caught(ckpt):
    """Bytes that decode to NaN/inf in a weight (a damaged file) are refused, naming the tensor."""
    name = "model.layers.0.self_attn.o_proj.weight"
    info = CheckpointReader(ckpt).info(name)
    data = bytearray(info.file.read_bytes())
    data[info.offset : info.offset + 8] = b"\xff" * 8  # NaN in fp32
    info.file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' .* NaN"):
        _load(ckpt)


def test_index_names_a_tensor_no_shard_holds(ckpt):
    index = _index(ckpt)
    first_shard = next(iter(index["weight_map"].values()))
    index["weight_map"]["model.layers.0.self_attn.phantom.weight"] = first_shard
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="names tensor 'model.layers.0.self_attn.phantom.weight'.*no shard holds"):
        _load(ckpt)


def test_index_is_not_json(ckpt):
    (ckpt / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="index.json is not valid JSON"):
        _load(ckpt)


def test_tensor_shape_disagrees_with_config(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["kv_lora_rank"] = 24  # the tensors were saved with 32
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="kv_a_proj_with_mqa.weight' in .* has shape .* but the config implies"):
        _load(ckpt)


def test_tensor_dtype_disagrees(ckpt):
    from safetensors.torch import load_file, save_file

    name = "model.layers.0.self_attn.o_proj.weight"
    shard = _shard_of(ckpt, name)
    tensors = load_file(shard)
    tensors[name] = torch.zeros(tensors[name].shape, dtype=torch.int32)
    save_file(tensors, shard)
    with pytest.raises(CheckpointError, match=f"'{name}' .* has dtype I32"):
        _load(ckpt)


def test_unknown_model_type(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError,
                       match="model_type 'llama'; supported: deepseek_v3, deepseek_v2, qwen3_moe, mixtral"):
        _load(ckpt)


@pytest.mark.parametrize("model_type,fields,match", [
    ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method 'noaux_tc' is not supported for deepseek_v2"),
    ("deepseek_v3", dict(topk_method="random"), "topk_method 'random' is not supported"),
    ("deepseek_v3", dict(scoring_func="tanh"), "scoring_func 'tanh' is not supported")])
def test_a_router_transformers_cannot_run_is_one_sentence(ckpt, model_type, fields, match):
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(dict(config, model_type=model_type, **fields)))
    with pytest.raises(CheckpointError, match=match):
        _load(ckpt)


@pytest.mark.parametrize("field", ["hidden_size", "n_routed_experts", "kv_lora_rank", "num_experts_per_tok"])
def test_config_missing_a_required_field(ckpt, field):
    config = json.loads((ckpt / "config.json").read_text())
    del config[field]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"missing required field.*{field}"):
        _load(ckpt)


def test_config_missing_or_broken(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(dict(config, hidden_size="abc")))
    with pytest.raises(CheckpointError) as refused:  # transformers' own validation error, on one line
        _load(ckpt)
    assert "rejected by transformers' AutoConfig" in str(refused.value) and "hidden_size" in str(refused.value)
    assert "\n" not in str(refused.value)
    (ckpt / "config.json").write_text("[1, 2")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        _load(ckpt)
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        _load(ckpt)


def _drop_tensor(ckpt: Path, name: str) -> None:
    """Remove one tensor from its shard and from the index, as a checkpoint with a missing tensor would be."""
    from safetensors.torch import load_file, save_file

    shard = _shard_of(ckpt, name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard)
    index = _index(ckpt)
    del index["weight_map"][name]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


def test_mtp_layer_partly_present(ckpt):
    n = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    name = f"model.layers.{n}.eh_proj.weight"
    _drop_tensor(ckpt, name)
    with pytest.raises(CheckpointError, match=f"MTP layer model.layers.{n} is only partly present: missing {name}"):
        _load(ckpt)


def test_missing_expert_tensor(ckpt):
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    _drop_tensor(ckpt, name)
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is missing"):
        _load(ckpt)


def test_broken_tokenizer(ckpt):
    (ckpt / "tokenizer.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="tokenizer in .* cannot be loaded"):
        _load(ckpt)


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist or is not a directory"):
        _load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((Path(__file__).parent / "conftest.py").read_text()[:0] or "{}")
    with pytest.raises(CheckpointError):
        _load(tmp_path / "empty")


def test_cli_reports_bad_checkpoint_without_traceback(ckpt, capsys):
    from moeprefetch.cli import main

    (ckpt / "config.json").write_text("[")
    code = main(["generate", str(ckpt), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and "config.json is not valid JSON" in err
    assert "Traceback" not in err


# ---- property-based: malformed headers and index files ------------------------------------------------------------


def _write_raw(path: Path, header: bytes, data: bytes, declared: int | None = None) -> Path:
    length = len(header) if declared is None else declared
    path.write_bytes(struct.pack("<Q", length) + header + data)
    return path


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
entries = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(["F32", "BF16", "F8_E4M3", "I64", "XX", ""]) | json_values,
        "shape": st.lists(st.integers(-3, 40), max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(-10, 400), max_size=3) | json_values,
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    header=st.dictionaries(st.text(min_size=1, max_size=12), entries | json_values, max_size=4),
    data=st.binary(max_size=256),
    length_delta=st.integers(-5, 5) | st.just(0),
)
def test_fuzzed_headers_raise_only_checkpoint_errors(tmp_path_factory, header, data, length_delta):
    raw = json.dumps(header).encode()
    path = _write_raw(tmp_path_factory.mktemp("fuzz") / "model.safetensors", raw, data, max(len(raw) + length_delta, 0))
    try:
        tensors = read_safetensors_header(path)
    except CheckpointError as exc:
        assert str(path) in str(exc)
        return
    # accepted headers are self-consistent: every tensor lies inside the file
    size = path.stat().st_size
    for info in tensors.values():
        assert info.offset + info.nbytes <= size


@settings(max_examples=80, deadline=None)
@given(raw=st.binary(max_size=64))
def test_fuzzed_raw_bytes_raise_only_checkpoint_errors(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("raw") / "model.safetensors"
    path.write_bytes(raw)
    with pytest.raises(CheckpointError):
        read_safetensors_header(path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(index=json_values | st.fixed_dictionaries({"weight_map": json_values}))
def test_fuzzed_index_files_raise_only_checkpoint_errors(checkpoint_factory, tmp_path_factory, index):
    src = checkpoint_factory("v3")
    dst = tmp_path_factory.mktemp("index")
    for file in src.glob("*.safetensors"):
        (dst / file.name).symlink_to(file)
    (dst / "config.json").write_text((src / "config.json").read_text())
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    try:
        reader = CheckpointReader(dst)
    except CheckpointError as exc:
        assert "index.json" in str(exc) or "shard" in str(exc)
        return
    for name, shard in index["weight_map"].items():  # an accepted index agrees with the shards
        assert reader.info(name).file.name == shard
