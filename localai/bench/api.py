"""Speed measured through the API, beside llama.cpp's own llama-bench when it is given.

- prefill (pp): a fresh prompt of about N tokens (a random nonce first, so no cache can help),
  one output token; rate = prompt tokens / time to first token, as the client sees it.
- decode (tg): a one-word prompt and exactly M output tokens (``ignore_eos``); rate = tokens after the
  first / time from first to last token.
- depth D: prefill and decode after D tokens of context (a fresh context sent first and kept by the server; the
  prefill rate counts the new tokens only).
- streams: N decodes of M tokens at once (distinct prompts); rate = all their tokens / the wall time from the first
  request to the last token, with the inter-token latency (time between a stream's consecutive chunks).
- edit: a source file in the prompt and "rewrite it with one change" (what coding agents' Write/Edit calls do):
  decode rate of the answer, greedy, stopping where the model stops.
Repetitions alternate with the anchor's runs (llama-bench, llama-server) so both see the same machine state.
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

WORDS = [
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
    "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor",
    "whiskey", "xray", "yankee", "zulu",
]


@dataclass
class SpeedResult:
    prefill: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)  # context tokens before each measurement
    fixed_ms: list[float] = field(default_factory=list)  # a request's fixed cost: a cached prompt, one token


# Both servers sample the same way: plain greedy. A Modelfile's own settings (smollm2's sets repeat_penalty 1.1)
# would otherwise apply to localai only, with other text and a costlier sampler than llama-server's defaults.
GREEDY: dict[str, Any] = {"temperature": 0, "repeat_penalty": 1.0}


def sse_events(http: httpx.Client, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
               received: dict[str, str] | None = None) -> Iterator[dict[str, Any]]:
    """The JSON events of a streamed OpenAI-style response (``data: [DONE]`` ends it); ``received`` gets the
    response's headers.

    A kept-alive connection that the server closed just before reuse is asked again once (no answer came back, so
    nothing was processed): llama-server closes idle connections that way, and a benchmark must not die of it.
    """
    request = http.build_request("POST", path, json=body, headers=headers)
    try:
        response = http.send(request, stream=True)
    except httpx.RemoteProtocolError:
        response = http.send(request, stream=True)
    try:
        if response.status_code >= 400:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode(errors='replace')[:300]}")
        if received is not None:
            received.update(response.headers.items())  # httpx gives the names lower-cased
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])
    finally:
        response.close()


def completion_body(model: str, prompt: str, max_tokens: int, *, cache: bool = False) -> dict[str, Any]:
    """A streamed greedy completion of exactly ``max_tokens`` tokens (``cache``: the server may reuse what it holds
    of the prompt)."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, **GREEDY, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, "cache_prompt": cache}


def _stream_completion(
    http: httpx.Client, model: str, prompt: str, max_tokens: int, *, cache: bool = False
) -> tuple[float, float, float, int, int]:
    """(start, first token time, last token time, prompt tokens, completion tokens) of one streamed request."""
    body = completion_body(model, prompt, max_tokens, cache=cache)
    start = time.perf_counter()
    first = last = 0.0
    usage: dict[str, int] = {}
    for payload in sse_events(http, "/completions", body):
        if payload.get("usage"):
            usage = payload["usage"]
        choices = payload.get("choices") or []
        if choices and (choices[0].get("text") or choices[0].get("finish_reason")):
            # the first token, even one without text: a server that does not take ignore_eos (mlx_lm.server) may
            # end at once with EOS, which is still the end of its prefill
            now = time.perf_counter()
            first = first or now
            last = now if choices[0].get("text") else last
    return start, first, last, int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))


@dataclass
class StreamsResult:
    aggregate: list[float] = field(default_factory=list)  # tokens/s of all streams together, per repetition
    gaps: list[float] = field(default_factory=list)  # seconds between a stream's consecutive chunks


def _timed_stream(http: httpx.Client, model: str, prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
    """(start, arrival time of each chunk with text, completion tokens) of one streamed ``ignore_eos`` completion."""
    body = completion_body(model, prompt, max_tokens)
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    for payload in sse_events(http, "/completions", body):
        if payload.get("usage"):
            tokens = int(payload["usage"].get("completion_tokens", 0))
        choices = payload.get("choices") or []
        if choices and choices[0].get("text"):
            arrivals.append(time.perf_counter())
    return start, arrivals, tokens


def measure_streams(http: httpx.Client, model: str, streams: int, gen_tokens: int, result: StreamsResult) -> None:
    """``streams`` decodes at once, started together; their aggregate tokens/s and inter-token gaps."""
    outcomes: list[tuple[float, list[float], int]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(streams)

    def one() -> None:
        try:
            barrier.wait()
            outcomes.append(_timed_stream(http, model, f"{random.getrandbits(48):x} {random.choice(WORDS)}",
                                          gen_tokens))
        except BaseException as exc:  # reported after the others finish
            errors.append(exc)

    workers = [threading.Thread(target=one) for _ in range(streams)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    begin = min(start for start, _, _ in outcomes)
    end = max(arrivals[-1] for _, arrivals, _ in outcomes if arrivals)
    result.aggregate.append(sum(tokens for _, _, tokens in outcomes) / (end - begin))
    for _, arrivals, _ in outcomes:
        result.gaps.extend(b - a for a, b in itertools.pairwise(arrivals))


@dataclass
class ColdResult:
    """Cold prompts arriving together while another stream decodes (sub-agents starting beside their parent)."""
    ttft: dict[int, list[float]] = field(default_factory=dict)  # by how many arrived together: each one's, seconds
    longest_gap: dict[int, list[float]] = field(default_factory=dict)  # the decoding stream's, while they ran


def measure_cold_beside(http: httpx.Client, model: str, cold: int, words: int, result: ColdResult,
                        *, settle_tokens: int = 8, max_tokens: int = 3000) -> None:
    """``cold`` fresh prompts of ``words`` words (one token out each) sent together once a decoding stream has
    ``settle_tokens`` tokens out: each one's time to first token, and the stream's longest gap between tokens from
    their arrival to the last one's first token. The decoding stream is then closed (the server cancels it)."""
    arrivals: list[float] = []
    started = threading.Event()
    stop = threading.Event()
    errors: list[BaseException] = []

    def decode() -> None:
        try:
            body = completion_body(model, f"{random.getrandbits(48):x} {random.choice(WORDS)}", max_tokens)
            for payload in sse_events(http, "/completions", body):
                choices = payload.get("choices") or []
                if choices and choices[0].get("text"):
                    arrivals.append(time.perf_counter())
                    if len(arrivals) >= settle_tokens:
                        started.set()
                if stop.is_set():
                    break
        except BaseException as exc:
            errors.append(exc)
        finally:
            started.set()

    decoder = threading.Thread(target=decode)
    decoder.start()
    started.wait()
    times: list[float] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            start, first, _, _, _ = _stream_completion(http, model, prefill_prompt(words), 1)
            with lock:
                times.append(first - start)
        except BaseException as exc:
            errors.append(exc)

    begin = time.perf_counter()
    prompts = [threading.Thread(target=one) for _ in range(cold)]
    for thread in prompts:
        thread.start()
    for thread in prompts:
        thread.join()
    end = time.perf_counter()
    stop.set()
    decoder.join()
    if errors:
        raise errors[0]
    inside = [t for t in arrivals if t >= begin]
    before = [t for t in arrivals if t < begin][-1:]
    window = before + [t for t in inside if t <= end] + [t for t in inside if t > end][:1]
    gaps = [b - a for a, b in itertools.pairwise(window)] or [end - begin]
    result.ttft.setdefault(cold, []).extend(sorted(times))
    result.longest_gap.setdefault(cold, []).append(max(gaps))


EDIT_SOURCE = '''import struct
from dataclasses import dataclass


@dataclass
class Header:
    magic: bytes
    version: int
    count: int


def parse_header(data: bytes) -> Header:
    """The file's header: four magic bytes, a version and a record count."""
    if len(data) < 12:
        raise ValueError("the file is shorter than its header")
    magic = data[:4]
    version, count = struct.unpack_from("<II", data, 4)
    if magic != b"REC1":
        raise ValueError(f"not a record file: {magic!r}")
    return Header(magic, version, count)


def parse_records(data: bytes) -> list[tuple[int, str]]:
    """Each record: an id and a length-prefixed UTF-8 name."""
    header = parse_header(data)
    records = []
    offset = 12
    for _ in range(header.count):
        record_id, length = struct.unpack_from("<IH", data, offset)
        offset += 6
        name = data[offset:offset + length].decode("utf-8")
        offset += length
        records.append((record_id, name))
    return records
'''
EDIT_PROMPT = ("Here is a Python file:\n\n```python\n" + EDIT_SOURCE + "```\n\nRewrite the whole file with one change: "
               "rename the function `parse_header` to `read_header` everywhere. Output only the file, in one "
               "```python block.")


@dataclass
class EditResult:
    decode: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    drafted: int = 0  # localai's speculative decoding, over every run: tokens guessed and kept
    kept: int = 0


def measure_edit(http: httpx.Client, model: str, max_tokens: int, result: EditResult,
                 speculative: str | None = None) -> None:
    """The edit workload once: its answer's decode rate (tokens after the first / first to last chunk), with
    localai's speculative decoding as ``speculative`` says (None: the model's setting)."""
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": EDIT_PROMPT}],
                            "max_tokens": max_tokens, **GREEDY, "stream": True,
                            "stream_options": {"include_usage": True}}
    if speculative is not None:
        body["speculative"] = speculative
    first = last = 0.0
    tokens = 0
    pieces = []
    for payload in sse_events(http, "/chat/completions", body):
        if payload.get("usage"):
            tokens = int(payload["usage"].get("completion_tokens", 0))
            details = payload["usage"].get("completion_tokens_details") or {}
            result.kept += int(details.get("accepted_prediction_tokens") or 0)
            result.drafted += int(details.get("accepted_prediction_tokens") or 0) + int(
                details.get("rejected_prediction_tokens") or 0)
        choices = payload.get("choices") or []
        text = (choices[0].get("delta") or {}).get("content") if choices else None
        if text:
            now = time.perf_counter()
            first = first or now
            last = now
            pieces.append(text)
    if tokens > 1 and last > first:
        result.decode.append((tokens - 1) / (last - first))
    result.tokens.append(tokens)
    result.text = "".join(pieces)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def prefill_prompt(words: int) -> str:
    """``words`` random words after a unique nonce, so no prompt cache can help."""
    rng = random.Random()
    return f"{rng.getrandbits(64):016x} " + " ".join(rng.choice(WORDS) for _ in range(max(1, words)))


def calibrate_words(http: httpx.Client, model: str, prompt_tokens: int) -> int:
    """How many words make about ``prompt_tokens`` tokens for this model's tokenizer."""
    _, _, _, tokens, _ = _stream_completion(http, model, prefill_prompt(200), 1)
    return max(1, round(200 * prompt_tokens / max(tokens, 1)))


def warm_up(http: httpx.Client, model: str, words: int) -> None:
    """One prefill of the measured size, not measured: the first one after a load is slower (Gemma 3 270M here:
    ~595 tok/s, then ~690), and the servers are reloaded between repetitions."""
    _stream_completion(http, model, prefill_prompt(words), 1)


def measure_once(http: httpx.Client, model: str, words: int, gen_tokens: int, result: SpeedResult,
                 depth_words: int = 0) -> None:
    """One prefill and one decode measurement; with ``depth_words``, both after that much context: a fresh context
    is sent first (the server keeps it), then the prefill's words after it, then a decode after it."""
    context, n_context = "", 0
    if depth_words:
        context = prefill_prompt(depth_words) + "\n"
        _, _, _, n_context, _ = _stream_completion(http, model, context, 1, cache=True)
    start, first, _, n_prompt, _ = _stream_completion(http, model, context + prefill_prompt(words), 1,
                                                      cache=bool(context))
    result.prefill.append((n_prompt - n_context) / (first - start))
    result.prompt_tokens.append(n_prompt - n_context)
    result.depth.append(n_context)
    _, first, last, _, n_generated = _stream_completion(http, model, context + f"{random.getrandbits(32):x}",
                                                        gen_tokens, cache=bool(context))
    if n_generated > 1 and last > first:
        result.decode.append((n_generated - 1) / (last - first))


def fixed_cost_ms(http: httpx.Client, model: str, requests: int = 9) -> float:
    """What a request costs beyond the model's work: the median time to the first token of a prompt of ~64 words
    the server already holds, one token out. Every server evaluates the prompt's last token again; one that cannot
    cut its state anywhere (a hybrid, a window) returns to a checkpoint before it (localai's is 4 tokens before a
    prompt's end, for prompts of 32 tokens or more: a shorter prompt is evaluated whole again)."""
    prompt = prefill_prompt(64)
    _stream_completion(http, model, prompt, 1, cache=True)  # now held
    times = []
    for _ in range(requests):
        start, first, _, _, _ = _stream_completion(http, model, prompt, 1, cache=True)
        times.append(1000 * (first - start))
    return statistics.median(times)


def _llama_bench_rows(binary: str, *args: str) -> list[dict[str, Any]]:
    output = subprocess.run([binary, *args, "-o", "json"], capture_output=True, text=True, check=True,
                            timeout=900).stdout
    rows: list[dict[str, Any]] = json.loads(output[output.index("["):])
    return rows


def llama_bench(binary: str, model_path: str, threads: int, prompt_tokens: int, gen_tokens: int,
                depth: int = 0) -> tuple[float, float]:
    """(pp, tg) tokens/s from one llama-bench run (``-r 1``), after ``depth`` tokens of context."""
    rows = _llama_bench_rows(binary, "-m", model_path, "-t", str(threads), "-p", str(prompt_tokens),
                             "-n", str(gen_tokens), "-d", str(depth), "-r", "1")
    rates = {("pp" if row["n_prompt"] else "tg"): float(row["avg_ts"]) for row in rows}
    return rates["pp"], rates["tg"]


def llama_bench_depths(binary: str, model_path: str, threads: int, prompt_tokens: int, depths: list[int], *,
                       flash_attention: bool, n_batch: int, repetitions: int = 2) -> dict[int, float]:
    """Seconds llama-bench takes to prefill ``prompt_tokens`` tokens after ``depth`` tokens already in the
    context, for each depth (``-d``): the compute a new turn costs however well its prefix is cached."""
    rows = _llama_bench_rows(binary, "-m", model_path, "-t", str(threads), "-p", str(prompt_tokens), "-n", "0",
                             "-d", ",".join(str(depth) for depth in depths), "-fa", "on" if flash_attention else "off",
                             "-b", str(n_batch), "-ub", str(n_batch), "-r", str(repetitions))
    return {int(row["n_depth"]): float(row["avg_ns"]) / 1e9 for row in rows if row["n_prompt"]}


MLX_LM_REFERENCE = """
import json, random, sys, time
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load
path, n_prompt, n_gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, tokenizer = load(path)
vocab = tokenizer.vocab_size
tokens = mx.array([random.randrange(100, vocab - 100) for _ in range(n_prompt)])
start = time.perf_counter()
steps = generate_step(tokens, model, max_tokens=n_gen)
next(steps)
first = time.perf_counter()
count = 1
for _ in steps:
    count += 1
last = time.perf_counter()
print(json.dumps({"pp": n_prompt / (first - start), "tg": (count - 1) / (last - first)}))
"""


def mlx_lm_reference(model_path: str, prompt_tokens: int, gen_tokens: int) -> tuple[float, float]:
    """(pp, tg) tokens/s of mlx-lm's own generation loop (``generate_step``) on the same folder, in a fresh
    process: a prompt of random tokens, then ``gen_tokens`` tokens (it does not stop at EOS)."""
    import sys

    output = subprocess.run([sys.executable, "-c", MLX_LM_REFERENCE, model_path, str(prompt_tokens),
                             str(gen_tokens)], capture_output=True, text=True, check=True, timeout=900).stdout
    rates = json.loads(output.strip().splitlines()[-1])
    return float(rates["pp"]), float(rates["tg"])


def summary(values: list[float]) -> str:
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.median(values):.1f} (min {min(values):.1f}, max {max(values):.1f})"


def percent(ours: list[float], theirs: list[float]) -> str:
    if not ours or not theirs:
        return ""
    return f"{100 * statistics.median(ours) / statistics.median(theirs):.0f}%"


