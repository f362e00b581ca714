"""Chat templates that never end (issue 38): the probe's template (nested loops over range(99999)) is refused at
create; one that hangs only on longer conversations is created, and 50 of its chats in flight are each answered
with a 4xx within the deadline while a normal chat on another model (the real smollm2) keeps its latency and
/health answers; SIGTERM then stops the daemon within its grace period, leaving no pid or socket file."""

from __future__ import annotations

import concurrent.futures
import signal
import statistics
import time
from pathlib import Path

import httpx

from tests.api.stress.common import HealthProbe, Report, daemon

LOOP = "{% set r = range(99999) %}{% for a in r %}{% for b in r %}{% for c in r %}x{% endfor %}{% endfor %}{% endfor %}"
LATER = ("{% if messages | length > 4 %}" + LOOP + "{% endif %}"
         "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "<|im_start|>assistant\n")
LONG = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(7)]
HOSTILE = 50
DEADLINE = 5.0  # chat_template.RENDER_SECONDS
GRACE = 25.0  # daemon.SHUTDOWN_GRACE


def _normal(base_url: str) -> float:
    started = time.perf_counter()
    response = httpx.post(f"{base_url}/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "temperature": 0, "max_tokens": 16,
        "messages": [{"role": "user", "content": "Name three rivers in Europe."}]})
    response.raise_for_status()
    return time.perf_counter() - started


def _hostile(base_url: str) -> tuple[int, float]:
    started = time.perf_counter()
    try:
        status = httpx.post(f"{base_url}/v1/chat/completions", timeout=120,
                            json={"model": "hostile", "max_tokens": 4, "messages": LONG}).status_code
    except httpx.HTTPError:
        status = 0
    return status, time.perf_counter() - started


def run(report: Report, workdir: Path) -> None:
    with daemon(workdir / "home") as instance:
        base = instance.base_url
        started = time.perf_counter()
        refused = httpx.post(f"{base}/api/create", timeout=120, json={
            "model": "probe", "modelfile": f'FROM smollm2\nTEMPLATE """{LOOP}"""\n'})
        took = time.perf_counter() - started
        report.figure(f"the probe's template at create: {refused.status_code} in {took:.1f} s "
                      f"({refused.json().get('error', '')[:90]!r})")
        if refused.status_code != 400:
            report.finding(f"a template that never ends was accepted at create: {refused.status_code}")
        created = httpx.post(f"{base}/api/create", timeout=120, json={
            "model": "hostile", "modelfile": f'FROM smollm2\nPARAMETER engine scripted\nTEMPLATE """{LATER}"""\n'})
        if created.status_code != 200:
            report.finding(f"the input-dependent template was refused at create: {created.text[:200]}")
            return
        _normal(base)  # the model loads
        quiet = [_normal(base) for _ in range(5)]
        with HealthProbe(base, workdir) as probe, concurrent.futures.ThreadPoolExecutor(HOSTILE + 4) as pool:
            hostile = [pool.submit(_hostile, base) for _ in range(HOSTILE)]
            time.sleep(0.5)
            loaded = [_normal(base) for _ in range(5)]
            answers = [future.result(timeout=300) for future in hostile]
        statuses = sorted({status for status, _ in answers})
        slowest = max(seconds for _, seconds in answers)
        ratio = statistics.median(loaded) / statistics.median(quiet)
        report.figure(f"{HOSTILE} chats on a template that hangs on longer conversations: statuses {statuses}, the "
                      f"slowest answered in {slowest:.1f} s (deadline {DEADLINE:g} s)")
        report.figure(f"a normal chat on smollm2 meanwhile: median {statistics.median(loaded) * 1000:.0f} ms "
                      f"(worst {max(loaded) * 1000:.0f} ms) against {statistics.median(quiet) * 1000:.0f} ms quiet "
                      f"= {ratio:.2f}x; {probe}")
        if statuses != [400]:
            report.finding(f"hanging-template chats got {statuses}, not all 400")
        if slowest > 2 * DEADLINE + 1:
            report.finding(f"a hanging-template chat took {slowest:.1f} s to its answer")
        if ratio > 2.0:
            report.finding(f"a normal chat took {ratio:.2f}x its quiet latency while templates hung")
        with concurrent.futures.ThreadPoolExecutor(HOSTILE) as pool:
            for _ in range(HOSTILE):
                pool.submit(_hostile, base)
            time.sleep(1.0)
            started = time.perf_counter()
            instance.process.send_signal(signal.SIGTERM)
            try:
                code = instance.process.wait(timeout=GRACE + 30)
            except Exception:
                code = None
            stopped = time.perf_counter() - started
        left = [name for name in ("localai.pid", "localai.sock") if (instance.home / name).exists()]
        report.figure(f"SIGTERM with {HOSTILE} hanging-template chats in flight: exit {code} after {stopped:.1f} s "
                      f"(grace {GRACE:g} s); files left: {left or 'none'}")
        if code is None or stopped > GRACE or left:
            report.finding(f"SIGTERM: exit {code} after {stopped:.1f} s, files left {left}")
