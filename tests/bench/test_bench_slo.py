"""``localai bench agents --slo``: the capacity search's rules, real agents against a real daemon (smollm2), a
server that is not there, and the command's refusals; and the benchmarks' client against a server that closed a
kept-alive connection."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx
import pytest

from localai.bench import slo
from localai.bench.api import sse_events
from localai.bench.slo import Bounds, Capacity, Level
from tests.conftest import free_port

LOOSE = Bounds(ttft_p95=600.0, speed_p50=0.1)


def level(agents: int, ttfts: list[float], speeds: list[float], errors: list[str] | None = None) -> Level:
    return Level(agents, ttfts, speeds, errors or [])


def test_the_count_is_the_last_level_before_the_first_that_breaks() -> None:
    bounds = Bounds(ttft_p95=2.0, speed_p50=10.0)
    capacity = Capacity("x", [level(1, [0.5] * 20, [30.0]), level(2, [0.5] * 19 + [9.0], [20.0]),
                              level(3, [0.5] * 10 + [2.5] * 10, [20.0]), level(4, [0.5], [50.0])])
    # level 2: one slow request in 20 is the p95's 5%, within it; level 3 breaks the TTFT bound; 4 is never reached
    assert [item.holds(bounds) for item in capacity.levels] == [True, True, False, True]
    assert capacity.agents(bounds) == 2
    assert not level(1, [0.1], [5.0]).holds(bounds)  # too slow an output
    assert not level(1, [0.1], [50.0], ["agent 0 turn 0: RuntimeError"]).holds(bounds)  # a failed request
    assert not level(1, [], []).holds(bounds)  # nothing measured is not a pass
    assert Capacity("none", [level(1, [9.0], [50.0])]).agents(bounds) == 0


def test_agents_against_a_real_daemon(fresh_daemon: Any) -> None:
    """Two levels of real agents on smollm2: every turn of every agent is measured; the session's later turns
    reuse what the daemon keeps (a loose bound holds, an impossible one breaks at once)."""
    lines: list[str] = []
    base_url = fresh_daemon.base_url + "/v1"
    options: dict[str, Any] = {"max_agents": 2, "turns": 2, "reply_tokens": 8, "think_median": 0.2, "seed": 3,
                               "report": lines.append}
    capacity = slo.search("localai", lambda _: base_url, "smollm2", LOOSE, **options)
    assert [item.agents for item in capacity.levels] == [1, 2]
    assert [len(item.ttfts) for item in capacity.levels] == [2, 4] and all(item.speeds for item in capacity.levels)
    assert capacity.agents(LOOSE) == 2 and "2 agents" in lines[-1] and lines[-1].endswith("holds")
    strict = Bounds(ttft_p95=600.0, speed_p50=1e6)
    broken = slo.search("localai", lambda _: base_url, "smollm2", strict, **options)
    assert len(broken.levels) == 1 and broken.agents(strict) == 0  # the search stops at the first break


def test_a_server_that_is_not_there_breaks_the_level_with_its_reason() -> None:
    capacity = Capacity("gone")
    capacity.levels.append(slo.run_level(f"http://127.0.0.1:{free_port()}/v1", "m", 2, turns=2, reply_tokens=4,
                                         think_median=0.01, seed=1, deadline=60))
    only = capacity.levels[0]
    assert not only.holds(LOOSE) and len(only.errors) == 2 and "ConnectError" in only.errors[0]
    assert "2 failed" in only.describe(LOOSE) and capacity.agents(LOOSE) == 0


def test_the_command_refuses_too_few_turns() -> None:
    result = subprocess.run([sys.executable, "-m", "localai", "bench", "agents", "--slo", "--turns", "1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "--turns" in result.stderr and "Traceback" not in result.stderr


def test_a_connection_the_server_closed_before_reuse_is_asked_again_once() -> None:
    """llama-server closes idle kept-alive connections; a request that meets one got no answer, so the benchmarks'
    client asks once more (a second failure is the server's, and raised)."""
    calls: list[int] = []

    def server(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) % 2:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        return httpx.Response(200, content=b'data: {"choices": [{"text": "hi"}]}\n\ndata: [DONE]\n\n')

    with httpx.Client(transport=httpx.MockTransport(server), base_url="http://anchor.test/v1") as http:
        assert list(sse_events(http, "/completions", {})) == [{"choices": [{"text": "hi"}]}]
        assert len(calls) == 2

    def always(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)

    with (httpx.Client(transport=httpx.MockTransport(always), base_url="http://anchor.test/v1") as http,
          pytest.raises(httpx.RemoteProtocolError)):
        list(sse_events(http, "/completions", {}))
