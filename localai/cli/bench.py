"""``localai bench``: prefill and decode speed through the API (beside llama-bench when given)."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

import click

from localai.cli import cli, fail_cleanly

if TYPE_CHECKING:
    from localai.bench.agents import Sample
    from localai.bench.slo import Bounds


@cli.group(invoke_without_command=True)
@click.option("--model", "-m", default="smollm2", show_default=True)
@click.option("--base-url", default=None,
              help="Any OpenAI-compatible /v1 URL; by default the local daemon (started if needed).")
@click.option("--prompt-tokens", "-p", default=512, show_default=True)
@click.option("--gen-tokens", "-n", default=128, show_default=True)
@click.option("--repetitions", "-r", default=3, show_default=True)
@click.option("--llama-bench", "llama_bench_path", default=None,
              help="Path to llama.cpp's llama-bench: run it on the same model file, interleaved, for comparison.")
@click.option("--mlx-lm", "with_mlx_lm", is_flag=True,
              help="For an MLX model: run mlx-lm's own generation in-process on the same folder, interleaved.")
@click.option("--threads", "-t", default=None, type=int,
              help="Threads for llama-bench and llama-server (default: LOCALAI_NUM_THREAD or all).")
@click.option("--llama-server", "llama_server_path", default=None, metavar="PATH",
              help="Path to llama.cpp's llama-server (`make llama-server`): start it on the same GGUF and threads and "
                   "measure it through its API the same way, interleaved.")
@click.option("--streams", default=4, show_default=True,
              help="Concurrent decodes for the streams measurement (0: none); llama-server gets as many slots.")
@click.option("--edit", "edit_tokens", default=0, show_default=True, metavar="TOKENS",
              help="Also the edit workload (a file in the prompt, 'rewrite it with one change') up to TOKENS tokens: "
                   "localai with speculative decoding off and on, the anchor as started.")
@click.option("--depth", default=0, show_default=True, metavar="TOKENS",
              help="Measure prefill and decode after about TOKENS tokens of context (kept by each server).")
@click.option("--llama-server-arg", "llama_server_args", multiple=True, metavar="ARG",
              help="An extra argument for llama-server (repeatable), e.g. --llama-server-arg=--spec-type "
                   "--llama-server-arg=ngram-mod.")
@click.pass_context
@fail_cleanly
def bench(ctx: click.Context, model: str, base_url: str | None, prompt_tokens: int, gen_tokens: int,
          repetitions: int, llama_bench_path: str | None, with_mlx_lm: bool, threads: int | None,
          llama_server_path: str | None, streams: int, edit_tokens: int, depth: int,
          llama_server_args: tuple[str, ...]) -> None:
    """Measure prefill (pp), decode (tg), concurrent streams and an edit workload through the API."""
    if ctx.invoked_subcommand is not None:
        return
    import httpx

    from localai import paths
    from localai.bench import api as measure
    from localai.bench.servers import LlamaServer
    from localai.client import Client
    from localai.settings import Settings

    if base_url is None:
        client = Client()
        client.ensure_running()
        http = httpx.Client(transport=httpx.HTTPTransport(uds=str(paths.socket_path())),
                            base_url="http://localhost/v1", timeout=600)
        model_path = client.request("POST", "/api/show", {"model": model})["path"]
    else:
        http = httpx.Client(base_url=base_url.rstrip("/"), timeout=600)
        model_path = None
    threads = threads or Settings().threads()
    ours, theirs = measure.SpeedResult(), measure.SpeedResult()
    our_streams, their_streams = measure.StreamsResult(), measure.StreamsResult()
    our_edit, our_edit_spec, their_edit = measure.EditResult(), measure.EditResult(), measure.EditResult()
    server = None
    if llama_server_path and model_path:
        server = LlamaServer(llama_server_path, model_path, max(4096, depth + prompt_tokens + gen_tokens + 512),
                             threads=threads, parallel=max(1, streams),
                             extra=llama_server_args)
    # With llama-server, only one of the two holds the model at a time: localai's is unloaded while llama-server
    # runs, and llama-server is stopped while localai runs (two resident servers' threads contend on a small CPU:
    # one run with both up saw a decode at 0.7 tok/s and a 1.7 s inter-token p99 that neither shows alone)
    with http:
        anchor_http = httpx.Client(base_url=server.base_url, timeout=600) if server else None
        words = measure.calibrate_words(http, model, prompt_tokens)  # also loads the model
        measure.warm_up(http, model, words)
        depth_words = round(words * depth / prompt_tokens) if depth else 0
        for index in range(repetitions):
            if index and server is not None:
                measure.warm_up(http, model, words)  # loads it again, outside the measurement
            measure.measure_once(http, model, words, gen_tokens, ours, depth_words)
            if streams > 1:
                measure.measure_streams(http, model, streams, gen_tokens, our_streams)
            if edit_tokens:
                measure.measure_edit(http, model, edit_tokens, our_edit, "off")
                measure.measure_edit(http, model, edit_tokens, our_edit_spec, "on")
            if server is not None and anchor_http is not None:
                client.request("POST", "/api/generate", {"model": model, "keep_alive": 0})  # unload
                server.start()
                try:
                    measure.warm_up(anchor_http, model, words)  # the same way
                    measure.measure_once(anchor_http, model, words, gen_tokens, theirs, depth_words)
                    if streams > 1:
                        measure.measure_streams(anchor_http, model, streams, gen_tokens, their_streams)
                    if edit_tokens:
                        measure.measure_edit(anchor_http, model, edit_tokens, their_edit)
                except httpx.HTTPError as exc:
                    failure = _anchor_died(server, exc)
                    server.__exit__()
                    if failure is exc:
                        raise
                    raise failure from exc
                finally:
                    server.stop()
            elif llama_bench_path and model_path:
                pp, tg = measure.llama_bench(llama_bench_path, model_path, threads, prompt_tokens, gen_tokens,
                                             ours.depth[-1])
                theirs.prefill.append(pp)
                theirs.decode.append(tg)
            elif with_mlx_lm and model_path:
                pp, tg = measure.mlx_lm_reference(model_path, ours.prompt_tokens[-1], gen_tokens)
                theirs.prefill.append(pp)
                theirs.decode.append(tg)
            click.echo(f"  run {index + 1}/{repetitions}: pp {ours.prefill[-1]:.1f} tok/s, "
                       f"tg {ours.decode[-1] if ours.decode else 0:.1f} tok/s", err=True)
        if anchor_http is not None:
            anchor_http.close()
        if server is not None:
            server.__exit__()
    anchor = "llama-server" if server else "llama-bench" if llama_bench_path else "mlx-lm" if with_mlx_lm else ""
    click.echo(f"model {model}  threads {threads}  prompt {ours.prompt_tokens[-1]} tokens  output {gen_tokens} tokens"
               + (f"  after {ours.depth[-1]} tokens of context" if depth else "")
               + f"  repetitions {repetitions} (median, min-max)")
    columns = [("prefill (pp) tok/s", ours.prefill, theirs.prefill), ("decode (tg) tok/s", ours.decode, theirs.decode)]
    if streams > 1:
        columns.append((f"{streams} streams, tok/s in all", our_streams.aggregate, their_streams.aggregate))
    if edit_tokens:
        columns.append(("edit: decode tok/s", our_edit.decode, their_edit.decode))
        columns.append(("edit, speculative on", our_edit_spec.decode, their_edit.decode))
    click.echo(f"{'':24}" + "".join(f"{title:<34}" for title, _, _ in columns))
    click.echo(f"{'localai (API)':<24}" + "".join(f"{measure.summary(mine):<34}" for _, mine, _ in columns))
    if anchor and theirs.prefill:
        click.echo(f"{anchor:<24}" + "".join(f"{measure.summary(other):<34}" for _, _, other in columns))
        click.echo(f"{'localai / ' + anchor:<24}"
                   + "".join(f"{measure.percent(mine, other):<34}" for _, mine, other in columns))
    for name, result in (("localai", our_streams), (anchor, their_streams)):
        if result.gaps:
            click.echo(f"{name}: {streams} streams, inter-token latency p50 "
                       f"{1000 * measure.quantile(result.gaps, 0.5):.1f} ms, p99 "
                       f"{1000 * measure.quantile(result.gaps, 0.99):.1f} ms")
    for name, edit in (("localai", our_edit), ("localai, speculative on", our_edit_spec), (anchor, their_edit)):
        if edit.tokens:
            kept = f"; guessed {edit.drafted}, kept {edit.kept} ({100 * edit.kept / edit.drafted:.0f}%)" \
                if edit.drafted else ""
            click.echo(f"{name}: edit answer {edit.tokens[-1]} tokens, "
                       f"{'the function renamed' if 'read_header' in edit.text else 'no rename in it'}{kept}")
    if our_edit.text and our_edit_spec.text:
        click.echo(f"edit answers with speculative decoding on and off the same: {our_edit.text == our_edit_spec.text}")


def _anchor_died(server: Any, exc: Exception) -> Exception:
    """An HTTP error from an anchor server that has exited: its own last words, not a traceback."""
    from localai.errors import DaemonUnavailable

    if server.process is None or server.process.poll() is None:
        return exc
    last = (server.stderr().strip().splitlines() or [""])[-1]
    return DaemonUnavailable(f"llama-server exited (code {server.process.returncode}) during the benchmark: {last}")


@bench.command("agents")
@click.option("--model", "-m", default="smollm2", show_default=True)
@click.option("--sessions", default=3, show_default=True)
@click.option("--turns", default=6, show_default=True)
@click.option("--reply-tokens", default=12, show_default=True)
@click.option("--think-time", default=0.0, show_default=True, help="Seconds between requests (tool-call delay).")
@click.option("--restart-at", default=3, show_default=True, help="Turn before which the restart variant restarts.")
@click.option("--llama-cpp-python", "with_llama_cpp_python", is_flag=True,
              help="Also run the trace against `python -m llama_cpp.server` on the same model file.")
@click.option("--mlx-lm-server", "with_mlx_lm_server", is_flag=True,
              help="Also run the trace against mlx-lm's own server on the same MLX model folder.")
@click.option("--compare", multiple=True, metavar="NAME=URL",
              help="Also run the trace against another OpenAI-compatible /v1 URL (e.g. llama-server).")
@click.option("--from", "source", default=None, metavar="PATH",
              help="Weights for --model in the benchmark's fresh homes (a GGUF or an MLX folder); the embedded "
              "smollm2 needs none.")
@click.option("--long-turns", default=0, show_default=True,
              help="Also run one conversation growing ~250 tokens a turn for this many turns (30: ~7,500 tokens).")
@click.option("--subagents", default=0, show_default=True,
              help="Also run this many sessions sharing a ~4,000-token system prompt (disk bytes vs one prefix).")
@click.option("--llama-bench", "llama_bench_path", default=None, metavar="PATH",
              help="With --long-turns: llama.cpp's llama-bench prefills the long session's new tokens at its second "
              "and last turn's depth (-d), the compute no cache removes, for comparison.")
@click.option("--seed", default=7, show_default=True)
@click.option("--slo", is_flag=True,
              help="Instead of the trace: how many agents at once keep their service level (--ttft-p95, --speed-p50),"
              " each replaying --turns turns with ~1 s of thinking between them; beside llama-server -np N "
              "(--llama-server) and llama-cpp-python's server (--llama-cpp-python) in the same run.")
@click.option("--ttft-p95", default=4.0, show_default=True, help="--slo: bound on the p95 time to first token (s).")
@click.option("--speed-p50", default=15.0, show_default=True,
              help="--slo: bound on the p50 output speed of one agent's reply (tokens/s).")
@click.option("--max-agents", default=32, show_default=True, help="--slo: the most agents tried.")
@click.option("--think-median", default=1.0, show_default=True, help="--slo: median seconds between an agent's turns.")
@click.option("--slo-reply-tokens", default=48, show_default=True, help="--slo: tokens of each reply (a tool call).")
@click.option("--llama-server", "llama_server_path", default=None, metavar="PATH",
              help="--slo: also llama.cpp's llama-server, restarted with N slots for N agents.")
@fail_cleanly
def bench_agents(model: str, sessions: int, turns: int, reply_tokens: int, think_time: float, restart_at: int,
                 with_llama_cpp_python: bool, with_mlx_lm_server: bool, compare: tuple[str, ...], source: str | None,
                 long_turns: int, subagents: int, llama_bench_path: str | None, seed: int, slo: bool,
                 ttft_p95: float, speed_p50: float, max_agents: int, think_median: float, slo_reply_tokens: int,
                 llama_server_path: str | None) -> None:
    """Replay an interleaved agent trace: TTFT per turn, tokens recomputed, hit ratio, restart resume; or, with
    --slo, how many agents at once keep a service level."""
    import tempfile
    from pathlib import Path

    if slo:
        from localai.bench.slo import Bounds

        agents_at_service_level(model, source, Bounds(ttft_p95, speed_p50), max_agents=max_agents, turns=turns,
                                reply_tokens=slo_reply_tokens, think_median=think_median, seed=seed,
                                llama_server_path=llama_server_path, with_llama_cpp_python=with_llama_cpp_python)
        return
    if turns < 2 or sessions < 1:
        raise click.BadParameter("needs at least 2 turns and 1 session", param_hint="--turns/--sessions")
    if not 0 < restart_at < turns:
        raise click.BadParameter(f"must be between 1 and {turns - 1} (--turns {turns})", param_hint="--restart-at")
    if llama_bench_path and long_turns < 2:
        raise click.BadParameter("compares the long session: give --long-turns 2 or more", param_hint="--llama-bench")

    from localai.bench import agents as trace
    from localai.bench.servers import LlamaCppPythonServer, ManagedDaemon, MlxLmServer, ReferenceServer

    options: dict[str, Any] = {"sessions": sessions, "turns": turns, "reply_tokens": reply_tokens,
                               "think_time": think_time, "seed": seed}
    results = []
    storage: list[str] = []
    with tempfile.TemporaryDirectory(prefix="localai-bench-") as scratch:
        daemon = ManagedDaemon(scratch + "/home", source)
        with daemon:
            daemon.warm_up(model)
            model_path = daemon.model_path(model)
            options["count_tokens"] = trace.token_counter(model_path)  # for the hit ratio's ceiling
            written: list[float] = []

            def count_writes(turn: int) -> None:
                if turn == 1:
                    trace.settle(daemon.base_url, model)
                    written.append(trace.metric(daemon.base_url, "localai_prompt_cache_bytes_written_total"))

            results.append(trace.run_trace("localai", daemon.base_url, model, before_turn=count_writes, **options))
            trace.settle(daemon.base_url, model)
            later_bytes = trace.metric(daemon.base_url, "localai_prompt_cache_bytes_written_total") - written[0]
            cache_dir = Path(scratch) / "home" / "cache"
            per_token = trace.kv_bytes_per_token(cache_dir)
            ours = results[0]
            grown = sum(ours.samples[i].prompt_tokens for i in range(len(ours.samples)) if ours.samples[i].turn
                        == turns - 1) - sum(s.prompt_tokens for s in ours.samples if s.turn == 0)
            grown += sessions * reply_tokens  # the last turn's replies, kept too
            if per_token and grown > 0:
                storage.append(f"disk writes, turns 1-{turns - 1}: {later_bytes / 1e6:.1f} MB for {grown} new tokens "
                               f"x {per_token} KV bytes = {later_bytes / (grown * per_token):.2f}x the new tokens' KV")
                state = trace.checkpoint_bytes(cache_dir)
                saves = sessions * (turns - 1)
                if state:  # a model with checkpoints: a turn may write one beside its new KV
                    beside = (later_bytes - saves * state) / (grown * per_token)
                    storage.append(f"  per turn: {later_bytes / saves / 1e3:.1f} KB = one checkpoint "
                                   f"({state / 1e3:.1f} KB) + {beside:.2f}x the turn's new tokens' KV")
            if long_turns:
                samples, long_bytes = trace.run_long(daemon.base_url, model, turns=long_turns, growth_words=150,
                                                     reply_tokens=reply_tokens, seed=seed)
                final = samples[-1].prompt_tokens + reply_tokens
                storage.append(
                    f"long session: {long_turns} turns to {samples[-1].prompt_tokens} prompt tokens; bytes written "
                    f"{long_bytes / 1e6:.1f} MB = {long_bytes / max(1, final * per_token):.2f}x the final KV "
                    f"({final * per_token / 1e6:.1f} MB); TTFT turn 1 {samples[1].ttft:.3f} s, last "
                    f"{samples[-1].ttft:.3f} s ({samples[-1].ttft / samples[1].ttft:.2f}x); hit ratio after the first "
                    f"{sum(s.cached_tokens or 0 for s in samples[1:]) / sum(s.prompt_tokens for s in samples[1:]):.1%}")
                if llama_bench_path:
                    storage.append(depth_reference(llama_bench_path, model_path, samples[1], samples[-1]))
            if subagents:
                before_disk = trace.disk_bytes(cache_dir)
                subs = trace.run_subagents(daemon.base_url, model, agents=subagents, prefix_repeats=4,
                                           reply_tokens=reply_tokens, seed=seed)
                used = trace.disk_bytes(cache_dir) - before_disk
                shared = min(s.cached_tokens or 0 for s in subs[1:]) if len(subs) > 1 else 0
                tails = sum(s.prompt_tokens + reply_tokens - shared for s in subs)
                ideal = (shared + tails) * per_token
                storage.append(
                    f"sub-agents: {subagents} sessions sharing a {shared}-token prefix; on disk {used / 1e6:.1f} MB = "
                    f"{used / max(1, ideal):.2f}x one prefix plus the tails ({ideal / 1e6:.1f} MB)")
        restart = ManagedDaemon(scratch + "/restart-home", source)
        with restart:
            restart.warm_up(model)

            def maybe_restart(turn: int) -> None:
                if turn == restart_at:
                    restart.restart()
                    restart.warm_up(model)  # the model load is reported separately, not in the turn's TTFT

            results.append(trace.run_trace("localai+restart", restart.base_url, model, before_turn=maybe_restart,
                                           **options))
        references: list[tuple[str, ReferenceServer]] = []
        if with_llama_cpp_python:
            references.append(("llama-cpp-python", LlamaCppPythonServer(model_path)))
        if with_mlx_lm_server:
            references.append(("mlx_lm.server", MlxLmServer(model_path)))
        for name, reference in references:
            with reference as server:
                server.warm_up()
                results.append(trace.run_trace(name, server.base_url, server.request_model() or model, **options))
        for item in compare:
            name, _, url = item.partition("=")
            results.append(trace.run_trace(name, url, model, **options))
    for line in trace.report(results):
        click.echo(line)
    for line in storage:
        click.echo(line)
    ours, restarted = results[0], results[1]
    later = range(1, turns)
    click.echo(f"restart: turn {restart_at} TTFT {statistics.median(restarted.ttft(restart_at)):.3f} s vs "
               f"{statistics.median(ours.ttft(restart_at)):.3f} s without restart "
               f"({statistics.median(restarted.ttft(restart_at)) / statistics.median(ours.ttft(restart_at)):.2f}x); "
               f"model load after restart {restart.last_load_seconds:.2f} s")
    resumed = [s for s in restarted.samples if s.turn == restart_at]
    click.echo(f"restart: turn {restart_at}'s prefixes came from "
               f"{', '.join(sorted({s.cache_source or '?' for s in resumed}))}; restored "
               f"{statistics.mean(s.cached_tokens or 0 for s in resumed):.0f} tokens in "
               f"{statistics.median(s.restore_ms for s in resumed):.1f} ms (median)")
    for other in results[2:]:
        click.echo(f"localai vs {other.name}: median TTFT turns 1-{turns - 1} "
                   f"{ours.median_ttft(later) / other.median_ttft(later):.2f}x")


def agents_at_service_level(model: str, source: str | None, bounds: Bounds, *, max_agents: int, turns: int,
                            reply_tokens: int, think_median: float, seed: int, llama_server_path: str | None,
                            with_llama_cpp_python: bool) -> None:
    """``bench agents --slo``: each server's largest number of agents at once within the bounds, one server
    holding the model at a time."""
    import tempfile

    from localai.bench import slo
    from localai.bench.servers import LlamaCppPythonServer, LlamaServer, ManagedDaemon
    from localai.settings import Settings

    if turns < 2:
        raise click.BadParameter("needs at least 2 turns", param_hint="--turns")
    settings = Settings()
    click.echo(f"bounds: TTFT p95 <= {bounds.ttft_p95:g} s, output p50 >= {bounds.speed_p50:g} tok/s per agent; "
               f"{turns} turns of {reply_tokens} tokens, thinking ~{think_median:g} s (median) between them; "
               f"{settings.threads()} threads")
    options: dict[str, Any] = {"max_agents": max_agents, "turns": turns, "reply_tokens": reply_tokens,
                               "think_median": think_median, "seed": seed, "report": click.echo}
    results = []
    with tempfile.TemporaryDirectory(prefix="localai-bench-slo-") as scratch:
        daemon = ManagedDaemon(scratch + "/home", source)
        with daemon:
            daemon.warm_up(model)
            model_path = daemon.model_path(model)
            results.append(slo.search(f"localai ({settings.num_parallel} sequences)", lambda _: daemon.base_url,
                                      model, bounds, **options))
        if llama_server_path:
            held: list[LlamaServer] = []

            def with_slots(agents: int) -> str:
                for server in held:
                    server.__exit__()
                held[:] = [LlamaServer(llama_server_path, model_path, 4096, threads=settings.threads(),
                                       parallel=agents)]
                held[0].start()
                held[0].warm_up()
                return held[0].base_url

            try:
                results.append(slo.search("llama-server -np N", with_slots, model, bounds, **options))
            finally:
                for server in held:
                    server.__exit__()
        if with_llama_cpp_python:
            with LlamaCppPythonServer(model_path, 8192) as reference:
                reference.warm_up()
                results.append(slo.search("llama-cpp-python server", lambda _: reference.base_url, model, bounds,
                                          **options))
    counts = {result.name: result.agents(bounds) for result in results}
    for name, count in counts.items():
        click.echo(f"{name}: {count} agents at once within the bounds")
    ours = counts[results[0].name]
    for name, count in list(counts.items())[1:]:
        ratio = f"{ours / count:.2f}x" if count else "more (it served none)"
        click.echo(f"localai vs {name}: {ratio} the agents")


def depth_reference(binary: str, model_path: str, second: Sample, last: Sample) -> str:
    """llama-bench's time for the last turn's new tokens at the second and the last turn's cached depth."""
    from localai.bench import api as measure
    from localai.settings import Settings

    if second.cached_tokens is None or last.cached_tokens is None:
        return "long session: no cached tokens reported, so no llama-bench depth comparison"
    settings = Settings()
    new_tokens = max(1, last.prompt_tokens - last.cached_tokens)
    depths = [second.cached_tokens, last.cached_tokens]
    seconds = measure.llama_bench_depths(binary, model_path, settings.threads(), new_tokens, depths,
                                         flash_attention=settings.flash_attention, n_batch=512)
    early, late = seconds[depths[0]], seconds[depths[1]]
    return (f"long session, the compute no cache removes: llama-bench prefills {new_tokens} tokens in {early:.3f} s "
            f"after {depths[0]} and {late:.3f} s after {depths[1]} ({late / early:.2f}x; {settings.threads()} "
            f"threads, flash attention {'on' if settings.flash_attention else 'off'}, batch 512)")


@bench.command("remote")
@click.option("--model", "-m", default="smollm2", show_default=True, help="A GGUF model the upstreams serve.")
@click.option("--requests", "-r", default=30, show_default=True, help="TTFT pairs (direct, via localai).")
@click.option("--gen-tokens", "-n", default=64, show_default=True, help="Reply length for the decode speed.")
@click.option("--sessions", default=3, show_default=True)
@click.option("--turns", default=6, show_default=True)
@click.option("--reply-tokens", default=12, show_default=True)
@click.option("--seed", default=7, show_default=True)
@fail_cleanly
def bench_remote(model: str, requests: int, gen_tokens: int, sessions: int, turns: int, reply_tokens: int,
                 seed: int) -> None:
    """A remote model's cost and affinity's worth, against llama-cpp-python's own server (needs the bench extra).

    Overhead: streamed requests straight to the server and through localai (a remote model on it), alternated.
    Affinity: the interleaved agent trace on two replicas (half the threads each), routed by session, then
    round-robin; prompt tokens the replicas computed come from their own timing lines.
    """
    import os
    import tempfile

    import httpx

    from localai.bench import agents as trace
    from localai.bench import remote as bench_remote
    from localai.bench.servers import LlamaCppPythonServer, ManagedDaemon

    threads = int(os.environ.get("LOCALAI_NUM_THREAD") or os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="localai-bench-") as scratch, \
            ManagedDaemon(scratch + "/home", env={"LOCALAI_REMOTE_HEALTH_INTERVAL": "3600"}) as daemon:
        # (no health checks during the runs: llama-cpp-python's server can drop a stream that a concurrent
        # GET /models interrupts, which would be measured as the hop's fault)
        model_path = daemon.model_path(model)  # the weights only: the daemon's own worker is never loaded

        def create(name: str, modelfile: str) -> None:
            response = httpx.post(f"http://127.0.0.1:{daemon.port}/api/create",
                                  json={"model": name, "modelfile": modelfile}, timeout=60)
            response.raise_for_status()

        with LlamaCppPythonServer(model_path, 4096, threads=threads, alias="upstream") as server:
            create("hop", f"FROM {server.base_url}\n")
            direct, via = bench_remote.overhead(server.base_url, "upstream", daemon.base_url, "hop",
                                                requests=requests, gen_tokens=gen_tokens)
        click.echo(f"Overhead of the hop ({model}, llama-cpp-python's server, {threads} threads):")
        for line in bench_remote.overhead_report(direct, via):
            click.echo("  " + line)
        evaluated: dict[str, int] = {}
        results = []
        for routing in ("session", "round_robin"):
            replicas = [LlamaCppPythonServer(model_path, 8192, threads=max(1, threads // 2), alias="upstream")
                        for _ in range(2)]
            try:
                for replica in replicas:
                    replica.start()
                name = f"trace-{routing.replace('_', '-')}"
                create(name, f"FROM {replicas[0].base_url}\nPARAMETER replica {replicas[1].base_url}\n"
                             f"PARAMETER routing {routing}\n")
                result = trace.run_trace(routing, daemon.base_url, name, sessions=sessions, turns=turns,
                                         reply_tokens=reply_tokens, think_time=0.0, seed=seed)
                results.append(result)
                evaluated[routing] = sum(replica.prompt_tokens_evaluated() for replica in replicas)
            finally:
                for replica in replicas:
                    replica.__exit__()
    click.echo(f"\nAffinity: {sessions} sessions x {turns} turns interleaved, two replicas (each keeps one "
               "sequence's prefix, as llama-cpp-python's server does)")
    for routing, count in evaluated.items():
        click.echo(f"  {routing:<12} prompt tokens the replicas computed: {count:>7}   median TTFT turns 1-"
                   f"{turns - 1}: {results[list(evaluated).index(routing)].median_ttft(range(1, turns)):.3f} s")
    if evaluated.get("round_robin"):
        click.echo(f"  session affinity computes {evaluated['session'] / evaluated['round_robin']:.2f}x the tokens "
                   "of round-robin")


@bench.command("saves")
@click.option("--model", "-m", "models", multiple=True, default=["smollm2"], show_default=True,
              help="Installed models (or GGUF paths) to measure; repeat for several.")
@click.option("--contexts", default="1024,4096,16384", show_default=True, help="Context sizes, in tokens.")
@click.option("--new", "new_tokens", default=100, show_default=True, help="New tokens before each save.")
@click.option("--samples", default=3, show_default=True, help="Saves per size (the median is shown).")
@click.option("--threads", "-t", default=2, show_default=True)
@fail_cleanly
def bench_saves(models: tuple[str, ...], contexts: str, new_tokens: int, samples: int, threads: int) -> None:
    """What a turn-end save holds the engine for as the context grows (loads each model in this process)."""
    import os

    from localai.bench.saves import measure, table
    from localai.client import Client

    sizes = [int(part) for part in contexts.split(",") if part.strip()]
    for model in models:
        path = model
        if not os.path.isfile(model):
            client = Client()
            client.ensure_running()
            path = client.request("POST", "/api/show", {"model": model})["path"]
        click.echo(table(model, measure(path, sizes, new=new_tokens, samples=samples, threads=threads)))
        click.echo("")
