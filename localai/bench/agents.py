"""``localai bench agents``: replay a synthetic coding-agent trace against OpenAI-compatible servers.

N sessions share a system prompt with tool schemas (about 1,100 tokens for smollm2's tokenizer, or a multiple) and are
served round-robin; each turn appends the model's reply and a tool result (about 110 tokens). Reported
per turn: time to first token (p50/p95 over sessions), tokens recomputed (prompt - cached, where the
server reports cached tokens), and the overall hit ratio after each session's first request.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import numpy as np

from localai.bench.api import sse_events

TOOLS = [
    {"name": "read_file", "description": "Read a file from the workspace and return its contents.",
     "parameters": {"path": "string: path relative to the repository root",
                    "start_line": "integer: first line to return", "end_line": "integer: last line"}},
    {"name": "write_file", "description": "Create or overwrite a file with the given contents.",
     "parameters": {"path": "string", "contents": "string: the full new contents of the file"}},
    {"name": "edit_file", "description": "Replace an exact string in a file with another string.",
     "parameters": {"path": "string", "old": "string: text to find", "new": "string: replacement"}},
    {"name": "run_command", "description": "Run a shell command in the workspace and return its output.",
     "parameters": {"command": "string", "timeout_seconds": "integer: default 120"}},
    {"name": "search", "description": "Search the repository for a regular expression.",
     "parameters": {"pattern": "string", "path": "string: folder to search", "max_results": "integer"}},
    {"name": "list_directory", "description": "List the files and folders under a path.",
     "parameters": {"path": "string", "recursive": "boolean"}},
]
RULES = [
    "Read the relevant files before changing them.", "Keep changes small and focused on the task.",
    "Run the tests after every change and report failures exactly.", "Never invent file contents.",
    "Prefer editing existing code over adding new files.", "Explain each change in one sentence.",
    "Ask before deleting anything.", "Use the project's existing style and naming.",
]
WORDS = [
    "def", "class", "return", "import", "self", "value", "result", "error", "test", "file", "path", "line",
    "module", "function", "config", "server", "client", "request", "response", "cache", "token", "model",
    "session",
]


def system_prompt(repeats: int = 1) -> str:
    """The agent's system-and-tools prompt: about 1,100 tokens (smollm2's tokenizer) ``repeats`` times (5: about
    5,500, the size of a real agent's, whose tool schemas alone run to thousands of tokens)."""
    schemas = "\n".join(json.dumps(tool, sort_keys=True) for tool in TOOLS)
    rules = "\n".join(f"- {rule}" for rule in RULES)
    one = (f"You are a coding agent working in a software repository.\nRules:\n{rules}\n"
           f"You can call these tools by answering with JSON:\n{schemas}\n" * 3).strip()
    return "\n".join([one] * repeats)


def tool_result(rng: random.Random, turn: int, words: int = 80) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Tool result for call {turn} (run_command): exit code 0\n{body}"


@dataclass
class Sample:
    session: int
    turn: int
    ttft: float
    prompt_tokens: int
    cached_tokens: int | None
    cache_source: str = ""  # localai's X-LocalAI-Cache: live, ram, disk or miss
    restore_ms: float = 0.0  # localai's X-LocalAI-Cache-Restore-Ms: loading the prefix from RAM or disk
    completion_tokens: int = 0
    new_tokens: int | None = None  # the text sent for the first time in this request, in tokens (when counted)


class Reply(NamedTuple):
    ttft: float
    text: str
    prompt_tokens: int
    cached_tokens: int | None  # None: the server does not report them
    completion_tokens: int  # the usage's, else the chunks with text (servers that report no usage while streaming)
    output_seconds: float = 0.0  # from the first chunk with text to the last

    def speed(self) -> float | None:
        """Output tokens/s after the first token; None for a reply too short to time."""
        if self.completion_tokens <= 4 or self.output_seconds <= 0:
            return None
        return (self.completion_tokens - 1) / self.output_seconds

    def sample(self, session: int, turn: int, headers: dict[str, str] | None = None,
               new_tokens: int | None = None) -> Sample:
        """This reply as a trace sample (``headers``: the response's, for localai's cache source and restore time)."""
        headers = headers or {}
        return Sample(session, turn, self.ttft, self.prompt_tokens, self.cached_tokens,
                      headers.get("x-localai-cache", ""), float(headers.get("x-localai-cache-restore-ms") or 0),
                      self.completion_tokens, new_tokens)


@dataclass
class TraceResult:
    name: str
    samples: list[Sample] = field(default_factory=list)

    def turns(self) -> list[int]:
        return sorted({s.turn for s in self.samples})

    def ttft(self, turn: int) -> list[float]:
        return [s.ttft for s in self.samples if s.turn == turn]

    def recomputed(self, turn: int) -> float | None:
        values = [s.prompt_tokens - s.cached_tokens for s in self.samples
                  if s.turn == turn and s.cached_tokens is not None]
        return statistics.mean(values) if values else None

    def hit_ratio(self) -> float | None:
        later = [s for s in self.samples if s.turn > 0 and s.cached_tokens is not None]
        if not later:
            return None
        return sum(s.cached_tokens or 0 for s in later) / sum(s.prompt_tokens for s in later)

    def hit_ceiling(self) -> float | None:
        """The hit ratio of a cache that had everything but the text of each new message (the tool result, which
        no server sees before it arrives), over the same requests as ``hit_ratio``; None without a tokenizer."""
        later = [s for s in self.samples if s.turn > 0 and s.cached_tokens is not None and s.new_tokens is not None]
        if not later:
            return None
        prompt = sum(s.prompt_tokens for s in later)
        return (prompt - sum(s.new_tokens or 0 for s in later)) / prompt

    def median_ttft(self, turns: range) -> float:
        return statistics.median([s.ttft for s in self.samples if s.turn in turns])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def request(http: httpx.Client, model: str, messages: list[dict[str, str]], session: str,
            reply_tokens: int, received: dict[str, str] | None = None, **extra: Any) -> Reply:
    """Stream one chat request; ``received`` gets the response's headers, ``extra`` goes into the body."""
    body = {"model": model, "messages": messages, "max_tokens": reply_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "prompt_cache_key": session, **extra}
    started = time.perf_counter()
    first = last = 0.0
    parts: list[str] = []
    usage: dict[str, Any] = {}
    for payload in sse_events(http, "/chat/completions", body, headers={"X-Session-Id": session},
                              received=received):
        if payload.get("usage"):
            usage = payload["usage"]
        for choice in payload.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                last = time.perf_counter()
                first = first or last
                parts.append(text)
    ttft = (first or time.perf_counter()) - started
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return Reply(ttft, "".join(parts), int(usage.get("prompt_tokens", 0)), int(cached) if cached is not None else None,
                 int(usage.get("completion_tokens", 0)) or len(parts), last - first)


def token_counter(model_path: str) -> Callable[[str], int] | None:
    """Counts a text's tokens with the model's own tokenizer (a GGUF's vocabulary through llama.cpp, or an MLX
    folder's tokenizer); None where neither loads."""
    try:
        if Path(model_path).is_file():
            import llama_cpp as L

            from localai.engines.llama_cpp import quiet_llama_logs

            quiet_llama_logs(False)
            params = L.llama_model_default_params()
            params.vocab_only = True  # the tokenizer alone: no weights, no context
            model = L.llama_model_load_from_file(model_path.encode(), params)
            if not model:
                return None
            vocab = L.llama_model_get_vocab(model)

            def count(text: str) -> int:  # keeps ``model`` alive with ``vocab``
                data = text.encode()
                return -int(L.llama_tokenize(vocab, data, len(data), None, 0, False, False)) if data and model else 0

            return count
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        return lambda text: len(tokenizer.encode(text, add_special_tokens=False))
    except Exception:  # the ceiling is optional; the trace runs without it
        return None


def run_trace(name: str, base_url: str, model: str, *, sessions: int, turns: int, reply_tokens: int,
              think_time: float, seed: int, before_turn: Callable[[int], None] | None = None,
              count_tokens: Callable[[str], int] | None = None, system_repeats: int = 1) -> TraceResult:
    rng = random.Random(seed)
    system = system_prompt(system_repeats)
    conversations = [[{"role": "system", "content": system},
                      {"role": "user", "content": f"Task {i}: fix the failing test in module_{i}.py. "
                                                  + tool_result(rng, 0, 40)}] for i in range(sessions)]
    result = TraceResult(name)
    with httpx.Client(base_url=base_url.rstrip("/"), timeout=600) as http:
        for turn in range(turns):
            if before_turn is not None:
                before_turn(turn)
            for index, messages in enumerate(conversations):
                received: dict[str, str] = {}
                reply = request(http, model, messages, f"bench-{seed}-{index}", reply_tokens, received)
                result.samples.append(reply.sample(index, turn, received, count_tokens(messages[-1]["content"])
                                                   if count_tokens else None))
                messages.append({"role": "assistant", "content": reply.text})
                messages.append({"role": "user", "content": tool_result(rng, turn + 1)})
                if think_time:
                    time.sleep(think_time)
    return result


def report(results: list[TraceResult]) -> list[str]:
    lines = []
    header = f"{'turn':<6}" + "".join(f"{r.name + ' TTFT p50/p95 s':<34}{'recomputed':<12}" for r in results)
    lines.append(header)
    for turn in results[0].turns():
        row = f"{turn:<6}"
        for result in results:
            values = result.ttft(turn)
            recomputed = result.recomputed(turn)
            row += f"{statistics.median(values):>6.3f} / {percentile(values, 0.95):<6.3f}{'':19}"
            row += f"{(f'{recomputed:.0f}' if recomputed is not None else 'n/a'):<12}"
        lines.append(row)
    for result in results:
        ratio = result.hit_ratio()
        turns = result.turns()
        later = range(1, max(turns) + 1)
        flat = statistics.median(result.ttft(max(turns))) / statistics.median(result.ttft(1)) if len(turns) > 1 else 0
        ceiling = result.hit_ceiling()
        hits = f"{100 * ratio:.1f}%" if ratio is not None else "n/a (server reports no cached tokens)"
        if ratio is not None and ceiling is not None:
            hits += f" (ceiling {100 * ceiling:.1f}%: all but the new tool results' text)"
        lines.append(f"{result.name}: median TTFT turns 1-{max(turns)} {result.median_ttft(later):.3f} s; "
                     f"last/first-later turn {flat:.2f}x; hit ratio after first request {hits}")
    return lines


def metric(base_url: str, name: str) -> float:
    """A counter summed over labels from the daemon's /metrics (``base_url`` ends in /v1)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    text = httpx.get(f"{root}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def settle(base_url: str, model: str) -> None:
    """Let queued cache writes finish and be reported: wait, then a request too short to be stored."""
    time.sleep(1.0)
    with httpx.Client(base_url=base_url.rstrip("/"), timeout=600) as http:
        request(http, model, [{"role": "user", "content": "ok"}], "bench-settle", 1)
    time.sleep(0.2)


def kv_bytes_per_token(cache_dir: Path) -> int:
    """KV bytes per token of the blocks, from the store's layout (one fingerprint folder expected)."""
    from localai.engines.llama_state import StateFormatError, layout_from_json

    for layout in cache_dir.glob("*/layout.json"):
        data = json.loads(layout.read_text()).get("layout") or {}
        try:
            if "mlx" in data:  # the MLX engine's: each KV layer's token arrays, [batch, heads, width] a token
                return sum(int(np.prod(item["shape"])) * (2 if item["dtype"] == "bfloat16" else
                                                          np.dtype(item["dtype"]).itemsize)
                           for layer in data["layers"] for item in layer.get("arrays", []))
            return layout_from_json(data).bytes_per_token() if "modules" in data else 0
        except (StateFormatError, KeyError, TypeError):
            return 0
    return 0


def checkpoint_bytes(cache_dir: Path) -> int:
    """The bytes of one checkpoint (a snapshot of the state that cannot be cut: the recurrent layers' or the
    sliding window's), the largest on disk; 0 for a model without them."""
    return max((path.stat().st_size for path in cache_dir.glob("*/snaps/*.snp")), default=0)


def disk_bytes(cache_dir: Path) -> int:
    return sum(path.stat().st_size for path in cache_dir.rglob("*") if path.is_file() and path.suffix in
               (".blk", ".snp"))


def run_long(base_url: str, model: str, *, turns: int, growth_words: int, reply_tokens: int,
             seed: int, system_repeats: int = 1) -> tuple[list[Sample], float]:
    """One conversation growing by a tool result of ``growth_words`` words a turn; returns samples and the bytes
    the cache wrote (from /metrics)."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": system_prompt(system_repeats)},
                {"role": "user", "content": "Task: refactor the module. " + tool_result(rng, 0, growth_words)}]
    samples = []
    before = metric(base_url, "localai_prompt_cache_bytes_written_total")
    with httpx.Client(base_url=base_url.rstrip("/"), timeout=600) as http:
        for turn in range(turns):
            reply = request(http, model, messages, f"long-{seed}", reply_tokens)
            samples.append(reply.sample(0, turn))
            messages.append({"role": "assistant", "content": reply.text})
            messages.append({"role": "user", "content": tool_result(rng, turn + 1, growth_words)})
    settle(base_url, model)
    return samples, metric(base_url, "localai_prompt_cache_bytes_written_total") - before


def run_subagents(base_url: str, model: str, *, agents: int, prefix_repeats: int, reply_tokens: int,
                  seed: int) -> list[Sample]:
    """``agents`` sessions sharing one long system prompt, each with its own task."""
    rng = random.Random(seed)
    system = system_prompt(prefix_repeats)
    samples = []
    with httpx.Client(base_url=base_url.rstrip("/"), timeout=600) as http:
        for index in range(agents):
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"Sub-task {index}: " + tool_result(rng, index, 60)}]
            reply = request(http, model, messages, f"sub-{seed}-{index}", reply_tokens)
            samples.append(reply.sample(index, 0))
    settle(base_url, model)
    return samples
