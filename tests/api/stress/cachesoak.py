"""A seeded random schedule over the prompt store: a worker's store on a folder (with its writer thread),
saves that grow sessions and fork sub-agents, lookups and restores, quota eviction, pins from the CLI's side,
``cache rm``/``prune`` and admin listings, interleaved; the invariants are checked after every step.

``make test`` runs a short seeded schedule (tests/promptcache/test_cache_soak.py); ``make stress`` runs it for minutes.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from localai.promptcache import admin, pins
from localai.promptcache.blocks import BLOCK_TOKENS, Folder
from localai.promptcache.store import PromptStore
from tests.cachecodec import BytesCodec, state_of

FP = "c" * 32
STORES = 1
SYSTEM = list(range(100_000, 100_000 + 3 * BLOCK_TOKENS))  # the prefix every session shares


@dataclass
class Figures:
    steps: int = 0
    saves: int = 0
    restores: int = 0
    restored_tokens: int = 0
    evictions: int = 0
    removals: int = 0
    listings: int = 0
    violations: list[str] = field(default_factory=list)


def soak(root: Path, *, seed: int, steps: int | None = None, seconds: float | None = None,
         serial: bool = False, trace: Callable[[str], None] | None = None) -> Figures:
    """Run the schedule until ``steps`` steps or ``seconds`` have passed; every invariant broken is recorded.

    ``trace`` hears each step as it is taken (to replay a seed by hand). ``serial``: the writer threads finish
    each step's writes before the next step (the schedule alone decides the interleaving, so a seed replays
    exactly); otherwise they race the steps, as in a worker."""
    rng = random.Random(seed)
    figures = Figures()
    stores = [PromptStore(root, FP, BytesCodec(), max_bytes=1 << 30, ram_bytes=64 << 10) for _ in range(STORES)]
    sessions: dict[str, list[int]] = {}
    pinned: dict[str, float] = {}  # sessions pinned, until
    held: set[str] = set()  # pinned sessions seen with an entry since their pin: they must keep it
    deadline = time.monotonic() + seconds if seconds is not None else None

    def violation(text: str) -> None:
        figures.violations.append(f"step {figures.steps} (seed {seed}): {text}")

    while (steps is None or figures.steps < steps) and (deadline is None or time.monotonic() < deadline):
        figures.steps += 1
        cache = rng.choice(stores)
        action = rng.choices(["save", "fork", "restore", "quota", "pin", "rm", "prune", "list", "flush"],
                             weights=[30, 6, 25, 6, 5, 3, 2, 10, 8])[0]
        try:
            if action in ("save", "fork") or not sessions:
                if action == "fork" and sessions:
                    parent = rng.choice(sorted(sessions))
                    name = f"{parent}.{rng.randrange(1000)}"
                    sessions[name] = sessions[parent][:rng.randrange(len(SYSTEM), len(sessions[parent]) + 1)]
                else:
                    name = rng.choice([*sorted(sessions), f"s{rng.randrange(10_000)}"] if sessions else ["s0"])
                    sessions.setdefault(name, list(SYSTEM))
                sessions[name] += [rng.randrange(50_000) for _ in range(rng.randrange(1, 3 * BLOCK_TOKENS))]
                tokens = sessions[name]
                cache.save(tokens, state_of(tokens), name)
                figures.saves += 1
                if trace:
                    trace(f"{figures.steps}: save {name} ({len(tokens)} tokens)")
            elif action == "restore":
                name = rng.choice(sorted(sessions))
                prompt = sessions[name] + [7] * rng.randrange(0, 40)
                match = cache.lookup(prompt)
                restored = cache.restore(match) if match else None
                if restored is not None:
                    figures.restores += 1
                    figures.restored_tokens += restored.common
                    if restored.state != state_of(restored.tokens):
                        violation(f"restored state does not match its {len(restored.tokens)} tokens")
                    if restored.tokens[:restored.common] != prompt[:restored.common]:
                        violation("restored tokens are not the prompt's prefix")
            elif action == "quota":
                cache.flush()
                cache.max_bytes = rng.randrange(1, max(2, cache.folder.bytes_on_disk()))
                before = cache.stats_snapshot()["evictions"]
                cache.enforce_quota()
                if trace:
                    trace(f"{figures.steps}: quota {cache.max_bytes}")
                figures.evictions += cache.stats_snapshot()["evictions"] - before
                cache.max_bytes = 1 << 30
            elif action == "pin":
                name = rng.choice(sorted(sessions))
                pins.add_pin(session=name, entry=None, ttl=3600, root=root)
                pinned[name] = time.time() + 3600
                held.discard(name)  # a pin keeps what there is: quota may have evicted the entry before it
                if trace:
                    trace(f"{figures.steps}: pin {name}")
            elif action == "rm":
                name = rng.choice(sorted(sessions))
                admin.remove_entries(session=name, root=root)
                held.discard(name)
                figures.removals += 1
                if trace:
                    trace(f"{figures.steps}: rm {name}")
            elif action == "prune":
                admin.prune(max_bytes=rng.randrange(1 << 20, 8 << 20), root=root)
                if trace:
                    trace(f"{figures.steps}: prune")
            elif action == "list":
                admin.list_entries(root)
                admin.stats(root)
                figures.listings += 1
            else:
                cache.flush()
        except Exception as exc:
            violation(f"{action} raised {exc!r}")
        if serial:
            for each in stores:
                each.flush()
        _check(root, stores, pinned, held, violation, settled=serial)
    for cache in stores:
        cache.close()
    _check(root, stores, pinned, held, violation, settled=True)
    return figures


def run(report: object, workdir: Path, seconds: float) -> None:
    """``make stress``: the concurrent schedule (writers racing the steps) for ``seconds``, seed after seed."""
    from tests.api.stress.common import Report

    assert isinstance(report, Report)
    totals = Figures()
    seed = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seed += 1
        folder = workdir / f"seed-{seed}"
        folder.mkdir(parents=True)
        found = soak(folder, seed=seed, steps=400)
        for name in ("steps", "saves", "restores", "restored_tokens", "evictions", "removals", "listings"):
            setattr(totals, name, getattr(totals, name) + getattr(found, name))
        totals.violations += found.violations
    report.figure(f"{seed} seeds, {totals.steps} steps in {seconds:.0f} s: {totals.saves} saves, {totals.restores} "
                  f"restores ({totals.restored_tokens} tokens), {totals.evictions} blocks evicted, {totals.removals} "
                  f"cache rm, {totals.listings} listings; {len(totals.violations)} violations")
    for text in totals.violations[:10]:
        report.finding(text)


def _check(root: Path, stores: list[PromptStore], pinned: dict[str, float], held: set[str],
           report: Callable[[str], None], *, settled: bool = False) -> None:
    if settled:
        for cache in stores:
            if cache._queued_bytes != 0 or cache._pending or cache._queue:
                report(f"queued bytes {cache._queued_bytes} and {len(cache._pending)} payloads left after close")
    live = {p.session for p in pins.load_pins(root) if p.session}
    for name, until in pinned.items():
        if until > time.time() + 60 and name not in live:
            report(f"the pin of {name} was lost")
    if not settled:
        return
    folder = Folder(root / FP)
    folder.scan()
    for head in folder.heads.values():
        if not folder.chain(head.key):
            report(f"entry {head.id} ({head.session}) has no complete chain of blocks on disk")
    entries = {e.session: e.tokens for e in admin.list_entries(root)}
    for name in pinned:
        if name in entries:
            held.add(name)
        elif name in held:
            report(f"pinned session {name} lost its entry")
            held.discard(name)
