"""Reports: a short summary of one run, per-layer prediction tables, and the markdown + PNG report of a sweep.

Imports only `accounting` (and matplotlib, lazily): reports read results, they never run models.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from .accounting import prediction_table

GiB = 1024**3


def summary_lines(stats: dict[str, Any], memory: dict[str, Any] | None = None, device: str = "") -> list[str]:
    """A few human-readable lines about one generate call."""
    lines = [
        f"-- {stats['generated_tokens']} tokens, decode {stats['decode_tokens_per_s']:.1f} tok/s "
        f"({stats['ms_per_token']:.1f} ms/token{', ' + device if device else ''}), prefill "
        f"{stats['prefill_tokens_per_s']:.0f} tok/s",
        f"-- experts: {stats['expert_uses']} uses, hit rate {stats['hit_rate']:.1%} ({stats['misses']} misses), "
        f"{stats['bytes_h2d'] / 1e6:.1f} MB moved host->device, "
        f"{stats['cache_slots']} slots, policy {stats['policy']}",
        f"-- predictor {stats['predictor']} (lookahead {stats['lookahead']}): next-step recall "
        f"{_percent(stats.get('prediction_recall_main_layers'))}, precision "
        f"{_percent(stats.get('prediction_precision_main_layers'))} (main MoE layers); prefetches "
        f"{stats['prefetch_issued']} issued, {stats['prefetch_useful']} in time, {stats['prefetch_late']} late, "
        f"{stats['prefetch_wasted']} wasted",
        f"-- decode: {stats.get('syncs_per_token', 0):.2f} host synchronisations per token, "
        f"{stats.get('decode_bytes_h2d_per_token', 0) / 1e6:.2f} MB/token over the link "
        f"({stats.get('zero_copy_bytes_per_token', 0) / 1e6:.2f} read in place, "
        f"{stats.get('fill_bytes_per_token', 0) / 1e6:.2f} prefetched)",
    ]
    if stats.get("mtp_draft_accuracy") is not None:
        lines.append(f"-- MTP draft = next token {stats['mtp_draft_accuracy']:.1%} of the time")
    if stats.get("speculative"):
        lines.append(f"-- speculative MTP: {stats['draft_accepted']}/{stats['draft_proposed']} drafts accepted "
                     f"({stats['draft_acceptance']:.1%})")
    if memory:
        lines.append(
            f"-- memory: {memory['host_expert_bytes'] / GiB:.2f} GiB experts in host RAM "
            f"({memory['host_pinned_bytes'] / GiB:.2f} GiB page-locked), {memory['vram_expert_cache_bytes'] / GiB:.2f} "
            f"GiB expert cache, {memory['vram_resident_bytes'] / GiB:.2f} GiB resident weights"
        )
    return lines


def _percent(value: float | None) -> str:
    """A ratio as a percentage, or n/a when nothing was measured (e.g. no predictor ran)."""
    return "n/a" if value is None else f"{value:.1%}"


def markdown_table(rows: list[dict[str, Any]], columns: list[str], formats: dict[str, str] | None = None) -> str:
    formats = formats or {}
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for col in columns:
            value = row.get(col)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                cells.append("–")
            elif isinstance(value, float):
                cells.append(format(value, formats.get(col, ".3g")))
            else:
                cells.append(str(value))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def per_layer_markdown(stats: dict[str, Any]) -> str:
    """Per-layer prediction and cache table of one run (`result.stats.to_dict()`)."""
    rows = prediction_table(stats)
    return markdown_table(rows, ["layer", "expert_uses", "hit_rate", "misses", "prediction_recall",
                                 "prediction_precision", "prefetch_issued", "prefetch_useful", "prefetch_late",
                                 "prefetch_wasted"], {"hit_rate": ".1%", "prediction_recall": ".1%",
                                                      "prediction_precision": ".1%"})


# ---- sweep reports ------------------------------------------------------------------------------------------------


def load_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ReportError(f"{path} line {number} is not JSON: a sweep's results.jsonl has one row per line")
            if not isinstance(row, dict):
                raise ReportError(f"{path} line {number} is not a sweep row (a JSON object)")
            rows.append(row)
    return rows


def _conditions(rows: list[dict[str, Any]]) -> str:
    first = rows[0]
    parts = [f"model {Path(str(first.get('model', '?'))).name}", f"device {first.get('device_name', first.get('device'))}",
             f"batch {first.get('batch')}", f"{first.get('new_tokens')} new tokens",
             f"{first.get('prompt_count', '?')} held-out prompts", "warm-up excluded"]
    return ", ".join(str(p) for p in parts)


class ReportError(ValueError):
    """The results cannot make a report (not JSON, empty, or no successful point)."""


def write_report(results: Path, out: Path | None = None) -> Path:
    """Markdown report with tables and PNG plots from a sweep's results.jsonl (or one --stats-json file). Nothing is
    written (no folder either) when the results cannot make a report."""
    out = out or results.parent
    if results.suffix == ".json":
        try:
            data = json.loads(results.read_text())
            stats = data.get("stats", data)
            summary_lines(stats, data.get("memory"))
        except (json.JSONDecodeError, AttributeError, KeyError, TypeError) as exc:
            raise ReportError(f"{results} is not a stats JSON written by generate --stats-json ({exc})") from None
        out.mkdir(parents=True, exist_ok=True)
        text = "# moeprefetch run\n\n" + "\n".join(summary_lines(stats, data.get("memory"))) + "\n\n"
        text += "## Per layer\n\n" + per_layer_markdown(stats) + "\n"
        path = out / "report.md"
        path.write_text(text)
        return path
    rows = load_rows(results)
    ok = [r for r in rows if r.get("status") == "ok"]
    failed = [r for r in rows if r.get("status") != "ok"]
    if not ok:
        raise ReportError(f"{results} holds no successful sweep points")
    out.mkdir(parents=True, exist_ok=True)
    conditions = _conditions(ok)
    ok = _mark_varying_policy(ok)
    text = [f"# Sweep report: `{results.name}`", "", f"Conditions: {conditions}.", ""]
    text += _summary_section(ok)
    text += _figures(ok, out, conditions)
    text += _per_layer_section(ok)
    if failed:
        text += ["## Failed points", "", markdown_table(
            [{**r.get("config", r), "error": r.get("error", "")} for r in failed],
            ["predictor", "cache_slots", "lookahead", "policy", "error"]), ""]
    path = out / "report.md"
    path.write_text("\n".join(text) + "\n")
    return path


def _summary_section(rows: list[dict[str, Any]]) -> list[str]:
    columns = ["predictor", "lookahead", "min_confidence", "policy", "lrfu_halflife", "cache_slots", "cache_fraction",
               "decode_hit_rate", "prediction_recall_main_layers", "prediction_precision_main_layers",
               "misses_per_token", "mb_per_token", "prefetch_waste", "decode_tokens_per_s"]
    table_rows = sorted((_derived(r) for r in rows),
                        key=lambda r: (r["cache_slots"], r["predictor"], r["lookahead"], r.get("min_confidence") or 0,
                                       str(r.get("policy")), r.get("lrfu_halflife") or 0))
    return ["## All points", "", markdown_table(table_rows, columns, {
        "hit_rate": ".1%", "decode_hit_rate": ".1%", "prediction_recall": ".1%", "prediction_precision": ".1%",
        "cache_fraction": ".0%", "prediction_recall_main_layers": ".1%", "prediction_precision_main_layers": ".1%",
        "mb_per_token": ".2f", "prefetch_waste": ".1%", "decode_tokens_per_s": ".1f", "misses_per_token": ".2f"}),
        ""]


def _derived(row: dict[str, Any]) -> dict[str, Any]:
    """The decode figures a row's statistics already hold (`Stats.to_dict`), under the report's column names; rows
    written before those fields existed fall back to whole-call counts per generated token."""
    tokens = max(row.get("generated_tokens", 0) - row.get("batch", 1) * row.get("prompt_count", 1), 1)
    return {
        "prediction_recall_main_layers": row.get("prediction_recall"),
        "prediction_precision_main_layers": row.get("prediction_precision"),
        "decode_hit_rate": row.get("hit_rate"),
        **row,
        "misses_per_token": row.get("decode_misses_per_token", row.get("misses", 0) / tokens),
        "mb_per_token": row.get("decode_bytes_h2d_per_token", row.get("bytes_h2d", 0) / tokens) / 1e6,
    }


def _mark_varying_policy(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A sweep over cache policies (or LRFU half-lives) labels its series by them; otherwise their points would be
    averaged into one line."""
    varies = {"_label_policy": len({r.get("policy") for r in rows}) > 1,
              "_label_halflife": len({r.get("lrfu_halflife") for r in rows if r.get("policy") == "lrfu"}) > 1}
    return [{**r, **varies} for r in rows] if any(varies.values()) else rows


def _label(row: dict[str, Any]) -> str:
    """predictor, with its lookahead and confidence cut when they are not the defaults, and the cache policy (with
    LRFU's half-life) when the sweep varies it."""
    label = row["predictor"] + (f" (la {row['lookahead']})" if row.get("lookahead", 1) != 1 else "")
    label += f" @{row['min_confidence']:g}" if row.get("min_confidence") else ""
    if row.get("_label_policy") or row.get("_label_halflife"):
        halflife = f" {row.get('lrfu_halflife'):g}" if row.get("_label_halflife") and row["policy"] == "lrfu" else ""
        label += f" [{row['policy']}{halflife}]"
    return label


def _series(rows: Iterable[dict[str, Any]], key: str) -> dict[str, list[tuple[float, float]]]:
    """predictor (and lookahead) -> sorted (cache_fraction, value) points, averaging duplicates."""
    groups: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        label = _label(row)
        if row.get(key) is not None:  # a figure that was not measured (no predictor ran) is not plotted as 0
            groups[label][row["cache_fraction"]].append(row[key])
    return {label: sorted((x, sum(v) / len(v)) for x, v in points.items())
            for label, points in groups.items() if points}


def _figures(rows: list[dict[str, Any]], out: Path, conditions: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    derived = [_derived(r) for r in rows]
    plots = [
        ("decode_hit_rate", "decode hit rate", "hit_rate_vs_cache.png"),
        ("mb_per_token", "MB moved host->device per decode token", "bytes_vs_cache.png"),
        ("prefetch_waste", "share of prefetches wasted", "waste_vs_cache.png"),
        ("prediction_recall_main_layers", "next-step recall, main MoE layers", "recall_vs_cache.png"),
    ]
    if any(r.get("device", "cpu").startswith("cuda") for r in rows):
        plots.append(("decode_tokens_per_s", "decode tokens/s", "tokens_per_s_vs_cache.png"))
    text = ["## Figures", ""]
    for key, label, name in plots:
        fig, ax = plt.subplots(figsize=(8.5, 4.2))
        colours = plt.get_cmap("tab20").colors
        for index, (series, points) in enumerate(sorted(_series(derived, key).items())):
            xs, ys = zip(*points)
            style = dict(color=colours[(2 * index) % 20 + (index // 10) % 2], linewidth=1.5)
            if series.startswith("oracle"):  # the bound any predictor can reach
                style = dict(color="black", linestyle="--" if series == "oracle" else ":", linewidth=2)
            ax.plot([100 * x for x in xs], ys, marker="o", label=series, **style)
        ax.set_xlabel("experts cached (% of all routed experts)")
        ax.set_ylabel(label)
        ax.set_title(f"{label} vs cache size", fontsize=11)
        fig.text(0.01, 0.01, conditions, fontsize=6.5, color="0.35")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        text += [f"![{label}]({name})", ""]
    text += _lead_figure(rows, out, conditions, plt)
    text += _per_layer_figure(rows, out, conditions, plt)
    return text


def _lead_figure(rows: list[dict[str, Any]], out: Path, conditions: str, plt) -> list[str]:
    """Recall against lead (the steps between a prediction and the step it targets), from each predictor's longest
    lookahead at each cache size, and decode hit rate against lookahead."""
    chained = [r for r in rows if len(r.get("prediction_recall_by_lead") or []) > 1]
    if not chained:
        return []
    longest: dict[tuple[str, float], dict[str, Any]] = {}
    for row in chained:
        key = (row["predictor"] + (f" @{row['min_confidence']:g}" if row.get("min_confidence") else ""),
               row["cache_fraction"])
        if key not in longest or row["lookahead"] > longest[key]["lookahead"]:
            longest[key] = row
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (label, fraction), row in sorted(longest.items()):
        recall = row["prediction_recall_by_lead"]
        leads = [i + 1 for i, r in enumerate(recall) if r is not None]
        left.plot(leads, [r for r in recall if r is not None], marker="o", label=f"{label}, {100 * fraction:.0f} %")
        points = sorted((r["lookahead"], _derived(r)["decode_hit_rate"]) for r in rows
                        if r["predictor"] == row["predictor"] and r["cache_fraction"] == fraction
                        and (r.get("min_confidence") or 0) == (row.get("min_confidence") or 0))
        right.plot(*zip(*points), marker="o", label=f"{label}, {100 * fraction:.0f} %")
    left.set(xlabel="lead (decode steps before the target step)", ylabel="recall, main MoE layers",
             title="recall against lead")
    right.set(xlabel="lookahead", ylabel="decode hit rate", title="hit rate against lookahead")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.text(0.01, 0.01, conditions, fontsize=6.5, color="0.35")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out / "recall_by_lead.png", dpi=110)
    plt.close(fig)
    table = [{"predictor": label, "cache_fraction": fraction, "lookahead": row["lookahead"],
              **{f"recall_lead_{i + 1}": r for i, r in enumerate(row["prediction_recall_by_lead"])},
              "decode_hit_rate": _derived(row)["decode_hit_rate"]} for (label, fraction), row in sorted(longest.items())]
    leads = max(len(row["prediction_recall_by_lead"]) for row in longest.values())
    columns = ["predictor", "cache_fraction", "lookahead"] + [f"recall_lead_{i + 1}" for i in range(leads)] + [
        "decode_hit_rate"]
    formats = {"cache_fraction": ".0%", "decode_hit_rate": ".1%", **{f"recall_lead_{i + 1}": ".1%" for i in range(leads)}}
    return ["### Recall by lead", "", markdown_table(table, columns, formats), "",
            "![recall against lead, hit rate against lookahead](recall_by_lead.png)", ""]


def _per_layer_figure(rows: list[dict[str, Any]], out: Path, conditions: str, plt) -> list[str]:
    """Recall and precision per layer for each predictor, at the smallest cache size swept."""
    smallest = min(r["cache_fraction"] for r in rows)
    chosen = [r for r in rows if r["cache_fraction"] == smallest and r.get("per_layer") and r["predictor"] != "none"]
    if not chosen:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for row in sorted(chosen, key=lambda r: (r["predictor"], r.get("lookahead", 1))):
        layers = sorted(row["per_layer"], key=int)
        label = _label(row)
        for ax, key in zip(axes, ("prediction_recall", "prediction_precision")):
            values = [row["per_layer"][l][key] for l in layers]
            ax.plot([int(l) for l, v in zip(layers, values) if v is not None], [v for v in values if v is not None],
                    marker="o", label=label)
    layer_ids = sorted({int(layer) for row in chosen for layer in row["per_layer"]})
    for ax, title in zip(axes, ("recall per layer", "precision per layer")):
        ax.set_title(f"{title} ({smallest:.0%} cached)", fontsize=11)
        ax.set_xlabel("MoE layer (the last is the MTP head's own layer, which no predictor targets)")
        ax.set_xticks(layer_ids)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.text(0.01, 0.01, conditions, fontsize=6.5, color="0.35")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(out / "recall_precision_per_layer.png", dpi=110)
    plt.close(fig)
    return ["![recall and precision per layer](recall_precision_per_layer.png)", ""]


def _per_layer_section(rows: list[dict[str, Any]]) -> list[str]:
    smallest = min(r["cache_fraction"] for r in rows)
    text = [f"## Per layer, {smallest:.0%} of experts cached", ""]
    for row in sorted(rows, key=lambda r: (r["predictor"], r.get("lookahead", 1), r.get("min_confidence") or 0)):
        if row["cache_fraction"] != smallest or not row.get("per_layer"):
            continue
        text += [f"### {_label(row)} (lookahead {row.get('lookahead', 1)}, {row['policy']})", "",
                 per_layer_markdown(row), ""]
    return text
