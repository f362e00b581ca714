"""Stored responses (issue 38): a previous_response_id chain of 1,000 turns of 50 KB each, through the real API
(the scripted engine, on a model whose context holds a few turns: the history is fitted, as an agent's is), must
store less than twice its input bytes (each turn's items once; the whole conversation at every turn was quadratic:
81 turns of 50 KB took the database from 61 to 224 MB). Then a small byte budget is filled and must hold, the
newest response still readable and the oldest gone."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import httpx

from tests.api.stress.common import Report, daemon
from tests.metagguf import metadata_gguf

TURN_BYTES = 50_000
BUDGET = 256 << 10


def _stored(home: Path) -> tuple[int, int, int]:
    """(rows, bytes their JSON takes, bytes of the database files)."""
    with sqlite3.connect(home / "localai.db") as db:
        rows, size = db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM responses").fetchone()
    files = sum(path.stat().st_size for path in home.glob("localai.db*"))
    return int(rows), int(size), files


def run(report: Report, workdir: Path, turns: int = 1000) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    weights = metadata_gguf(workdir / "long-context.gguf", arch="llama", context_length=1 << 20)
    home = workdir / "home"
    with daemon(home, engine="scripted", context_length=str(1 << 17), responses_max_bytes=str(8 << 30)) as instance:
        base = instance.base_url
        created = httpx.post(f"{base}/api/create", timeout=120, json={
            "model": "long", "modelfile": f"FROM {weights}\nPARAMETER engine scripted\nPARAMETER num_ctx 131072\n"})
        if created.status_code != 200:
            report.finding(f"could not create the long-context model: {created.text[:200]}")
            return
        _, _, files_before = _stored(home)
        sent = 0
        previous: str | None = None
        started = time.perf_counter()
        marks: list[str] = []
        with httpx.Client(base_url=base, timeout=300) as http:
            for turn in range(turns):
                text = f"turn {turn}: " + ("lorem ipsum dolor sit amet " * (TURN_BYTES // 27 + 1))[:TURN_BYTES]
                body = {"model": "long", "input": text, "max_output_tokens": 1,
                        **({"previous_response_id": previous} if previous else {})}
                turn_started = time.perf_counter()
                response = http.post("/v1/responses", json=body)
                if response.status_code != 200:
                    report.finding(f"turn {turn} of the chain: {response.status_code} {response.text[:200]}")
                    return
                previous = response.json()["id"]
                sent += len(text.encode())
                if turn in (0, turns // 2, turns - 1):
                    marks.append(f"turn {turn + 1}: {time.perf_counter() - turn_started:.2f} s")
        rows, size, files = _stored(home)
        grown = files - files_before
        report.figure(f"a {turns}-turn previous_response_id chain of {TURN_BYTES // 1000} KB turns: "
                      f"{sent / 1e6:.1f} MB sent, {rows} rows holding {size / 1e6:.1f} MB of JSON "
                      f"({size / sent:.2f}x), database files +{grown / 1e6:.1f} MB ({grown / sent:.2f}x); "
                      f"{time.perf_counter() - started:.0f} s ({', '.join(marks)})")
        if size >= 2 * sent or files - files_before >= 2 * sent:
            report.finding(f"the chain stores {size / sent:.2f}x (rows) / {(files - files_before) / sent:.2f}x "
                           "(files) its input")
        got = httpx.get(f"{base}/v1/responses/{previous}", timeout=60)
        if got.status_code != 200:
            report.finding(f"the chain's last response cannot be read: {got.status_code}")
    with daemon(workdir / "budget", engine="scripted", responses_max_bytes=str(BUDGET)) as small:
        ids = []
        with httpx.Client(base_url=small.base_url, timeout=120) as http:
            for index in range(200):  # 3 KB each: about 2.5x the budget
                response = http.post("/v1/responses", json={"model": "smollm2", "max_output_tokens": 1,
                                                            "input": f"{index} " + "x" * 3_000})
                ids.append(response.json().get("id"))
            newest = http.get(f"/v1/responses/{ids[-1]}").status_code
            oldest = http.get(f"/v1/responses/{ids[0]}").status_code
        rows, size, _ = _stored(workdir / "budget")
        report.figure(f"LOCALAI_RESPONSES_MAX_BYTES={BUDGET >> 10} KiB after {len(ids)} responses of 3 KB: {rows} "
                      f"kept, {size / 1e3:.0f} KB; the newest {newest}, the oldest {oldest}")
        if size > BUDGET or newest != 200 or oldest != 404:
            report.finding(f"the byte budget: {size} bytes kept, newest {newest}, oldest {oldest}")
