"""``localai cache ls|stats|pin|unpin|rm|prune``: works on $LOCALAI_HOME/cache directly (no daemon needed), as the
machine's owner: every API key's entries are listed, each with its partition (the key's id, and a cache_salt's hash
after a dot); ``--partition`` narrows a listing or a removal to one key's."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from localai.cli import cli, fail_cleanly

if TYPE_CHECKING:
    from localai.promptcache.admin import EntryInfo


@cli.group()
def cache() -> None:
    """Inspect and manage the persisted prompt cache."""


def _in_partition(partition: str | None) -> Callable[[str], bool] | None:
    """A filter on entries' partitions: a key's id also matches its salted partitions."""
    if partition is None:
        return None
    return lambda found: found == partition or found.startswith(partition + ".")


@cache.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--partition", default=None, help="Only this partition's entries (an API key's id lists its salted "
              "partitions too; '' the default partition).")
@fail_cleanly
def ls(as_json: bool, partition: str | None) -> None:
    """List cache entries."""
    from dataclasses import asdict

    from localai.cli.models import _table, ago
    from localai.client import human_size
    from localai.promptcache import admin
    from localai.schema import parent_session

    entries = as_tree(admin.list_entries(visible=_in_partition(partition)))
    if as_json:
        click.echo(json.dumps([{**asdict(e), "parent_session": parent_session(e.session)} for e in entries],
                              indent=2))
        return
    partitioned = any(e.partition for e in entries)
    _table(["ID", "KIND", "TOKENS", "BLOCKS", "SIZE", "SESSION", "LAST USED", "PINNED UNTIL",
            *(["PARTITION"] if partitioned else [])], [
        [e.id[:12], e.kind, str(e.tokens), str(e.blocks), human_size(e.bytes), _session_cell(e.session),
         ago(_iso(e.last_used)), _iso(e.pinned_until) if e.pinned_until else "",
         *([e.partition] if partitioned else [])] for e in entries
    ])
    from localai.promptcache import divergences

    recent = {(d.model, d.session) for d in divergences.read(since=time.time() - 86400) if d.early}
    if recent:
        click.echo(f"\n{len(recent)} session(s) had prompts that stopped matching their cache in the last day: "
                   "see `localai cache diverged`")


def as_tree(entries: list[EntryInfo]) -> list[EntryInfo]:
    """Entries in session-tree order: each top session (the most recently used first) with its entries, then its
    sub-agents' and side requests' (``schema.child_session``) under it, and so on down; entries of no session
    last."""
    from localai.schema import parent_session

    def root(session: str) -> str:
        while (parent := parent_session(session)) is not None:
            session = parent
        return session

    newest: dict[str, float] = {}
    for entry in entries:
        if entry.session is not None:
            top = root(entry.session)
            newest[top] = max(newest.get(top, 0.0), entry.last_used)
    return sorted(entries, key=lambda e: (e.session is None, -newest.get(root(e.session), 0.0) if e.session else 0.0,
                                          root(e.session) if e.session else "", e.session or "", -e.last_used))


def _session_cell(session: str | None) -> str:
    """A session as `cache ls` shows it: a child session indented under its parent, by its own part."""
    from localai.schema import SUBSESSION

    if session is None:
        return ""
    parts = session.split(SUBSESSION)
    return parts[0] if len(parts) == 1 else "  " * (len(parts) - 2) + "└ " + parts[-1]


@cache.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--all", "show_all", is_flag=True, help="Also list replies the client sent back changed.")
@fail_cleanly
def diverged(as_json: bool, show_all: bool) -> None:
    """Prompts that did not extend their session's last one: where they parted (in tokens) and the likely cause."""
    from dataclasses import asdict

    from localai.cli.models import _table, ago
    from localai.promptcache import divergences

    found = [d for d in divergences.read() if d.early or show_all]
    if as_json:
        click.echo(json.dumps([asdict(d) for d in found], indent=2))
        return
    if not found:
        click.echo("no session's prompt has parted from its cached prefix")
        return
    _table(["WHEN", "MODEL", "SESSION", "AT TOKEN", "OF", "CAUSE", "DETAIL"], [
        [ago(_iso(d.at)), d.model, d.session, str(d.offset_tokens), str(d.previous_tokens), d.cause, d.detail]
        for d in found[-50:]
    ])


@cache.command()
@fail_cleanly
def stats() -> None:
    """Totals: entries, blocks (each stored once, however many entries share it), bytes on disk, tokens, pins."""
    from localai.client import human_size
    from localai.promptcache import admin

    totals = admin.stats()
    for key, value in totals.items():
        click.echo(f"{key:<14}{human_size(value) if key == 'bytes' else value}")


@cache.command()
@click.option("--session", default=None, help="Pin every entry of this session id.")
@click.option("--entry", default=None, help="Pin one entry (a prefix), by id or id prefix from `cache ls`.")
@click.option("--ttl", default="1h", show_default=True, help="How long the pin holds (30m, 2h, 7d, or seconds).")
@fail_cleanly
def pin(session: str | None, entry: str | None, ttl: str) -> None:
    """Keep a session's entries, or one prefix, out of eviction for a while."""
    from localai.errors import InvalidRequest
    from localai.promptcache import pins
    from localai.settings import parse_duration

    try:
        seconds = parse_duration(ttl)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="ttl") from exc
    created = pins.add_pin(session=session, entry=_full_id(entry), ttl=seconds)
    click.echo(f"pinned {'session ' + session if session else 'entry ' + str(created.entry)} until "
               f"{_iso(created.expires_at)}")


@cache.command()
@click.option("--session", default=None, help="Unpin this session id (as pinned with `cache pin --session`).")
@click.option("--entry", default=None, help="Unpin one entry, by id or id prefix from `cache ls`.")
@fail_cleanly
def unpin(session: str | None, entry: str | None) -> None:
    """Remove a pin (the entries stay, and can be evicted again)."""
    from localai.promptcache import pins

    removed = pins.remove_pin(session=session, entry=_full_id(entry))
    click.echo("unpinned" if removed else "no such pin")


@cache.command()
@click.argument("entry", required=False)
@click.option("--session", default=None, help="Remove every entry of this session.")
@click.option("--partition", default=None, help="Only within this partition (an API key's id covers its salted "
              "partitions); alone, remove all of its entries.")
@fail_cleanly
def rm(entry: str | None, session: str | None, partition: str | None) -> None:
    """Remove an entry (by id), a session's entries, or a partition's."""
    from localai.promptcache import admin

    within = _in_partition(partition)
    if entry or session:
        count = admin.remove_entries(entry=_full_id(entry), session=session, visible=within)
    else:
        count = admin.remove_entries(partition=partition)
    if not count and (entry or session):
        from localai.errors import NotFound

        what = f"session '{session}'" if session and not entry else f"id '{entry}'"
        raise NotFound(f"no cache entry has the {what}; `localai cache ls` lists them")
    click.echo(f"removed {count} entr{'y' if count == 1 else 'ies'}")


@cache.command()
@click.option("--older-than", default=None, help="Also remove unpinned entries unused for this long (30m, 12h, 7d).")
@click.option("--max-bytes", type=int, default=None, help="Evict down to this size (default: LOCALAI_CACHE_MAX_BYTES).")
@fail_cleanly
def prune(older_than: str | None, max_bytes: int | None) -> None:
    """Evict unpinned entries: old ones, then least recently used until under the quota."""
    from localai.errors import InvalidRequest
    from localai.promptcache import admin
    from localai.settings import Settings, parse_duration

    try:
        older = parse_duration(older_than) if older_than else None
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="older-than") from exc
    limit = max_bytes if max_bytes is not None else Settings().cache_max_bytes
    click.echo(f"removed {admin.prune(max_bytes=limit, older_than=older)} blocks and entries")


def _iso(stamp: float | None) -> str:
    if stamp is None:
        return ""
    return dt.datetime.fromtimestamp(stamp, dt.UTC).isoformat(timespec="seconds")


def _full_id(prefix: str | None) -> str | None:
    """Entries can be named by a unique prefix of their id, as `cache ls` prints them."""
    if not prefix:
        return None
    from localai.errors import InvalidRequest
    from localai.promptcache import admin

    matches = [e.id for e in admin.list_entries() if e.id.startswith(prefix)]
    if len(matches) > 1:
        raise InvalidRequest(f"entry id prefix '{prefix}' is ambiguous", param="entry")
    return matches[0] if matches else prefix
