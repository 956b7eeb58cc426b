"""accounting.py: counters read from the device rows by name, byte and rate formulas, merging, the JSONL log."""

from __future__ import annotations

import json

import pytest

from moeprefetch.accounting import LayerCounters, Stats, merge_stats, prediction_table
from moeprefetch.residency.state import COUNTERS


def counters(record: int = 1000, chunk: int = 256, **values: int) -> LayerCounters:
    return LayerCounters.from_row([values.get(name, 0) for name in COUNTERS], record, chunk)


def test_a_device_row_is_read_by_counter_name():
    row = [3 * i + 1 for i in range(len(COUNTERS))]
    c = LayerCounters.from_row(row, 1000, 256)
    for i, name in enumerate(COUNTERS):
        assert getattr(c, name) == 3 * i + 1, name
    assert c.chunks_per_record == 4  # ceil(1000 / 256)


def test_bytes_count_whole_records_and_the_chunks_of_unfinished_fills():
    c = counters(zero_copy=3, fills_done=2, fill_chunks=2 * 4 + 3)  # two whole fills, three chunks of a third
    assert c.zero_copy_bytes == 3000
    assert c.fill_bytes == 2 * 1000 + 3 * 256
    assert c.bytes_h2d == 3000 + 2768
    view = c.as_dict()
    assert view["bytes_h2d"] == view["zero_copy_bytes"] + view["fill_bytes"]


def test_hits_include_prefetched_and_late_and_prediction_ratios_are_none_without_data():
    c = counters(uses=10, hit=4, prefetched=2, late=1, miss=3, predicted=8, truth=10, predicted_correct=6)
    view = c.as_dict()
    assert view["hits"] == 7 and view["misses"] == 3 and view["hits"] + view["misses"] == view["expert_uses"]
    assert view["hit_rate"] == pytest.approx(0.7)
    assert view["prediction_recall"] == pytest.approx(0.6) and view["prediction_precision"] == pytest.approx(0.75)
    empty = counters().as_dict()
    assert empty["hit_rate"] == 0.0 and empty["prediction_recall"] is None and empty["prediction_precision"] is None


def make_stats(decode_seconds: float = 0.5, tokens: int = 11, mtp_layer_counts: int = 0) -> Stats:
    main = counters(uses=20, hit=10, prefetched=4, late=2, miss=4, zero_copy=6, fills_done=5, fill_chunks=20,
                    prefetch_issued=8, prefetch_wasted=2, predicted=10, truth=12, predicted_correct=9, lead_sum=12)
    mtp = counters(uses=5, hit=1, miss=4, zero_copy=4, predicted=mtp_layer_counts, truth=mtp_layer_counts)
    prefill = counters(uses=6, hit=2, miss=4, zero_copy=4)
    return Stats(per_layer={1: main + prefill, 9: mtp}, decode_per_layer={1: main, 9: mtp}, main_layers=(1,),
                 prompt_tokens=30, generated_tokens=tokens, sequences=1, decode_steps=tokens - 1,
                 decode_syncs=tokens - 1, prefill_seconds=0.25, decode_seconds=decode_seconds, expert_bytes=1000)


def test_per_token_figures_count_decode_only_and_exclude_the_first_token():
    out = make_stats().to_dict()
    tokens = 10  # 11 generated, the first comes out of prefill
    assert out["ms_per_token"] == pytest.approx(1000 * 0.5 / tokens)
    assert out["decode_tokens_per_s"] == pytest.approx(tokens / 0.5)
    assert out["prefill_tokens_per_s"] == pytest.approx(30 / 0.25)
    assert out["syncs_per_token"] == pytest.approx(1.0)
    # decode counters only: main layer (6 + 4 zero-copy experts, 5 fills) and the MTP layer (4 zero-copy)
    assert out["zero_copy_bytes_per_token"] == pytest.approx((6 + 4) * 1000 / tokens)
    assert out["fill_bytes_per_token"] == pytest.approx(5 * 1000 / tokens)
    assert out["decode_misses_per_token"] == pytest.approx((4 + 4) / tokens)
    assert out["decode_hit_rate"] == pytest.approx((16 + 1) / 25)
    # the whole call includes prefill's uses
    assert out["expert_uses"] == 20 + 6 + 5 and out["misses"] == 4 + 4 + 4
    assert out["prefill_bytes_h2d"] == 4 * 1000  # prefill's 4 zero-copy experts, apart from decode's
    assert out["prefetch_waste"] == pytest.approx(2 / 8) and out["mean_lead_layers"] == pytest.approx(12 / 2 / 4)
    stats = make_stats()
    stats.extra.update(prefill_experts_ahead=5, prefill_experts_ahead_unused=2)  # copied ahead, 2 never used
    assert stats.to_dict()["prefill_bytes_h2d"] == (4 + 2) * 1000


def test_recall_counts_the_main_layers_only():
    out = make_stats(mtp_layer_counts=50).to_dict()
    assert out["prediction_recall_main_layers"] == pytest.approx(9 / 12)
    assert out["prediction_precision_main_layers"] == pytest.approx(9 / 10)
    assert out["prediction_recall"] != out["prediction_recall_main_layers"]  # the all-layer figure differs
    none_ran = Stats(per_layer={1: counters(uses=4, truth=4)}, main_layers=(1,)).to_dict()
    assert none_ran["prediction_recall_main_layers"] is None  # no predictor: no figure, not 0 %


def test_merging_sums_counters_and_takes_rates_as_totals_over_totals():
    a, b = make_stats(decode_seconds=0.5), make_stats(decode_seconds=1.5, tokens=21)
    merged = merge_stats([a, b]).to_dict()
    assert merged["expert_uses"] == 2 * a.to_dict()["expert_uses"]
    assert merged["ms_per_token"] == pytest.approx(1000 * (0.5 + 1.5) / (10 + 20))
    assert merged["per_layer"]["1"]["fill_bytes"] == 2 * a.to_dict()["per_layer"]["1"]["fill_bytes"]
    assert merged["runs"] == 2 and merged["main_moe_layers"] == [1]


def test_the_jsonl_log_has_the_call_then_one_line_per_layer(tmp_path):
    stats = make_stats()
    path = tmp_path / "events.jsonl"
    stats.write_jsonl(path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["kind"] == "call" and lines[0]["ms_per_token"] == stats.to_dict()["ms_per_token"]
    assert [(line["kind"], line["layer"]) for line in lines[1:]] == [("layer", 1), ("layer", 9)]
    assert lines[1]["decode"]["expert_uses"] == 20 and lines[1]["expert_uses"] == 26
    rows = prediction_table(stats.to_dict())
    assert [r["layer"] for r in rows] == [1, 9] and rows[0]["prediction_recall"] == pytest.approx(9 / 12)
