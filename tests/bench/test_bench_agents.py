"""``localai bench agents`` run for real (a short trace on smollm2), and its arithmetic."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from localai.bench.agents import Sample, TraceResult, system_prompt, token_counter


def test_hit_ceiling_leaves_out_only_the_new_messages_text() -> None:
    result = TraceResult("x", [
        Sample(0, 0, 0.1, 1000, 0, new_tokens=900),  # the first request is not counted
        Sample(0, 1, 0.1, 1120, 1100, new_tokens=100),
        Sample(1, 0, 0.1, 1000, 990, new_tokens=900),
        Sample(1, 1, 0.1, 1010, 1000, new_tokens=5),
    ])
    assert result.hit_ceiling() == (1120 + 1010 - 105) / (1120 + 1010)
    assert result.hit_ratio() == (1100 + 1000) / (1120 + 1010)
    assert TraceResult("uncounted", [Sample(0, 0, 0.1, 10, 0), Sample(0, 1, 0.1, 20, 10)]).hit_ceiling() is None


def test_token_counter_uses_the_models_tokenizer(smollm2_path: Path) -> None:
    count = token_counter(str(smollm2_path))
    assert count is not None and count("hello world") == 2 and count("") == 0
    # the trace's system prompt: ~1,100 tokens, N times that with --system-repeats (5: an agent's size)
    one, five = count(system_prompt()), count(system_prompt(5))
    assert 900 < one < 1400 and 5 * one <= five <= 5 * one + 10
    assert token_counter(str(smollm2_path.parent / "missing.gguf")) is None


def test_bench_agents_short_trace_with_restart_long_session_and_subagents(smollm2_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "localai", "bench", "agents", "--sessions", "2", "--turns", "3", "--restart-at", "2",
         "--reply-tokens", "4", "--long-turns", "3", "--subagents", "2"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for name in ("localai", "localai+restart"):
        hit = re.search(rf"^{re.escape(name)}: median TTFT turns 1-2 [\d.]+ s; .*hit ratio after first request "
                        r"([\d.]+)% \(ceiling ([\d.]+)%", out, re.MULTILINE)
        assert hit, out
        ratio, ceiling = float(hit.group(1)), float(hit.group(2))
        assert 80 < ratio <= ceiling < 100, out  # later turns reuse the earlier prompt, never more than was seen
    assert re.search(r"^disk writes, turns 1-2: [\d.]+ MB for \d+ new tokens x \d+ KV bytes", out, re.MULTILINE), out
    assert re.search(r"^long session: 3 turns to \d+ prompt tokens", out, re.MULTILINE), out
    assert re.search(r"^sub-agents: 2 sessions sharing a [1-9]\d*-token prefix", out, re.MULTILINE), out
    # the restarted daemon's turn 2 resumed from the disk cache, not by recomputing
    restored = re.search(r"^restart: turn 2's prefixes came from ([^;]+); restored (\d+) tokens", out, re.MULTILINE)
    assert restored and restored.group(1) == "disk" and int(restored.group(2)) > 1000, out
