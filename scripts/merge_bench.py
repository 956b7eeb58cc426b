#!/usr/bin/env python
"""Add one device call's bench rows to experiments/results/bench_h200.json under a tag: each row's workload
becomes `<workload>#<tag>`, and the call's environment and link go in as `environment_<tag>` / `link_<tag>`.

    python scripts/merge_bench.py CALL_OUT/bench_int4.json int4_groups@<commit>
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "experiments" / "results" / "bench_h200.json"


def merge(source: Path, tag: str, target: Path = RESULTS) -> int:
    """Rows added; a tag already present is refused (rows of one call are never mixed with another's)."""
    call = json.loads(source.read_text())
    book = json.loads(target.read_text())
    if f"environment_{tag}" in book:
        raise SystemExit(f"{target} already holds tag {tag!r}")
    rows = [dict(row, workload=f"{row['workload']}#{tag}") for row in call["rows"]]
    book["rows"].extend(rows)
    book[f"environment_{tag}"] = call.get("environment")
    book[f"link_{tag}"] = call.get("link")
    target.write_text(json.dumps(book, indent=1))
    return len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path)
    parser.add_argument("tag")
    ns = parser.parse_args()
    print(f"added {merge(ns.source, ns.tag)} rows under #{ns.tag}")


if __name__ == "__main__":
    main()
