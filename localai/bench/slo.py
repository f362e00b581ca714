"""``localai bench agents --slo``: how many coding agents one machine serves while each keeps its service level.

The shape of Artificial Analysis' AgentPerf: N agents run at once, each replaying a recorded-style trajectory (the
shared system-and-tools prompt of ``bench agents``, its own task, then turns of a reply and a tool result, with a
think time between turns drawn around a median of ~1 s), starting a little apart. At each N the p95 time to first
token over every request and the p50 output speed (tokens after the first / first to last token, per request) are
checked against their bounds; N grows until one breaks, and the largest N that kept both is the server's count.
Each server has seen the shared system prompt once before each N (as a server in use has): what it keeps of it,
and where, is what it is measured on.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from localai.bench.agents import Reply, percentile, request, system_prompt, tool_result
from localai.bench.api import GREEDY

# The counts tried in turn: every N up to 4, then growing by about a third.
LADDER = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)


@dataclass(frozen=True)
class Bounds:
    ttft_p95: float  # seconds
    speed_p50: float  # output tokens/s of one agent's request


@dataclass
class Level:
    """One N: every request's time to first token and output speed, and the requests that failed."""

    agents: int
    ttfts: list[float] = field(default_factory=list)
    speeds: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def ttft_p95(self) -> float:
        return percentile(self.ttfts, 0.95) if self.ttfts else math.inf

    def speed_p50(self) -> float:
        return statistics.median(self.speeds) if self.speeds else 0.0

    def holds(self, bounds: Bounds) -> bool:
        return not self.errors and self.ttft_p95() <= bounds.ttft_p95 and self.speed_p50() >= bounds.speed_p50

    def describe(self, bounds: Bounds) -> str:
        verdict = "holds" if self.holds(bounds) else "breaks"
        failed = f", {len(self.errors)} failed ({self.errors[0][:120]})" if self.errors else ""
        return (f"{self.agents:>3} agents: TTFT p95 {self.ttft_p95():.2f} s, output p50 {self.speed_p50():.1f} "
                f"tok/s per agent, {len(self.ttfts)} requests in {self.seconds:.0f} s{failed}: {verdict}")


@dataclass
class Capacity:
    name: str
    levels: list[Level] = field(default_factory=list)

    def agents(self, bounds: Bounds) -> int:
        """The largest N that held, below the first that broke (0: not even one agent)."""
        count = 0
        for level in self.levels:
            if not level.holds(bounds):
                break
            count = level.agents
        return count


def agent_turn(http: httpx.Client, model: str, messages: list[dict[str, str]], session: str,
               reply_tokens: int) -> Reply:
    """One streamed turn of exactly ``reply_tokens`` tokens, sampled the same way on every server."""
    reply = request(http, model, messages, session, reply_tokens, **GREEDY, ignore_eos=True)
    if not reply.text:
        raise RuntimeError("the reply had no text")
    return reply


def run_level(base_url: str, model: str, agents: int, *, turns: int, reply_tokens: int, think_median: float,
              seed: int, deadline: float = 600.0) -> Level:
    """``agents`` agents at once, each ``turns`` requests; their TTFTs, output speeds and failures."""
    level = Level(agents)
    lock = threading.Lock()
    system = system_prompt()
    stagger = random.Random(seed).uniform

    def agent(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        session = f"slo-{seed}-{agents}-{index}"
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": f"Task {index}: fix the failing test in module_{index}.py. "
                                                + tool_result(rng, 0, 40)}]
        time.sleep(stagger(0, think_median))  # agents do not all start at the same instant
        with httpx.Client(base_url=base_url.rstrip("/"), timeout=deadline) as http:
            for turn in range(turns):
                try:
                    reply = agent_turn(http, model, messages, session, reply_tokens)
                except (httpx.HTTPError, RuntimeError) as exc:
                    with lock:
                        level.errors.append(f"agent {index} turn {turn}: {type(exc).__name__}: {exc}")
                    return
                speed = reply.speed()
                with lock:
                    level.ttfts.append(reply.ttft)
                    if speed is not None:
                        level.speeds.append(speed)
                messages.append({"role": "assistant", "content": reply.text})
                messages.append({"role": "user", "content": tool_result(rng, turn + 1)})
                if turn + 1 < turns:  # thinking: log-normal around the median, as tool calls and agents vary
                    time.sleep(think_median * math.exp(rng.gauss(0, 0.5)))

    started = time.perf_counter()
    threads = [threading.Thread(target=agent, args=(index,), daemon=True) for index in range(agents)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(deadline)
    level.seconds = time.perf_counter() - started
    if any(thread.is_alive() for thread in threads):
        level.errors.append(f"agents still running after {deadline:.0f} s")
    return level


def warm(base_url: str, model: str) -> None:
    """What a server in use has already seen: the agents' shared system-and-tools prompt, once (not measured)."""
    with httpx.Client(base_url=base_url.rstrip("/"), timeout=600) as http:
        agent_turn(http, model, [{"role": "system", "content": system_prompt()},
                                 {"role": "user", "content": "Ready?"}], "slo-warm", 2)


def search(name: str, serve: Callable[[int], str], model: str, bounds: Bounds, *, max_agents: int, turns: int,
           reply_tokens: int, think_median: float, seed: int, report: Callable[[str], None]) -> Capacity:
    """Raise N along the ladder until a level breaks a bound; ``serve(N)`` gives the base URL serving N agents
    (a server restarted with N slots, or the same daemon), which sees the shared system prompt once first."""
    capacity = Capacity(name)
    for agents in [n for n in LADDER if n <= max_agents]:
        base_url = serve(agents)
        warm(base_url, model)
        level = run_level(base_url, model, agents, turns=turns, reply_tokens=reply_tokens,
                          think_median=think_median, seed=seed)
        capacity.levels.append(level)
        report(f"{name}: {level.describe(bounds)}")
        if not level.holds(bounds):
            break
    return capacity


def servers_at_service_level(model: str, source: str | None, bounds: Bounds, *, max_agents: int, turns: int,
                             reply_tokens: int, think_median: float, seed: int, llama_server_path: str | None,
                             with_llama_cpp_python: bool, echo: Callable[[str], None]) -> None:
    """``bench agents --slo``: each server's largest number of agents at once within the bounds, one server
    holding the model at a time; ``echo`` hears each level as it is measured, then the counts."""
    import tempfile

    from localai.bench.servers import LlamaCppPythonServer, ManagedDaemon
    from localai.settings import Settings

    settings = Settings()
    echo(f"bounds: TTFT p95 <= {bounds.ttft_p95:g} s, output p50 >= {bounds.speed_p50:g} tok/s per agent; "
         f"{turns} turns of {reply_tokens} tokens, thinking ~{think_median:g} s (median) between them; "
         f"{settings.threads()} threads")
    options: dict[str, Any] = {"max_agents": max_agents, "turns": turns, "reply_tokens": reply_tokens,
                               "think_median": think_median, "seed": seed, "report": echo}
    results = []
    with tempfile.TemporaryDirectory(prefix="localai-bench-slo-") as scratch:
        daemon = ManagedDaemon(scratch + "/home", source)
        with daemon:
            daemon.warm_up(model)
            model_path = daemon.model_path(model)
            results.append(search(f"localai ({settings.num_parallel} sequences)", lambda _: daemon.base_url,
                                  model, bounds, **options))
        if llama_server_path:
            results.append(llama_server_capacity(llama_server_path, model_path, settings.threads(), model, bounds,
                                                 options))
        if with_llama_cpp_python:
            with LlamaCppPythonServer(model_path, 8192) as reference:
                reference.warm_up()
                results.append(search("llama-cpp-python server", lambda _: reference.base_url, model, bounds,
                                      **options))
    for line in capacity_report(results, bounds):
        echo(line)


def llama_server_capacity(binary: str, model_path: str, threads: int, model: str, bounds: Bounds,
                          options: dict[str, Any]) -> Capacity:
    """llama-server's capacity, restarted with N slots for N agents."""
    from localai.bench.servers import LlamaServer

    held: list[LlamaServer] = []

    def with_slots(agents: int) -> str:
        for server in held:
            server.__exit__()
        held[:] = [LlamaServer(binary, model_path, 4096, threads=threads, parallel=agents)]
        held[0].start()
        held[0].warm_up()
        return held[0].base_url

    try:
        return search("llama-server -np N", with_slots, model, bounds, **options)
    finally:
        for server in held:
            server.__exit__()


def capacity_report(results: list[Capacity], bounds: Bounds) -> list[str]:
    """Each server's count, then localai's against each other's (the first result is localai's)."""
    counts = {result.name: result.agents(bounds) for result in results}
    lines = [f"{name}: {count} agents at once within the bounds" for name, count in counts.items()]
    ours = counts[results[0].name]
    for name, count in list(counts.items())[1:]:
        ratio = f"{ours / count:.2f}x" if count else "more (it served none)"
        lines.append(f"localai vs {name}: {ratio} the agents")
    return lines
