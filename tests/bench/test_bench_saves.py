"""``localai bench saves`` on the real model, small: every size gets its saves, each save stored its new blocks."""

from __future__ import annotations

from pathlib import Path

from localai.bench.saves import measure, table


def test_save_costs_are_measured_at_each_size(smollm2_path: Path) -> None:
    costs = measure(str(smollm2_path), [256, 512], new=64, samples=2)
    assert [cost.context for cost in costs] == [256, 512]
    assert all(len(cost.state_ms) == 2 and len(cost.carve_ms) == 2 for cost in costs)
    assert costs[1].state_bytes > costs[0].state_bytes > 0  # the state grows with the context
    shown = table("smollm2", costs)
    assert "held" in shown and shown.count("\n") == 3
