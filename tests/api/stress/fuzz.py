"""Fuzz every endpoint: schemathesis over the daemon's OpenAPI schema, then hand-written hostile bodies on every
POST route. Figures: requests sent, 5xx, hangs, daemon health after each batch, files touched outside the home."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from tests.api.stress.common import Report, daemon, healthy

ROOT = Path(__file__).resolve().parents[3]
HANG = 120.0  # a request that has not answered in this long is a hang
TRAVERSALS = ["../../../../etc/passwd", "..%2f..%2fetc%2fpasswd", "/etc/passwd", "smollm2/../../../x",
              "..\\..\\windows", "~/.ssh/id_rsa", "smollm2:../../x", "a" * 5000]


def hostile_bodies() -> list[tuple[str, bytes, str]]:
    """(what, body, content type) sent to every POST route."""
    nested = b'{"model":"smollm2","messages":' + b"[" * 20000 + b"]" * 20000 + b"}"
    big = json.dumps({"model": "smollm2", "prompt": "a " * (5 << 20), "messages": [
        {"role": "user", "content": "a " * (5 << 20)}]}).encode()
    cases: list[tuple[str, Any]] = [
        ("wrong types", {"model": 5, "messages": "hi", "prompt": ["x"], "input": {"a": 1}, "stream": "yes"}),
        ("wrong types 2", {"model": "smollm2", "messages": [{"role": 7, "content": {"x": []}}], "max_tokens": "9"}),
        ("array body", [1, 2, 3]),
        ("string body", "hello"),
        ("null body", None),
        ("huge numbers", {"model": "smollm2", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 10**30, "temperature": 1e308, "top_p": -1e308, "seed": 2**70,
                          "options": {"num_predict": 10**18, "num_ctx": 2**63, "temperature": -0.0}}),
        ("negative sizes", {"model": "smollm2", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": -5, "n": -1, "top_k": -100, "options": {"num_ctx": -1}}),
        ("NUL bytes", {"model": "smollm2\u0000", "prompt": "a\u0000b", "messages": [
            {"role": "user", "content": "a\u0000b"}], "input": "x\u0000"}),
        ("NUL in text only", {"model": "smollm2", "prompt": "a\u0000b", "stream": False, "max_tokens": 4,
                              "options": {"num_predict": 4}, "messages": [{"role": "user", "content": "\u0000"}]}),
        ("control characters", {"model": "smollm2", "prompt": "\u001b[2J\u0007", "stream": False, "max_tokens": 4,
                                "options": {"num_predict": 4}, "messages": [{"role": "user", "content": "\u202e"}]}),
    ]
    out = [(what, json.dumps(body).encode(), "application/json") for what, body in cases]
    out += [
        ("deep nesting", nested, "application/json"),
        ("10 MB body", big, "application/json"),
        ("invalid UTF-8", b'{"model":"smollm2","prompt":"\xff\xfe\xc3\x28","messages":[{"role":"user","content":'
                          b'"\xed\xa0\x80"}]}', "application/json"),
        ("lone surrogate", b'{"model":"smollm2","prompt":"\\ud800","messages":[{"role":"user","content":"\\udfff"}]}',
         "application/json"),
        ("truncated JSON", b'{"model":"smollm2","messages":[{"role":"us', "application/json"),
        ("not JSON", b"model=smollm2&prompt=hi", "application/x-www-form-urlencoded"),
        ("empty body", b"", "application/json"),
    ]
    for name in TRAVERSALS:
        body = {"model": name, "name": name, "source": name, "destination": name, "prompt": "hi",
                "messages": [{"role": "user", "content": "hi"}], "input": "hi", "stream": False}
        out.append((f"model name {name[:24]!r}", json.dumps(body).encode(), "application/json"))
    return out


def run(report: Report, workdir: Path, examples: int) -> None:
    canary = workdir / "outside"
    canary.mkdir(parents=True, exist_ok=True)
    (canary / "keep.txt").write_text("outside the home")
    (workdir / "schemathesis").mkdir(exist_ok=True)
    with daemon(workdir / "home", context_length="512", num_parallel="2") as instance:
        before = sorted(p.name for p in workdir.iterdir())
        _schemathesis(report, instance.base_url, workdir / "schemathesis", examples)
        if not healthy(instance.base_url):
            report.finding("the daemon is not healthy after the schemathesis run")
        _hand_written(report, instance.base_url)
        after = sorted(p.name for p in workdir.iterdir())
        if after != before or (canary / "keep.txt").read_text() != "outside the home":
            report.finding(f"files next to the home changed: {before} -> {after}")
        else:
            report.figure("files outside the home: untouched")
        if instance.process.poll() is not None:
            report.finding(f"the daemon exited ({instance.process.returncode})")


def _schemathesis(report: Report, base_url: str, workdir: Path, examples: int) -> None:
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.api.stress.fuzz_hooks",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [str(Path(sys.executable).with_name("schemathesis")), "run", f"{base_url}/openapi.json",
               "--checks", "not_a_server_error", "--max-examples", str(examples), "--request-timeout", str(HANG),
               "--generation-deterministic", "--report", "junit", "--report-dir", str(workdir)]
    started = time.monotonic()
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=3600)
    output = done.stdout + done.stderr
    cases = next((line.strip() for line in output.splitlines() if " generated, " in line), "?")
    report.figure(f"schemathesis: {cases} ({time.monotonic() - started:.0f} s, "
                  f"{examples} examples per operation, check not_a_server_error, timeout {HANG:.0f} s)")
    if done.returncode != 0:
        failures = [line for line in output.splitlines() if line.startswith(("_", "E ", "1.", "- ", "[5"))][:20]
        report.finding("schemathesis failed:\n    " + "\n    ".join(failures or output.splitlines()[-30:]))


def _hand_written(report: Report, base_url: str) -> None:
    schema = httpx.get(f"{base_url}/openapi.json", timeout=10).json()
    posts = [path for path, ops in schema["paths"].items() if "post" in ops]
    deletes = [path for path, ops in schema["paths"].items() if "delete" in ops and "{" not in path]
    statuses: Counter[int] = Counter()
    hangs = errors = 0
    for what, body, content_type in hostile_bodies():
        for method, path in [*(("POST", p) for p in posts), *(("DELETE", p) for p in deletes)]:
            try:
                response = httpx.request(method, f"{base_url}{path}", content=body, timeout=HANG,
                                         headers={"Content-Type": content_type})
            except httpx.TimeoutException:
                hangs += 1
                report.finding(f"{method} {path} with {what}: no answer in {HANG:.0f} s")
                continue
            except httpx.HTTPError as exc:
                errors += 1
                report.finding(f"{method} {path} with {what}: connection error {exc!r}")
                continue
            statuses[response.status_code] += 1
            if response.status_code >= 500:
                report.finding(f"{method} {path} with {what}: {response.status_code} {response.text[:200]}")
            if b"root:x:0:0" in response.content:
                report.finding(f"{method} {path} with {what}: the answer holds /etc/passwd")
        if not healthy(base_url):
            report.finding(f"the daemon is not healthy after the batch {what!r}")
    for method, path in [("GET", "/v1/models/{}"), ("GET", "/v1/responses/{}"), ("DELETE", "/v1/responses/{}"),
                         ("DELETE", "/api/cache/{}")]:
        for name in TRAVERSALS:
            response = httpx.request(method, base_url + path.format(name.replace("/", "%2F")), timeout=HANG)
            statuses[response.status_code] += 1
            if response.status_code >= 500:
                report.finding(f"{method} {path} with {name[:30]!r}: {response.status_code}")
    total = sum(statuses.values()) + hangs + errors
    report.figure(f"hand-written: {total} requests over {len(posts)} POST and {len(deletes)} DELETE routes; "
                  f"statuses {dict(sorted(statuses.items()))}; 5xx {sum(n for s, n in statuses.items() if s >= 500)}; "
                  f"hangs {hangs}; connection errors {errors}")
