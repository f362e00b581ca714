"""``localai bench``: prefill and decode speed through the API (beside llama-bench when given)."""

from __future__ import annotations

import click

from localai.cli import cli, fail_cleanly


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
@click.option("--mlx-lm-server", "with_mlx_lm_server", is_flag=True,
              help="For an MLX model: start mlx-lm's own server (mlx_lm.server, --decode-concurrency STREAMS) on the "
                   "same folder and measure it through its API the same way, interleaved, one holding the model at a "
                   "time.")
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
@click.option("--cold", multiple=True, type=click.IntRange(1, 16), metavar="N",
              help="Also N cold prompts (--cold-tokens each) sent together while another stream decodes (repeatable:"
              " --cold 2 --cold 3): their time to first token and the stream's longest gap; llama-server gets N+1 "
              "slots.")
@click.option("--cold-tokens", default=1500, show_default=True, type=click.IntRange(32),
              help="The size of each --cold prompt, in tokens (about).")
@click.pass_context
@fail_cleanly
def bench(ctx: click.Context, model: str, base_url: str | None, prompt_tokens: int, gen_tokens: int,
          repetitions: int, llama_bench_path: str | None, with_mlx_lm: bool, threads: int | None,
          llama_server_path: str | None, streams: int, edit_tokens: int, depth: int,
          llama_server_args: tuple[str, ...], with_mlx_lm_server: bool, cold: tuple[int, ...],
          cold_tokens: int) -> None:
    """Measure prefill (pp), decode (tg), concurrent streams and an edit workload through the API."""
    if ctx.invoked_subcommand is not None:
        return
    _require_anchors(llama_server_path, llama_bench_path)
    from localai.bench import speed
    from localai.settings import Settings

    plan = speed.SpeedPlan(model, prompt_tokens, gen_tokens, repetitions, threads or Settings().threads(), streams,
                           edit_tokens, depth, llama_bench_path=llama_bench_path, with_mlx_lm=with_mlx_lm,
                           llama_server_path=llama_server_path, llama_server_args=llama_server_args,
                           with_mlx_lm_server=with_mlx_lm_server, cold=cold, cold_tokens=cold_tokens)
    report = speed.run(plan, base_url, progress=lambda line: click.echo(line, err=True))
    for line in speed.table(report):
        click.echo(line)


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
@click.option("--system-repeats", default=1, show_default=True, type=click.IntRange(1, 16),
              help="The sessions' system-and-tools prompt: ~1,100 tokens (smollm2's tokenizer) this many times "
              "(5: ~5,500, an agent's size).")
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
              help="Also the trace against llama.cpp's llama-server on the same GGUF (4 slots of 8,192 tokens, its "
                   "own context checkpoints); with --slo, restarted with N slots for N agents.")
@fail_cleanly
def bench_agents(model: str, sessions: int, turns: int, reply_tokens: int, think_time: float, restart_at: int,
                 with_llama_cpp_python: bool, with_mlx_lm_server: bool, compare: tuple[str, ...], source: str | None,
                 long_turns: int, subagents: int, llama_bench_path: str | None, seed: int, slo: bool,
                 ttft_p95: float, speed_p50: float, max_agents: int, think_median: float, slo_reply_tokens: int,
                 llama_server_path: str | None, system_repeats: int) -> None:
    """Replay an interleaved agent trace: TTFT per turn, tokens recomputed, hit ratio, restart resume; or, with
    --slo, how many agents at once keep a service level."""
    _require_anchors(llama_server_path, llama_bench_path)
    if slo:
        from localai.bench import slo as service_level

        if turns < 2:
            raise click.BadParameter("needs at least 2 turns", param_hint="--turns")
        service_level.servers_at_service_level(
            model, source, service_level.Bounds(ttft_p95, speed_p50), max_agents=max_agents, turns=turns,
            reply_tokens=slo_reply_tokens, think_median=think_median, seed=seed, llama_server_path=llama_server_path,
            with_llama_cpp_python=with_llama_cpp_python, echo=click.echo)
        return
    _check_trace_options(turns, sessions, restart_at, long_turns, llama_bench_path)
    from localai.bench import agent_runs

    report = agent_runs.run(agent_runs.AgentsPlan(
        model, source, sessions, turns, reply_tokens, think_time, restart_at, seed, long_turns=long_turns,
        subagents=subagents, llama_bench_path=llama_bench_path, with_llama_cpp_python=with_llama_cpp_python,
        with_mlx_lm_server=with_mlx_lm_server, compare=compare, llama_server_path=llama_server_path,
        system_repeats=system_repeats))
    for line in agent_runs.table(report):
        click.echo(line)


def _check_trace_options(turns: int, sessions: int, restart_at: int, long_turns: int,
                         llama_bench_path: str | None) -> None:
    if turns < 2 or sessions < 1:
        raise click.BadParameter("needs at least 2 turns and 1 session", param_hint="--turns/--sessions")
    if not 0 < restart_at < turns:
        raise click.BadParameter(f"must be between 1 and {turns - 1} (--turns {turns})", param_hint="--restart-at")
    if llama_bench_path and long_turns < 2:
        raise click.BadParameter("compares the long session: give --long-turns 2 or more", param_hint="--llama-bench")


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
    from localai.bench import remote

    remote.run(remote.RemotePlan(model, requests, gen_tokens, sessions, turns, reply_tokens, seed), click.echo)


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


def _require_anchors(llama_server_path: str | None, llama_bench_path: str | None) -> None:
    """A missing llama-server or llama-bench is said at once, not after localai's side has been measured."""
    from localai.bench.servers import LlamaServer, require_program

    for path in (llama_server_path, llama_bench_path):
        if path:
            require_program(path, LlamaServer.install_hint)
