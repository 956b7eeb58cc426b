"""report.py: the run summary, a stats report and a sweep report read the statistics they are given, nothing else."""

from __future__ import annotations

import json

import pytest

from moeprefetch.report import ReportError, summary_lines, write_report

from test_accounting import make_stats


def test_summary_lines_state_the_figures_and_na_when_nothing_was_predicted():
    stats = make_stats().to_dict()
    text = "\n".join(summary_lines(stats, device="cpu"))
    assert "decode 20.0 tok/s (50.0 ms/token, cpu)" in text
    assert f"{stats['expert_uses']} uses" in text and f"({stats['misses']} misses)" in text
    assert "recall 75.0%, precision 90.0%" in text
    assert "1.00 host synchronisations per token" in text
    no_prediction = dict(stats, prediction_recall_main_layers=None, prediction_precision_main_layers=None)
    assert "recall n/a, precision n/a" in "\n".join(summary_lines(no_prediction))


def test_a_stats_json_becomes_a_report_with_its_per_layer_table(tmp_path):
    stats = make_stats().to_dict()
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"stats": stats}))
    report = write_report(path, tmp_path / "out").read_text()
    assert "## Per layer" in report
    layer_rows = [line for line in report.splitlines() if line.startswith("| 1 |") or line.startswith("| 9 |")]
    assert len(layer_rows) == 2 and f"| {stats['per_layer']['1']['expert_uses']} |" in layer_rows[0]


def sweep_row(predictor: str, slots: int, hit: float, status: str = "ok") -> dict:
    stats = make_stats().to_dict()
    return {**stats, "status": status, "predictor": predictor, "lookahead": 1, "min_confidence": 0.0,
            "policy": "lru", "cache_slots": slots, "cache_fraction": slots / 40, "decode_hit_rate": hit,
            "model": "m", "device": "cpu", "batch": 1, "new_tokens": 10, "prompt_count": 1,
            **({"error": "RuntimeError: boom"} if status != "ok" else {})}


def test_a_sweep_report_tables_the_decode_figures_and_lists_failed_points(tmp_path):
    rows = [sweep_row("none", 10, 0.5), sweep_row("mtp", 10, 0.625), sweep_row("mtp", 20, 0.75),
            sweep_row("oracle", 20, 1.0, status="failed")]
    results = tmp_path / "results.jsonl"
    results.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    report = write_report(results).read_text()
    table = [line for line in report.splitlines() if line.startswith("| mtp |") or line.startswith("| none |")]
    assert len(table) == 3
    assert "62.5%" in table[0] and "| 0.80 |" in table[0]  # decode hit rate; decode misses per token (8 / 10)
    assert "## Failed points" in report and "RuntimeError: boom" in report
    assert (tmp_path / "hit_rate_vs_cache.png").stat().st_size > 0


def test_results_without_a_successful_point_write_nothing(tmp_path):
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(sweep_row("mtp", 10, 0.5, status="failed")) + "\n")
    with pytest.raises(ReportError, match="no successful sweep points"):
        write_report(results, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_sweep_with_chained_leads_draws_recall_against_lead(tmp_path):
    rows = []
    for slots in (10, 20):
        for lookahead, recall in ((1, [0.8]), (2, [0.8, 0.41]), (3, [0.8, 0.4, 0.23])):
            rows.append({**sweep_row("mtp", slots, 0.5 + 0.01 * lookahead), "lookahead": lookahead,
                         "prediction_recall_by_lead": recall, "prediction_precision_by_lead": recall})
    results = tmp_path / "results.jsonl"
    results.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    report = write_report(results).read_text()
    assert "### Recall by lead" in report and (tmp_path / "recall_by_lead.png").is_file()
    lead_rows = [line for line in report.splitlines() if line.startswith("| mtp | 25% | 3 |")]
    assert len(lead_rows) == 1 and "| 80.0% | 40.0% | 23.0% | 53.0% |" in lead_rows[0]
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "results.jsonl").write_text(json.dumps(sweep_row("mtp", 10, 0.5)) + "\n")
    assert "Recall by lead" not in write_report(plain / "results.jsonl").read_text()


def test_a_sweep_over_policies_keeps_one_series_per_policy_and_half_life(tmp_path):
    from moeprefetch.report import _mark_varying_policy, _series

    rows = [{**sweep_row("mtp", slots, hit), "policy": policy, "lrfu_halflife": halflife}
            for slots in (10, 20) for policy, halflife, hit in (("lru", 8.0, 0.5), ("lrfu", 4.0, 0.6),
                                                                 ("lrfu", 8.0, 0.7))]
    series = _series(_mark_varying_policy(rows), "decode_hit_rate")
    assert series == {"mtp [lru]": [(0.25, 0.5), (0.5, 0.5)], "mtp [lrfu 4]": [(0.25, 0.6), (0.5, 0.6)],
                      "mtp [lrfu 8]": [(0.25, 0.7), (0.5, 0.7)]}
    assert set(_series(_mark_varying_policy(rows[:1] + rows[3:4]), "decode_hit_rate")) == {"mtp"}  # one policy
    results = tmp_path / "results.jsonl"
    results.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    report = write_report(results).read_text()
    assert sum(line.startswith("| mtp |") for line in report.splitlines()) == 6
