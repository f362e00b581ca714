"""A seeded random schedule over the prompt store: two workers' stores on two fingerprint folders under one quota
(each with its writer thread; the second's engine has an uncut part, so its saves carry snapshots and checkpoints,
and its write queue is small, so the queue bound drops blocks and snapshots while checkpoints beyond the session's
limit are dropped under the writer), saves that grow sessions and fork sub-agents, lookups and restores, quota
eviction, worker restarts racing the other worker's eviction of the folder left unused, pins from the CLI's side,
``cache rm``/``prune`` and admin listings, interleaved; the invariants are checked after every step (the queue's
byte count never negative and equal to its payloads), and after a final tidy no orphan file is left.

``make test`` runs a short seeded schedule (tests/promptcache/test_cache_soak.py); ``make stress`` runs it for minutes.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from localai.promptcache import admin, pins
from localai.promptcache.blocks import BLOCK_TOKENS, TEMP_PREFIX, Folder
from localai.promptcache.store import PromptStore
from tests.cachecodec import BytesCodec, state_of

FP = "c" * 32
FP2 = "d" * 32  # the second worker's model: an engine with a part it cannot cut (snapshots, checkpoints)
REST = b"R" * 96  # that engine's uncut part, in every state and every checkpoint
SYSTEM = list(range(100_000, 100_000 + 3 * BLOCK_TOKENS))  # the prefix every session shares


@dataclass
class Worker:
    """What one worker's store is opened with (a restart opens it again the same way)."""

    fingerprint: str
    rest: bytes
    queue_bytes: int | None

    def open(self, root: Path) -> PromptStore:
        return PromptStore(root, self.fingerprint, BytesCodec(rest=self.rest), max_bytes=1 << 30,
                           ram_bytes=64 << 10, queue_bytes=self.queue_bytes)


WORKERS = (Worker(FP, b"", None), Worker(FP2, REST, 2 << 10))


@dataclass
class Figures:
    steps: int = 0
    saves: int = 0
    restores: int = 0
    restored_tokens: int = 0
    evictions: int = 0
    removals: int = 0
    listings: int = 0
    restarts: int = 0
    dropped_writes: int = 0  # writes the queue bound dropped (or that failed)
    lowest_queued: int = 0  # the lowest ``_queued_bytes`` seen (never below 0)
    orphans: int = 0  # files left after the final tidy that nothing names
    violations: list[str] = field(default_factory=list)


def soak(root: Path, *, seed: int, steps: int | None = None, seconds: float | None = None,
         serial: bool = False, trace: Callable[[str], None] | None = None) -> Figures:
    """Run the schedule until ``steps`` steps or ``seconds`` have passed; every invariant broken is recorded.

    ``trace`` hears each step as it is taken (to replay a seed by hand). ``serial``: the writer threads finish
    each step's writes before the next step (the schedule alone decides the interleaving, so a seed replays
    exactly); otherwise they race the steps, as in a worker."""
    rng = random.Random(seed)
    figures = Figures()
    stores = [worker.open(root) for worker in WORKERS]
    sessions: dict[str, list[int]] = {}
    pinned: dict[str, float] = {}  # sessions pinned, until
    held: set[str] = set()  # pinned sessions seen with an entry since their pin: they must keep it
    deadline = time.monotonic() + seconds if seconds is not None else None

    def violation(text: str) -> None:
        figures.violations.append(f"step {figures.steps} (seed {seed}): {text}")

    while (steps is None or figures.steps < steps) and (deadline is None or time.monotonic() < deadline):
        figures.steps += 1
        index = rng.randrange(len(stores))
        cache, worker = stores[index], WORKERS[index]
        action = rng.choices(["save", "fork", "restore", "quota", "pin", "rm", "prune", "list", "flush", "restart"],
                             weights=[30, 6, 25, 6, 5, 3, 2, 10, 8, 2])[0]
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
                ends = sorted(rng.sample(range(len(SYSTEM), len(tokens)), min(3, len(tokens) - len(SYSTEM)))) \
                    if worker.rest else []  # checkpoints on the way: past 8 a session, the oldest go (the writer races)
                cache.save(tokens, state_of(tokens, worker.rest), name,
                           checkpoints=[(end, b"\0" * 8 + worker.rest) for end in ends] or None)
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
                    if restored.state != state_of(restored.tokens, worker.rest):
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
            elif action == "restart":
                figures.restarts += 1
                figures.dropped_writes += cache.stats_snapshot()["dropped_writes"]
                _restart(root, stores, index, rng, violation)
                held.clear()  # the folder left unused meanwhile may lose pinned entries to the other's quota
                if trace:
                    trace(f"{figures.steps}: restart {worker.fingerprint[:4]}")
            else:
                cache.flush()
        except Exception as exc:
            violation(f"{action} raised {exc!r}")
        if serial:
            for each in stores:
                each.flush()
        figures.lowest_queued = min(figures.lowest_queued, *(each._writer.queued_bytes for each in stores))
        _check(root, stores, pinned, held, violation, settled=serial)
    for cache in stores:
        cache.close()
        figures.dropped_writes += cache.stats_snapshot()["dropped_writes"]
        if cache._writer.thread.is_alive():
            violation("a writer thread outlived close()")
    _check(root, stores, pinned, held, violation, settled=True)
    figures.orphans = _tidy_and_count_orphans(root, violation)
    return figures


def _restart(root: Path, stores: list[PromptStore], index: int, rng: random.Random,
             violation: Callable[[str], None]) -> None:
    """Worker ``index`` exits and starts again while the other worker's quota pass evicts (its folder unused for a
    moment): nothing the restarted worker indexes may be deleted under it."""
    stores[index].close()
    other = stores[1 - index]
    other.max_bytes = rng.randrange(1, max(2, 2 * other.folder.bytes_on_disk()))
    evicting = threading.Thread(target=other.enforce_quota)
    evicting.start()
    stores[index] = WORKERS[index].open(root)
    evicting.join()
    other.max_bytes = 1 << 30
    restarted = stores[index]
    with restarted._lock:
        gone = [key for key, block in restarted.folder.blocks.items()
                if block.on_disk and not restarted.folder.block_path(key).exists()]
    if gone:
        violation(f"{len(gone)} blocks a restarted worker indexed were deleted under it by the other's quota")


def _tidy_and_count_orphans(root: Path, report: Callable[[str], None]) -> int:
    """The final tidy (each folder opened again, its garbage collected, closed), then the files nothing names: a
    snapshot no entry has, a block no entry's chain reaches, a temp file."""
    orphans = 0
    for worker in WORKERS:
        cache = worker.open(root)
        with cache._lock:
            cache.folder.collect_garbage()
        cache.close()
        folder = Folder(root / worker.fingerprint)
        folder.scan()
        snapshotted = {head.key for head in folder.heads.values() if head.snapshot}
        found = [f"snapshot {key}" for key in folder.snapshots if key not in snapshotted]
        found += [f"block {key}" for key in set(folder.blocks) - folder.referenced()]
        found += [f"temp {path.name}" for path in (root / worker.fingerprint).rglob(TEMP_PREFIX + "*")]
        for text in found[:5]:
            report(f"{worker.fingerprint[:4]}: orphan {text} after the final tidy")
        orphans += len(found)
    return orphans


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
        for name in ("steps", "saves", "restores", "restored_tokens", "evictions", "removals", "listings",
                     "restarts", "dropped_writes", "orphans"):
            setattr(totals, name, getattr(totals, name) + getattr(found, name))
        totals.lowest_queued = min(totals.lowest_queued, found.lowest_queued)
        totals.violations += found.violations
    report.figure(f"{seed} seeds, {totals.steps} steps in {seconds:.0f} s, two workers on two folders under one "
                  f"quota: {totals.saves} saves, {totals.restores} restores ({totals.restored_tokens} tokens), "
                  f"{totals.evictions} blocks evicted, {totals.removals} cache rm, {totals.listings} listings, "
                  f"{totals.restarts} worker restarts racing the other's eviction, {totals.dropped_writes} writes "
                  f"dropped by the queue bound; lowest _queued_bytes {totals.lowest_queued}; "
                  f"{totals.orphans} orphan files after the final tidy; {len(totals.violations)} violations")
    for text in totals.violations[:10]:
        report.finding(text)


def _check(root: Path, stores: list[PromptStore], pinned: dict[str, float], held: set[str],
           report: Callable[[str], None], *, settled: bool = False) -> None:
    for cache in stores:
        with cache._lock:  # the writer's accounting: the bytes of the payloads queued, never negative
            queued, payloads = cache._writer.queued_bytes, sum(len(p) for p in cache._writer.pending.values())
        if queued < 0 or queued != payloads:
            report(f"{cache.fingerprint[:4]}: _queued_bytes {queued}, payloads queued {payloads}")
    if settled:
        for cache in stores:
            writer = cache._writer
            if writer.queued_bytes != 0 or writer.pending or writer.queue:
                report(f"queued bytes {writer.queued_bytes} and {len(writer.pending)} payloads left after close")
    live = {p.session for p in pins.load_pins(root) if p.session}
    for name, until in pinned.items():
        if until > time.time() + 60 and name not in live:
            report(f"the pin of {name} was lost")
    if not settled:
        return
    for worker in WORKERS:
        folder = Folder(root / worker.fingerprint)
        folder.scan()
        for head in folder.heads.values():
            if not folder.chain(head.key):
                report(f"{worker.fingerprint[:4]}: entry {head.id} ({head.session}) has no complete chain on disk")
    entries = {e.session: e.tokens for e in admin.list_entries(root)}
    for name in pinned:
        if name in entries:
            held.add(name)
        elif name in held:
            report(f"pinned session {name} lost its entry")
            held.discard(name)
