"""scripts/bench_gpu.py on the CPU at its tiny scale: the rows a GPU call relies on come out, with their tokens
checked against the all-resident run."""

from __future__ import annotations

import json

import pytest

from conftest import load_script


@pytest.mark.slow
def test_a_tiny_decode_run_gives_every_asked_row_with_the_all_resident_tokens(tmp_path):
    bench = load_script("bench_gpu")
    out = tmp_path / "bench.json"
    # int4 at 12 GiB holds every tiny expert (no host store): its rows must still come out
    bench.main(["--device", "cpu", "--scale", "tiny", "--workloads", "v2lite", "--runs", "1", "--new-tokens", "3",
                "--prompt-tokens", "6", "--out", str(out), "--workdir", str(tmp_path / "work"),
                "--systems", "all_resident,none,oracle,oracle_next", "--expert-dtypes", "int8,int4",
                "--int4-group-size", "32"])
    rows = {row["system"]: row for row in json.loads(out.read_text())["rows"]}
    assert not [row for row in rows.values() if "failed" in row]
    assert {"all_resident", "resident_at_budget", "plan", "none", "oracle", "oracle_next", "floor", "none@int8",
            "next_layer_gate@int8", "none@int4", "next_layer_gate@int4"} <= set(rows)
    assert "next_layer_gate" not in rows  # --systems leaves out what it does not name
    for system in ("resident_at_budget", "none", "oracle", "oracle_next"):
        assert rows[system]["same_tokens_as_all_resident"] is True, system
    assert rows["none@int4"]["host_expert_gib"] is None  # every int4 expert resident: nothing on the host
    assert rows["none@int8"]["host_expert_gib"] is None or rows["none@int8"]["host_expert_gib"] > 0
    assert rows["floor"]["belady_bytes_per_token"] >= 0
    assert rows["oracle_next"]["spare_recent"] == 0 and rows["none"]["spare_recent"] == 1  # what each call ran
    assert rows["all_resident"]["ms_per_token"] > 0


def test_a_share_of_the_experts_is_kept_when_the_all_resident_row_is_skipped():
    """--cache-fraction sizes the trained models' caches from the experts the all-resident row counted; a run whose
    --systems skips that row hands the share to the engine instead of a fixed slot count."""
    bench = load_script("bench_gpu")
    args = bench.build_parser().parse_args(["--workloads", "deep", "--cache-fraction", "0.3", "--systems", "none"])
    run = bench.WorkloadRun("deep", None, args, None, {}, print, [], {}, {}, {})
    assert bench.offloaded_options(run)["expert_cache_fraction"] == 0.3
    assert "expert_cache_slots" not in bench.offloaded_options(run)
    run.total_experts = 1728
    options = bench.offloaded_options(run)
    assert options["expert_cache_slots"] == 518 and "expert_cache_fraction" not in options


def test_offloaded_timelines_run_each_named_row_with_its_modifiers_and_restore_the_engine_options():
    """--profile-predictors names rows as --systems does ('learned~budget0~reuse0.7~bypass'): each timeline is
    recorded under that row's options, and the engine's own options come back after it."""
    import types

    from moeprefetch.options import EngineConfig

    bench = load_script("bench_gpu")
    args = bench.build_parser().parse_args(
        ["--workloads", "deep", "--profile", "--profile-predictors",
         "none,learned~budget0~reuse0.7~bypass,oracle~idle"])
    engine = types.SimpleNamespace(options=EngineConfig(), has_mtp=True)
    seen = []

    def timeline_row(engine_, system, predictor, speculative=None):
        seen.append((system, predictor, engine_.options.prefetch_budget, engine_.options.reuse_weight,
                     engine_.options.bypass, engine_.options.fill_link))

    run = types.SimpleNamespace(args=args, timeline_row=timeline_row)
    before = engine.options
    bench.offloaded_timelines(run, engine)
    assert engine.options is before
    default = before
    assert seen == [("timeline_none", "none", default.prefetch_budget, default.reuse_weight, default.bypass,
                     default.fill_link),
                    ("timeline_learned~budget0~reuse0.7~bypass", "learned", 0.0, 0.7, True, default.fill_link),
                    ("timeline_oracle~idle", "oracle", default.prefetch_budget, default.reuse_weight, default.bypass,
                     "idle")]
    assert default.fill_link != "idle" and default.reuse_weight != 0.7  # the modifiers changed something
