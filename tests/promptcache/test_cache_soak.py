"""A short seeded run of the prompt store's concurrency soak (tests/api/stress/cachesoak.py; `make stress` runs it for
minutes): a store on a folder with its writer thread, saves, forks, restores, quota, pins, rm, prune and listings
interleaved, with no invariant broken."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.api.stress.cachesoak import soak


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_seeded_schedule_breaks_no_invariant(tmp_path: Path, seed: int) -> None:
    """Serial: each step's writes land before the next step, so a seed replays exactly (the racing schedule runs
    in `make stress`, where it still finds a rare entry written over a block deleted under it: see issue 29)."""
    figures = soak(tmp_path, seed=seed, steps=250, serial=True)
    assert not figures.violations, "\n".join(figures.violations[:20])
    assert figures.saves and figures.restores and figures.evictions and figures.removals and figures.listings
    assert figures.restarts and figures.dropped_writes and figures.lowest_queued == 0 and figures.orphans == 0
