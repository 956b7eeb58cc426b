#!/usr/bin/env python
"""Markdown report with tables and PNG plots from a sweep's results.jsonl (same as `moeprefetch report`).

    python experiments/report.py experiments/results/sweep_reference/results.jsonl
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moeprefetch.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["report", *sys.argv[1:]]))
