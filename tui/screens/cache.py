"""Cache: the persisted prompt cache per model (entries, sessions, bytes, hit ratio, tokens restored), its
entries, pins and pruning."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import ClassVar

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import DataTable, Footer, Label, Static

from localai.client import human_size

from ..api import CacheEntry, DaemonMetrics, InstalledModel, duration
from .base import LocalAIScreen, selected_key
from .dialogs import AskScreen, ConfirmScreen


@dataclass
class ModelCacheRow:
    """One line of the per-model table: the disk side (entries) joined with the counters of /metrics."""

    model: str
    entries: int = 0
    sessions: set[str] = field(default_factory=set)
    bytes: int = 0


def model_namer(installed: list[InstalledModel], preferred: Iterable[str]) -> Callable[[str], str]:
    """Names the same model one way: ``smollm2`` and its alias ``smollm2:latest`` become ``smollm2:135m``
    when that is the name the daemon's metrics use (aliases share the model's digest)."""
    by_name = {model.name: model.digest for model in installed}
    ordered = list(preferred)
    preferred_names = set(ordered)
    by_digest: dict[str, str] = {}
    for name in ordered:
        if by_name.get(name):
            by_digest.setdefault(by_name[name], name)

    def name_of(model: str) -> str:
        last = model.rsplit("/", 1)[-1]
        full = model if ":" in last else f"{model}:latest"
        if full in preferred_names:  # a model of its own (a persona shares its base's digest): its own name
            return full
        digest = by_name.get(full)
        return by_digest.get(digest, full) if digest else model

    return name_of


def per_model(entries: list[CacheEntry], session_models: dict[str, str],
              metrics: DaemonMetrics) -> list[ModelCacheRow]:
    """Group entries by model: the one the daemon names (its session's, or its cache folder's only model), else
    the model of the conversation that made it, else the models that share its folder (models served by one
    worker share its cache), else its fingerprint. ``session_models`` and entries' models must already be named
    as the metrics name them."""
    def named(entry: CacheEntry) -> str | None:
        return entry.model or (session_models.get(entry.session) if entry.session else None)

    folder: dict[str, str] = {}  # a folder no daemon names, named after a conversation that used it
    for entry in entries:
        if not entry.models and (model := named(entry)):
            folder.setdefault(entry.fingerprint, model)
    rows: dict[str, ModelCacheRow] = {}
    for entry in entries:
        label = (named(entry) or " + ".join(entry.models) or folder.get(entry.fingerprint)
                 or f"fingerprint {entry.fingerprint[:10]}")
        row = rows.setdefault(label, ModelCacheRow(label))
        row.entries += 1
        row.bytes += entry.bytes
        if entry.session:
            row.sessions.add(entry.session)
    for model in metrics.models:
        rows.setdefault(model, ModelCacheRow(model))
    return sorted(rows.values(), key=lambda row: row.model)


class CacheScreen(LocalAIScreen):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("p", "pin", "Pin session"),
        Binding("u", "unpin", "Unpin"),
        Binding("d", "remove", "Remove entry"),
        Binding("x", "prune", "Prune"),
        Binding("ctrl+r", "refresh", "Refresh"),
        Binding("escape", "app.switch_mode('home')", "Home", show=False),
    ]

    def compose(self) -> ComposeResult:
        yield Label("Prompt cache per model", classes="section-title")
        yield DataTable(id="cache-models", cursor_type="row", zebra_stripes=True)
        yield Static(id="cache-summary")
        yield Label("Entries (p pins the highlighted entry's session)", classes="section-title")
        yield DataTable(id="cache-entries", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#cache-models", DataTable).add_columns(
            "MODEL", "ENTRIES", "SESSIONS", "ON DISK", "PROMPT TOKENS", "FROM CACHE", "HIT RATIO", "RESTORES",
            "TOKENS RESTORED")
        self.query_one("#cache-entries", DataTable).add_columns(
            "ID", "KIND", "TOKENS", "SIZE", "SESSION", "LAST USED", "PINNED")
        self.entries: dict[str, CacheEntry] = {}
        if self.tui.live_refresh:
            self.set_interval(max(self.tui.live_refresh, 3.0), self._tick)

    def on_screen_resume(self) -> None:
        self.action_refresh()

    def _tick(self) -> None:
        if self.is_current and not self.busy("refresh"):
            self.action_refresh()

    def action_refresh(self) -> None:
        self.refresh_cache()

    @work(exclusive=True, group="refresh", exit_on_error=False)
    async def refresh_cache(self) -> None:
        await self.tui.ready()
        stats, entries = await self.api.cache()
        metrics = await self.api.metrics()
        name_of = model_namer(await self.api.models(with_details=False), metrics.models)
        conversations = {s.id: s for s in self.tui.store.summaries()}
        session_models = {key: name_of(summary.model) for key, summary in conversations.items() if summary.model}
        # the daemon names entries by their models' own names, as its metrics do: only conversations' names (an alias
        # the user picked, `smollm2`) go through name_of; two models with one digest (personas) stay two
        entries = [replace(entry, model=name_of(entry.model)) if entry.model and not entry.models else entry
                   for entry in entries]
        self.entries = {entry.id: entry for entry in entries}

        models = self.query_one("#cache-models", DataTable)
        models.clear()
        for row in per_model(entries, session_models, metrics):
            counters = metrics.models.get(row.model)
            ratio = counters.token_hit_ratio if counters else None
            prompt = (counters.prompt_cached + counters.prompt_computed) if counters else 0
            models.add_row(row.model, str(row.entries), str(len(row.sessions)), human_size(row.bytes),
                           f"{prompt:.0f}", f"{counters.prompt_cached:.0f}" if counters else "",
                           "" if ratio is None else f"{ratio:.0%}", f"{counters.hits:.0f}" if counters else "",
                           f"{counters.tokens_restored:.0f}" if counters else "", key=row.model)

        table = self.query_one("#cache-entries", DataTable)
        selected = selected_key(table)
        table.clear()
        now = self.tui.clock().timestamp()
        for entry in sorted(entries, key=lambda e: -e.last_used):
            session = entry.session or ""
            if session in conversations:
                session = f"{conversations[session].title} ({session[:8]})"
            pinned = "" if not entry.pinned_until else f"{duration(max(0.0, entry.pinned_until - now))} left"
            table.add_row(entry.id[:12], entry.kind, str(entry.tokens), human_size(entry.bytes), session,
                          _ago(entry.last_used, now), pinned, key=entry.id)
        if selected in self.entries:
            table.move_cursor(row=table.get_row_index(selected))
        self.query_one("#cache-summary", Static).update(
            f"{plural(stats.get('entries', 0), 'entry', 'entries')} · {human_size(stats.get('bytes', 0))} on disk · "
            f"{plural(stats.get('sessions', 0), 'session')} · {plural(stats.get('pins', 0), 'pin')}\n"
            "[dim]hit ratio: prompt tokens not computed (live or restored); restores: prefixes read from RAM or "
            "disk[/dim]")

    def _selected_entry(self) -> CacheEntry | None:
        key = selected_key(self.query_one("#cache-entries", DataTable))
        return self.entries.get(key) if key else None

    def action_pin(self) -> None:
        entry = self._selected_entry()
        if entry is None:
            self.notify("Highlight an entry first", severity="warning")
            return

        def answered(ttl: str | None) -> None:
            if ttl and entry is not None:
                self.pin(entry, ttl)

        what = f"session {entry.session[:8]}" if entry.session else f"entry {entry.id[:12]}"
        self.app.push_screen(AskScreen(f"Pin {what} for how long? (30m, 2h, 7d)", value="1h"), answered)

    @work(group="pin", exit_on_error=False)
    async def pin(self, entry: CacheEntry, ttl: str) -> None:
        if entry.session:
            await self.api.pin(session=entry.session, ttl=ttl)
        else:
            await self.api.pin(entry=entry.id, ttl=ttl)
        self.notify(f"Pinned for {ttl}: never evicted until then")
        self.refresh_cache()

    @work(group="pin", exit_on_error=False)
    async def action_unpin(self) -> None:
        entry = self._selected_entry()
        if entry is None:
            return
        removed = await self.api.unpin(session=entry.session) if entry.session else False
        removed = await self.api.unpin(entry=entry.id) or removed
        self.notify("Unpinned" if removed else "That entry was not pinned")
        self.refresh_cache()

    def action_remove(self) -> None:
        entry = self._selected_entry()
        if entry is None:
            return

        def confirmed(yes: bool | None) -> None:
            if yes and entry is not None:
                self.remove_entry(entry.id)

        self.app.push_screen(ConfirmScreen(f"Remove entry {entry.id[:12]}? (it is recomputed when needed)"),
                             confirmed)

    @work(group="remove", exit_on_error=False)
    async def remove_entry(self, entry_id: str) -> None:
        count = await self.api.remove_entry(entry_id)
        self.notify(f"Removed {plural(count, 'entry', 'entries')}")
        self.refresh_cache()

    def action_prune(self) -> None:
        def confirmed(yes: bool | None) -> None:
            if yes:
                self.prune()

        self.app.push_screen(ConfirmScreen("Prune the cache down to its quota (LOCALAI_CACHE_MAX_BYTES)? "
                                           "Pinned entries stay."), confirmed)

    @work(group="prune", exit_on_error=False)
    async def prune(self) -> None:
        count = await self.api.prune()
        self.notify(f"Pruned {plural(count, 'entry', 'entries')}")
        self.refresh_cache()


def _ago(stamp: float, now: float) -> str:
    if not stamp:
        return ""
    seconds = max(0.0, now - stamp)
    return "just now" if seconds < 5 else f"{duration(seconds)} ago"


def plural(count: int, one: str, many: str | None = None) -> str:
    return f"{count} {one if count == 1 else many or one + 's'}"
