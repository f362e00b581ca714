"""Every path timed on the real-shaped models (tests/scalemodels.py) beside llama-server, one model at a time:
``localai bench`` (prefill, decode, 4 streams, the fixed cost per request) with flash attention off on both
servers, then on on both, and ``localai bench agents`` (the agent trace, a restart before turn 3, bytes written per
turn) beside llama-server's own context checkpoints. Each table comes from one run; the commands are printed
before their output so any of them can be run again alone.

    python -m tests.scalebench --llama-server BIN [--name NAME ...] [--quant q4_k] [--repetitions 2] [--no-agents]
    python -m tests.scalebench --llama-server BIN --mtp    # decode with the model's own drafts (MTP) or without
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from localai.bench.servers import ManagedDaemon
from tests import scalemodels


def run(command: list[str], env: dict[str, str]) -> None:
    print(f"$ {shlex.join(command)}", flush=True)
    started = time.monotonic()
    result = subprocess.run(command, env=env, text=True, capture_output=True)
    print(result.stdout, end="", flush=True)
    if result.returncode:
        print(f"(exit {result.returncode}) {result.stderr.strip().splitlines()[-1:] or ''}", flush=True)
    print(f"({time.monotonic() - started:.0f} s)\n", flush=True)


def bench_beside_llama_server(args: argparse.Namespace, model: str, path: Path, settings: dict[str, str],
                              flash: bool, options: list[str]) -> None:
    """``localai bench`` on ``path`` in a daemon of its own (warmed up, ``settings`` in its environment) beside
    llama-server with the same threads and flash attention, ``options`` added."""
    with tempfile.TemporaryDirectory(prefix="localai-scale-") as home, \
            ManagedDaemon(home, str(path), env=settings) as daemon:
        daemon.warm_up(model)
        run([sys.executable, "-m", "localai", "bench", "-m", model, "-r", str(args.repetitions), "-t",
             str(args.threads), "--llama-server", args.llama_server, "--llama-server-arg=-fa",
             f"--llama-server-arg={'on' if flash else 'off'}", *options],
            {**os.environ, "LOCALAI_HOME": home, **settings})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--name", action="append", choices=sorted(scalemodels.BY_NAME))
    parser.add_argument("--quant", default="q4_k", choices=scalemodels.QUANTS)
    parser.add_argument("--repetitions", default=2, type=int)
    parser.add_argument("--threads", default=os.cpu_count() or 2, type=int)
    parser.add_argument("--prompt-tokens", default=512, type=int)
    parser.add_argument("--gen-tokens", default=64, type=int)
    parser.add_argument("--no-agents", action="store_true", help="the speed tables only")
    parser.add_argument("--system-repeats", default=5, type=int, help="the trace's system prompt: ~1,100 tokens x N")
    parser.add_argument("--no-speed", action="store_true", help="the agent trace only")
    parser.add_argument("--no-flash", action="store_true", help="flash attention off only")
    parser.add_argument("--mtp", action="store_true",
                        help="only decode on the Qwen3.5 hybrid's MTP files, llama-server with and without draft-mtp")
    args = parser.parse_args()
    if args.mtp:
        mtp(args)
        return
    names = args.name or [s.name for s in scalemodels.SCALES]
    localai = [sys.executable, "-m", "localai"]
    for name in names:
        path = scalemodels.scale_path(name, args.quant)
        if not path.exists():
            sys.exit(f"{path} is missing: run `make fixtures-scale`")
        model = f"{name}-{args.quant}"
        print(f"## {model} ({scalemodels.BY_NAME[name].family})\n", flush=True)
        for flash in () if args.no_speed else (False,) if args.no_flash else (False, True):
            # the context llama-server gets for 4 streams (4 slots of 4,096): the memory compared is for the same
            settings = {"LOCALAI_NUM_THREAD": str(args.threads), "LOCALAI_FLASH_ATTENTION": str(flash).lower(),
                        "LOCALAI_CONTEXT_LENGTH": "16384"}
            bench_beside_llama_server(args, model, path, settings, flash, [
                "-p", str(args.prompt_tokens), "-n", str(args.gen_tokens), "--streams", "4", "--cold", "2",
                "--cold", "3"])
        if not args.no_agents:
            env = {**os.environ, "LOCALAI_NUM_THREAD": str(args.threads)}
            run([*localai, "bench", "agents", "-m", model, "--from", str(path), "--llama-server", args.llama_server,
                 "--system-repeats", str(args.system_repeats)], env)


# (agreement, llama-server's draft flags): the no-draft anchor, one draft a step, three
MTP_RUNS = [(75, []), (75, ["--spec-draft-n-max", "1"]), (75, ["--spec-draft-n-max", "3"]),
            (50, ["--spec-draft-n-max", "3"]), (90, ["--spec-draft-n-max", "3"])]


def mtp(args: argparse.Namespace) -> None:
    """Decode on the hybrid whose MTP block drafts right on 50/75/90% of tokens: localai (n-gram drafts only)
    beside llama-server without drafts and with ``--spec-type draft-mtp``, flash attention off on both."""
    settings = {"LOCALAI_NUM_THREAD": str(args.threads), "LOCALAI_FLASH_ATTENTION": "false"}
    for agree, flags in MTP_RUNS:
        scale = scalemodels.with_mtp(scalemodels.BY_NAME["qwen3.5-hybrid"], agree / 100)
        model = f"{scale.name}-{args.quant}"
        path = scalemodels.scale_path(scale.name, args.quant)
        if not path.exists():
            sys.exit(f"{path} is missing: run `make fixtures-scale`")
        drafts = ["--spec-type", "draft-mtp", *flags] if flags else []
        bench_beside_llama_server(args, model, path, settings, False, [
            "-p", "64", "-n", "128", "--streams", "0", *[f"--llama-server-arg={a}" for a in drafts]])


if __name__ == "__main__":
    main()
