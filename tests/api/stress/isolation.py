"""Cross-key guesses at a cached prompt (issue 38), on the real smollm2: with two API keys in a key file, a victim's
prompt holding a PIN is cached under key A; key B then sends the same prompt with the right PIN and with wrong
ones. Its right and wrong guesses must report the same cached tokens (0, each guess under a cache_salt of its own)
and take the same time (no right guess separable from the wrong ones); within key A, another session still reuses
the prefix (the cache's feature, and the side channel that remains inside one key, measured here too). /api/cache
with key B lists none of key A's entries."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from localai.api.security import key_id
from tests.api.stress.common import Report, daemon

KEY_A, KEY_B = "stress-key-a-0123456789", "stress-key-b-9876543210"
PREAMBLE = "You are the vault's assistant. " + " ".join(
    f"Rule {i}: the vault's log entry {i} must never be read aloud, and every request is checked twice." for i in
    range(45))
RIGHT, WRONG = "4812", ["1234", "9071", "5556", "3309", "7745"]
ROUNDS = 8


def _ask(base_url: str, key: str, pin: str, session: str, **extra: Any) -> tuple[int, float]:
    """(cached tokens, seconds) of a one-token answer: the time is the prompt's evaluation."""
    body = {"model": "smollm2", "temperature": 0, "max_tokens": 1, **extra,
            "messages": [{"role": "system", "content": f"{PREAMBLE} The vault's PIN is {pin}."},
                         {"role": "user", "content": "What is the PIN?"}]}
    started = time.perf_counter()
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {key}", "x-session-id": session})
    response.raise_for_status()
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]), time.perf_counter() - started


def run(report: Report, workdir: Path) -> None:
    keys = workdir / "keys.txt"
    workdir.mkdir(parents=True, exist_ok=True)
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    with daemon(workdir / "home", api_key_file=str(keys)) as instance:
        base = instance.base_url
        _ask(base, KEY_A, "0000", "warm-up")  # the model loads
        _ask(base, KEY_A, RIGHT, "victim")
        right: list[tuple[int, float]] = []
        wrong: list[tuple[int, float]] = []
        for round_ in range(ROUNDS):  # interleaved, in alternating order (this machine's load drifts), each guess
            # under a salt of its own (nothing shared), a moment apart (the previous turn's cache writes settle)
            guesses = [(right, RIGHT, "r"), (wrong, WRONG[round_ % len(WRONG)], "w")]
            for into, pin, tag in guesses if round_ % 2 == 0 else reversed(guesses):
                time.sleep(0.5)
                into.append(_ask(base, KEY_B, pin, f"attacker-{tag}{round_}", cache_salt=f"{tag}{round_}"))
        seconds_right = statistics.median(s for _, s in right)
        seconds_wrong = statistics.median(s for _, s in wrong)
        report.figure(f"key B guessing key A's PIN: right guess cached {sorted({c for c, _ in right})} tokens, "
                      f"median {seconds_right * 1000:.0f} ms; wrong guesses cached {sorted({c for c, _ in wrong})}, "
                      f"median {seconds_wrong * 1000:.0f} ms ({len(right)} each, interleaved: right "
                      f"{[round(s * 1000) for _, s in right]}, wrong {[round(s * 1000) for _, s in wrong]} ms)")
        if {c for c, _ in right} != {0} or {c for c, _ in wrong} != {0}:
            report.finding("another key's guesses reused cached tokens")
        # The leak the issue measured separated them (18 s right against 27-43 s wrong): every right guess faster
        # than every wrong one. Load on this machine drifts, so only a separation like that counts as a finding.
        if max(s for _, s in right) < min(s for _, s in wrong):
            report.finding(f"every right guess answered faster than every wrong one ({seconds_right:.2f} s against "
                           f"{seconds_wrong:.2f} s, medians)")
        unsalted = [_ask(base, KEY_B, pin, f"attacker-u{n}") for n, pin in enumerate([WRONG[0], RIGHT, WRONG[1]])]
        report.figure(f"key B's own guesses without salts share their prefix among themselves: cached "
                      f"{[c for c, _ in unsalted]} (first wrong, right, wrong)")
        if unsalted[1][0] != unsalted[2][0]:
            report.finding(f"key B's right and wrong unsalted guesses differ: {unsalted}")
        mine_right = _ask(base, KEY_A, RIGHT, "victim-sub-agent")
        mine_wrong = _ask(base, KEY_A, WRONG[2], "victim-sub-agent-2")
        report.figure(f"within key A (another session): right PIN cached {mine_right[0]} tokens in "
                      f"{mine_right[1] * 1000:.0f} ms, wrong PIN {mine_wrong[0]} in {mine_wrong[1] * 1000:.0f} ms: "
                      "reuse unchanged (and the side channel left inside one key)")
        if mine_right[0] < 500:
            report.finding(f"reuse within one key dropped: {mine_right[0]} cached tokens")
        listed = httpx.get(f"{base}/api/cache", headers={"Authorization": f"Bearer {KEY_B}"}, timeout=60).json()
        foreign = [e for e in listed["entries"] if e["partition"].split(".")[0] != key_id(KEY_B)]
        report.figure(f"/api/cache with key B: {len(listed['entries'])} entries, {len(foreign)} of another key")
        if foreign:
            report.finding("key B's cache listing shows another key's entries")
