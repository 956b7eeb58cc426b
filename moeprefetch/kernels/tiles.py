"""The expert kernels' tile choices, as data: `tiles.json` beside this module holds each choice with what it was
measured against and where that measurement lives (the sweeps of `scripts/bench_kernels.py` on the GPU). The
choices are read once, into frozen dataclasses; a choice's block sizes fix each dot product's reduction order, so
they are per engine and format, never chosen per step or from the data (a launch setting that leaves the order
alone, such as DOT_WIDE_TILES' pipeline stages, may follow the step's row tile)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("tiles.json")


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch shape of the routed-expert kernels (`experts.py`). Fixed per engine, so a row's bits
    never depend on what else is computed; `block_k` sets the order of each dot product's reduction."""

    block_i: int = 64  # gate/up rows (intermediate features) per program
    block_h: int = 64  # down rows (hidden features) per program
    block_k: int = 128  # reduction step
    num_warps: int = 4
    num_stages: int = 3
    # tl.dot path: multiply weights [B, K] by rows^T [K, N_PAD] (the weight tile as the MMA's M side, which Hopper's
    # warp-group MMA wants at >= 64) instead of rows [N_PAD, K] by weights^T; the CUDA-core path ignores it
    weights_first: bool = False


@dataclass(frozen=True)
class GroupedTiles:
    """Launch shape of prefill's grouped kernels (`grouped.py`); `block_m` also cuts the pairs into blocks."""

    block_m: int = 64  # pairs per block
    block_n: int = 64  # output features per program
    block_k: int = 64  # reduction step
    num_warps: int = 4
    num_stages: int = 3


def _choice(cls, entry: dict, name: str):
    """One table entry's `tiles` as `cls`, every field named and no other (a typo must not fall back silently)."""
    given = entry["tiles"]
    expected = {f.name for f in fields(cls)}
    if set(given) != expected:
        raise ValueError(f"{TABLE_PATH.name}: {name} names {sorted(given)}, expected {sorted(expected)}")
    return cls(**given)


def load_table(path: Path = TABLE_PATH) -> dict:
    """The table as dataclasses: {"dot", "dot_wide", "gemv", "gemv_8bit", "gemv_int4": Tiles; "grouped_short",
    "grouped_short_int4", "grouped_long": GroupedTiles; "long_from_pairs_per_expert": int}."""
    raw = json.loads(path.read_text())
    routed, grouped = raw["routed_experts"], raw["grouped_experts"]
    table = {name: _choice(Tiles, routed[name], name) for name in ("dot", "dot_wide", "gemv", "gemv_8bit",
                                                                    "gemv_int4")}
    table.update({f"grouped_{name}": _choice(GroupedTiles, grouped[name], name)
                  for name in ("short", "short_int4", "long")})
    table["long_from_pairs_per_expert"] = int(grouped["long_from_pairs_per_expert"])
    return table


_TABLE = load_table()  # read once at import; constants from here on
DOT_TILES: Tiles = _TABLE["dot"]  # steps of more than GEMV_MAX_ROWS rows (tl.dot), up to 16-row tiles
DOT_WIDE_TILES: Tiles = _TABLE["dot_wide"]  # tl.dot steps with tiles of more than 16 rows
GEMV_TILES: Tiles = _TABLE["gemv"]  # steps of up to GEMV_MAX_ROWS rows, on the CUDA cores
EIGHT_BIT_GEMV_TILES: Tiles = _TABLE["gemv_8bit"]  # the same with FP8 or int8 records
INT4_GEMV_TILES: Tiles = _TABLE["gemv_int4"]  # the same with 4-bit records
SHORT_BLOCK_TILES: GroupedTiles = _TABLE["grouped_short"]
SHORT_BLOCK_INT4_TILES: GroupedTiles = _TABLE["grouped_short_int4"]  # the same with 4-bit records
LONG_BLOCK_TILES: GroupedTiles = _TABLE["grouped_long"]
LONG_BLOCK_PAIRS: int = _TABLE["long_from_pairs_per_expert"]  # pairs per expert from which LONG_BLOCK_TILES run
