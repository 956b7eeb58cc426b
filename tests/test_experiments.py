"""Hydra configs compose, a tiny sweep runs end to end (including a failing point), and its report is produced."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

hydra = pytest.importorskip("hydra")
from hydra import compose, initialize_config_dir  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["model", "cache", "predictor", "workload", "device"])
def test_every_config_composes(group):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        for option in _options(group):
            overrides = [f"{group}={option}"]
            if group == "model" and option == "custom":
                overrides.append("model.path=/some/checkpoint")
            cfg = compose(config_name="config", overrides=overrides)
            assert cfg[group] is not None
            if group == "predictor":
                from moeprefetch.predictors import parse_predictor

                assert parse_predictor(cfg.predictor.name)  # every predictor config names a real predictor
            if group == "cache":
                given = [k for k in ("slots", "fraction", "budget") if cfg.cache[k] is not None]
                assert len(given) <= 1


def test_prompts_are_held_out_text():
    """Sweep prompts come from the held-out split, never from training documents."""
    prompts = [json.loads(line) for line in (ROOT / "experiments/prompts/heldout.jsonl").read_text().splitlines()]
    assert len(prompts) >= 8
    assert {p["source"] for p in prompts} <= {"kjv", "python-doc"}
    card = (ROOT / "moeprefetch/reference_model/README.md").read_text()
    # the model card lists the held-out documents (Ezra, Judges are the KJV ones)
    assert all(p["doc"] in ("Ezra", "Judges") for p in prompts if p["source"] == "kjv")
    assert "held-out" in card.lower()



def test_a_sweep_with_two_cache_sizes_is_refused_with_the_engines_one_rule():
    """The sweep resolves no precedence of its own: a size added over the cache group's is the engine's error."""
    import importlib.util

    from moeprefetch.errors import RequestError

    spec = importlib.util.spec_from_file_location("sweep_config", ROOT / "experiments" / "sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        both = sweep.engine_config(compose(config_name="config", overrides=["cache.slots=16"]))
        with pytest.raises(RequestError, match="give one of expert_cache_slots or expert_cache_fraction"):
            both.check()
        for overrides, field, value in ((["cache=slots", "cache.slots=16"], "expert_cache_slots", 16),
                                        ([], "expert_cache_fraction", 0.25),
                                        (["cache=budget"], "vram_budget", "12GiB")):
            config = sweep.engine_config(compose(config_name="config", overrides=overrides))
            config.check()
            assert getattr(config, field) == value
            assert [name for name in ("expert_cache_slots", "expert_cache_fraction", "vram_budget")
                    if getattr(config, name) is not None] == [field]

@pytest.mark.slow
def test_tiny_sweep_end_to_end(tmp_path, checkpoint_factory, tiny_tokenizer_dir):
    model = checkpoint_factory("v3", tokenizer_from=str(tiny_tokenizer_dir))
    sweep_dir = tmp_path / "sweep"
    command = [
        sys.executable, str(ROOT / "experiments/sweep.py"), "-m",
        "model=custom", f"model.path={model}", "cache.fraction=0.5,1.0", "predictor=none,mtp,oracle",
        "workload.num_prompts=2", "workload.new_tokens=5", f"hydra.sweep.dir={sweep_dir}", "hydra.output_subdir=null",
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (sweep_dir / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    assert all(r["status"] == "ok" for r in rows)
    for row in rows:
        assert row["hits"] + row["misses"] == row["expert_uses"] > 0
        assert row["bytes_h2d"] == row["zero_copy_bytes"] + row["fill_bytes"]
        assert row["git_commit"] is not None and row["torch"]
    oracle = [r for r in rows if r["predictor"] == "oracle"]
    assert all(r["prediction_recall_main_layers"] == 1.0 for r in oracle)

    # a point that fails is recorded and the sweep goes on; earlier rows stay
    bad = command[:3] + ["model=custom", f"model.path={model}", "cache=slots", "cache.slots=1,16", "predictor=none",
                         "workload.num_prompts=1", "workload.new_tokens=3", f"hydra.sweep.dir={sweep_dir}",
                         "hydra.output_subdir=null"]
    done = subprocess.run(bad, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (sweep_dir / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    assert rows[6]["status"] == "failed"
    assert "expert_cache_slots=1" in rows[6]["error"]
    assert rows[7]["status"] == "ok"

    report = subprocess.run([sys.executable, str(ROOT / "experiments/report.py"), str(sweep_dir / "results.jsonl")],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    text = (sweep_dir / "report.md").read_text()
    assert "![decode hit rate](hit_rate_vs_cache.png)" in text and "Failed points" in text
    for png in ("hit_rate_vs_cache.png", "recall_vs_cache.png", "bytes_vs_cache.png", "recall_precision_per_layer.png"):
        assert (sweep_dir / png).stat().st_size > 5000


def test_merge_stats_sums_counters_exactly():
    from moeprefetch.accounting import LayerCounters, Stats, merge_stats

    def run(uses, hits, truth, correct, predicted, seconds, tokens):
        layer = LayerCounters(uses=uses, hit=hits, miss=uses - hits, zero_copy=uses - hits, truth=truth,
                              predicted=predicted, predicted_correct=correct, record_bytes=10)
        return Stats(per_layer={1: layer}, decode_per_layer={1: layer}, main_layers=(1,), decode_seconds=seconds,
                     generated_tokens=tokens + 1, sequences=1)

    merged = merge_stats([run(10, 5, 8, 4, 8, 1.0, 10), run(30, 27, 20, 18, 24, 3.0, 30)]).to_dict()
    assert merged["hit_rate"] == pytest.approx(32 / 40)
    assert merged["prediction_recall_main_layers"] == pytest.approx(22 / 28)
    assert merged["prediction_precision_main_layers"] == pytest.approx(22 / 32)
    assert merged["per_layer"]["1"]["hit_rate"] == pytest.approx(32 / 40)
    assert merged["bytes_h2d"] == 80 and merged["ms_per_token"] == pytest.approx(100.0)


@pytest.mark.slow  # ~40 s on 2 cores: 13 generations through the reference plans
def test_oracle_divergence_finds_the_first_differing_token_and_runs_every_variant(tmp_path, monkeypatch):
    """scripts/oracle_divergence.py: the first index where two token lists part (a shorter one parts where it ends),
    and on the CPU (tiny V2-Lite, reference plans) every row of the chosen variants, and the probed rows, keep
    all-resident's tokens with every slot whole."""
    import json
    import sys

    from conftest import load_script

    script = load_script("oracle_divergence")
    assert script.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert script.first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert script.first_difference([1, 2], [1, 2, 3]) == 2
    out = tmp_path / "divergence.json"
    monkeypatch.setattr(sys, "argv", ["oracle_divergence.py", "--device", "cpu", "--scale", "tiny", "--slots", "10",
                                      "--new-tokens", "6", "--workdir", str(tmp_path), "--out", str(out),
                                      "--variants", "late_reread,inflight1,no_graphs", "--probe"])
    script.main()
    rows = json.loads(out.read_text())["rows"]
    assert {(r["predictor"], r["variant"]) for r in rows} == {
        (p, v) for p in ("oracle_next", "oracle") for v in ("probe", "base", "late_reread", "inflight1", "no_graphs")
    } | {("none", "base")}
    assert all(r["first_difference"] is None and r["corrupt_slots"] == 0 for r in rows)
    probed = [r for r in rows if r["variant"] == "probe"]
    assert all(r["checked"] > 0 and r["stale_hit"] == r["torn_in_table"] == 0 for r in probed)
    assert any(r["prefetch_issued"] for r in rows)  # the oracles did fill: the rows exercise the fill path


def test_token_routing_table_counts_each_tokens_experts_and_smooths_towards_the_layer():
    """experiments/token_routing_tables.py: T[v, l, e] is token v's share of uses of expert e at layer l, pulled
    towards the layer's overall frequencies by the smoothing's pseudo-counts; an unseen id gets those frequencies."""
    import importlib.util

    import torch

    from moeprefetch.routing_record import RoutingRecord

    spec = importlib.util.spec_from_file_location("token_tables", ROOT / "experiments" / "token_routing_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # tokens 0, 1, 0 at one layer of 4 experts, top-2
    ids = torch.tensor([[[0, 1]], [[2, 3]], [[0, 2]]])
    record = RoutingRecord(hidden=torch.zeros(3, 2), mtp_hidden=None, ids=ids, window=torch.zeros(3, dtype=torch.long),
                           mtp_router=None)
    table = module.routing_table(torch.tensor([0, 1, 0]), record, vocab=3, n_experts=4, smoothing=1.0)
    overall = torch.tensor([2, 1, 2, 1]) / 3  # uses per token
    assert torch.allclose(table[0, 0], (torch.tensor([2.0, 1, 1, 0]) + overall) / 3)
    assert torch.allclose(table[1, 0], (torch.tensor([0.0, 0, 1, 1]) + overall) / 2)
    assert torch.allclose(table[2, 0], overall)  # never seen
    truth = torch.tensor([[[0, 1]]])
    assert module.recall(table[0:1], truth, 2) == 0.5  # its top-2 are experts 0 and one of 1/2


def test_table_stress_checks_every_product_and_finds_a_torn_slot(tmp_path):
    """scripts/table_stress.py (the GPU test of the fills runs it on real records): on the CPU's reference plans, the
    oracle's run issues fills, names every need, and every product and layer output equals all-resident's; a slot
    written wrong after a run is reported with the chunk that differs and whose words it holds."""
    import torch

    from conftest import load_script

    table_stress = load_script("table_stress")
    out = tmp_path / "stress.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts/table_stress.py"), "--device", "cpu", "--tiny",
                           "--tokens", "8", "--runs", "oracle", "--repeats", "1", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(out.read_text())["rows"][1]
    assert row["counters"]["prefetch_issued"] > 0 and row["counters"]["predicted_correct"] == row["counters"]["truth"]
    assert row["checked"] == 8 * 4 * 2 and row["wrong"] == 0 and row["wrong_layer_outputs"] == 0
    assert row["corrupt_slots"] == 0

    fmt = table_stress.ExpertFormat.build(64, 32, torch.float32, "model")
    store = table_stress.build_store(fmt, 2, 4, torch.device("cpu"), pin=False, seed=0)
    res = table_stress.make_residency(fmt, 2, 4, 2, 3, store, torch.device("cpu"))
    res.pool[0].copy_(store.record(1, 2))  # a slot published with key 6 but holding key 5's bytes in its chunk 0
    res.pool[0, :64].copy_(store.record(1, 1)[:64])
    res.st.key_of[0], res.st.slot_state[0], res.st.slot_of[6] = 6, 1, 0
    assert res.corrupt_slots() == [0]
    detail = table_stress.corrupt_detail(res, 0, table_stress.host_chunk_sums(store, torch.device("cpu")))
    assert detail["key"] == 6 and detail["wrong_chunks"] == [[0, 0]]
    assert detail["sources"][0]["keys_matching_the_differing_words"][0] == [5, 1.0]


def test_bench_batch_steps_times_each_mix_with_its_paths_and_every_path(tmp_path, monkeypatch):
    """scripts/bench_batch_steps.py on the CPU (tiny V2-Lite): a row per (mix, rows, variant), each with a time."""
    import json
    import sys

    from conftest import load_script

    script = load_script("bench_batch_steps")
    out = tmp_path / "steps.json"
    monkeypatch.setattr(sys, "argv", ["bench_batch_steps.py", "--device", "cpu", "--scale", "tiny", "--rows", "1,2",
                                      "--steps", "2", "--expert-dtype", "model", "--workdir", str(tmp_path),
                                      "--out", str(out)])
    assert script.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["mix"], r["rows"], r["variant"]) for r in rows} == {
        (m, n, v) for m in ("greedy", "temperature", "top_p") for n in (1, 2) for v in ("row_paths", "every_path")}
    assert all(r["ms_per_step"] > 0 for r in rows)


def test_prefetch_bytes_counts_protection_without_fills_and_fills_beside_misses(tmp_path):
    """scripts/prefetch_bytes.py on the reference model with its shipped routing head: with `--prefetch-budget 0` the
    learned head only protects (nothing issued, every expert moved is a miss); with a budget of 1.5 (the default of
    every predictor but the head alone) the same head also fills, so it moves more experts than it misses. Belady's row
    bounds the misses of every row that admits each miss (a bypassing one may go below it)."""
    import json

    from conftest import load_script

    script = load_script("prefetch_bytes")
    head = ROOT / "moeprefetch" / "reference_model" / "routing_head.safetensors"
    out = tmp_path / "bytes.json"
    common = ["--model", "reference", "--slots", "24", "--prompts", "2", "--new-tokens", "8", "--leads", "0",
              "--predictors", "none,learned", "--predictor-path", str(head), "--reuse-weight", "0.7", "--out", str(out)]
    assert script.main(common + ["--prefetch-budget", "0", "--bypass"]) == 0
    assert script.main(common + ["--prefetch-budget", "1.5", "--no-bypass"]) == 0
    rows = json.loads(out.read_text())["rows"]
    protect, fill = (r for r in rows if r.get("system") == "learned")
    assert protect["prefetch_budget"] == 0 and protect["bypass"] and protect["prefetch_waste"] is None
    assert protect["experts_per_token"] == pytest.approx(protect["misses_per_token"])
    assert fill["prefetch_budget"] > 0 and fill["prefetch_waste"] is not None
    assert fill["experts_per_token"] > fill["misses_per_token"]
    belady = [r["experts_per_token"] for r in rows if r["system"] == "belady"]
    assert all(r["misses_per_token"] >= belady[-1] - 1e-9 for r in rows if r["system"] != "belady" and not r["bypass"])


def test_protection_ceilings_split_steps_and_bound_every_horizon_by_beladys_floor(tmp_path):
    """experiments/protection_ceilings.py: a recorded trace splits into the prefill's distinct experts and one list
    per decode step; on the reference model every K-token protection line lies above Belady's floor with bypass,
    which lies at or below Belady's."""
    import importlib.util
    import json

    import numpy as np

    spec = importlib.util.spec_from_file_location("protection_ceilings",
                                                  ROOT / "experiments" / "protection_ceilings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    uses = [(1, 3), (2, 0), (1, 3), (1, 5), (2, 1), (1, 2), (2, 2), (2, 4)]
    prefill, steps = module.decode_steps(uses, 3, 2)
    assert prefill == [(1, 3), (2, 0)]
    assert steps == [[(1, 5), (2, 1)], [(1, 2), (2, 2), (2, 4)]]
    ids = tmp_path / "heldout.npy"
    np.save(ids, np.random.default_rng(0).integers(2, 250, size=2100))
    out = tmp_path / "ceilings.json"
    assert module.main(["--checkpoint", str(ROOT / "moeprefetch" / "reference_model"), "--slots", "40", "--prompts",
                        "2", "--new-tokens", "12", "--heldout-ids", str(ids), "--dtype", "float32",
                        "--aheads", "0,1,4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    misses = report["misses_per_token"]
    assert report["decode_steps"] == 2 * 11
    assert misses["belady_bypass"] <= misses["belady"] + 1e-9
    assert all(misses[f"ahead_{k}"] >= misses["belady_bypass"] - 1e-9 for k in (0, 1, 4))
    assert misses["ahead_0"] > misses["belady"]


def test_victim_signals_features_are_what_a_token_start_knows_and_auc_ranks():
    """experiments/victim_signals.py: at token t's start the head's guesses are token t-1's (none across a window
    boundary), frequency decays by the half-life after counting each use, and AUC is the share of (needed, not
    needed) pairs ranked right."""
    import importlib.util
    import math

    import numpy as np
    import torch

    spec = importlib.util.spec_from_file_location("victim_signals", ROOT / "experiments" / "victim_signals.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ids = np.array([[[0], [2]], [[1], [2]], [[0], [1]]])  # 3 tokens, 2 layers, top-1 of 3 experts
    probs = np.full((3, 1, 2, 3), 0.25)
    probs[0, 0, 1, 1] = 0.9  # token 0's guess that layer 1 expert 1 is next
    soon = np.full((3, 2, 3), 0.5)
    soon[1, 0, 0] = 0.8
    window = np.array([0, 0, 1])
    x, used = module.features(ids, probs, soon, window, experts=3, halflife=1.0)
    assert used.tolist() == [[True, False, False, False, False, True], [False, True, False, False, False, True],
                             [True, False, False, False, True, False]]
    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    assert x[1, 4, 3] == np.float32(logit(0.9)) and x[1, 3, 3] == np.float32(logit(0.25))  # token 0's guesses
    assert x[2, 0, 0] == np.float32(logit(1e-4))  # a new window: no guesses
    assert x[0, 0, 0] == np.float32(logit(1e-4))
    # frequency at token 2's start: key 5 used at tokens 0 and 1, halved after each token: 1 x 0.5 + 1 = 1.5
    assert math.isclose(float(x[2, 5, 1]), math.log(1.5 + 0.05), rel_tol=1e-6)
    assert math.isclose(float(x[2, 0, 1]), math.log(0.5 + 0.05), rel_tol=1e-6)  # key 0 used at token 0 only
    assert math.isclose(float(x[2, 0, 2]), math.log1p(2), rel_tol=1e-6)  # two tokens since its use
    assert module.auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0.0, 0.0, 1.0, 1.0])) == 0.75
