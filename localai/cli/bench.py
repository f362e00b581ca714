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
@click.option("--threads", "-t", default=None, type=int,
              help="Threads for llama-bench (default: LOCALAI_NUM_THREAD or all).")
@click.pass_context
@fail_cleanly
def bench(ctx: click.Context, model: str, base_url: str | None, prompt_tokens: int, gen_tokens: int,
          repetitions: int, llama_bench_path: str | None, threads: int | None) -> None:
    """Measure prefill (pp) and decode (tg) tokens/s through the API."""
    if ctx.invoked_subcommand is not None:
        return
    import httpx

    from localai import bench as measure
    from localai import paths
    from localai.client import Client
    from localai.settings import Settings

    if base_url is None:
        client = Client()
        client.ensure_running()
        http = httpx.Client(transport=httpx.HTTPTransport(uds=str(paths.socket_path())),
                            base_url="http://localhost/v1", timeout=600)
        model_path = client.request("POST", "/api/show", {"model": model})["modelfile"].split("\n")[0][5:]
    else:
        http = httpx.Client(base_url=base_url.rstrip("/"), timeout=600)
        model_path = None
    threads = threads or Settings().threads()
    ours, theirs = measure.SpeedResult(), measure.SpeedResult()
    with http:
        words = measure.calibrate_words(http, model, prompt_tokens)  # also loads the model
        for index in range(repetitions):
            measure.measure_once(http, model, words, gen_tokens, ours)
            if llama_bench_path and model_path:
                pp, tg = measure.llama_bench(llama_bench_path, model_path, threads, prompt_tokens, gen_tokens)
                theirs.prefill.append(pp)
                theirs.decode.append(tg)
            click.echo(f"  run {index + 1}/{repetitions}: pp {ours.prefill[-1]:.1f} tok/s, "
                       f"tg {ours.decode[-1] if ours.decode else 0:.1f} tok/s", err=True)
    click.echo(f"model {model}  threads {threads}  prompt {ours.prompt_tokens[-1]} tokens  output {gen_tokens} tokens")
    click.echo(f"{'':22}{'prefill (pp) tok/s':<34}{'decode (tg) tok/s':<34}")
    click.echo(f"{'localai (API)':<22}{measure.summary(ours.prefill):<34}{measure.summary(ours.decode):<34}")
    if theirs.prefill:
        click.echo(f"{'llama-bench':<22}{measure.summary(theirs.prefill):<34}{measure.summary(theirs.decode):<34}")
        click.echo(f"{'localai / llama-bench':<22}{measure.percent(ours.prefill, theirs.prefill):<34}"
                   f"{measure.percent(ours.decode, theirs.decode):<34}")
