"""Stored ``/v1/responses`` results: what ``previous_response_id`` continues and ``GET /v1/responses/{id}`` reads.

A response continued from another is stored as a link in a chain: its row holds only its own turn's input items
(``conversation``) and its response (with its output), after ``parent``'s. The conversation to continue is the chain
walked from its first row: each row's items, then its output. So a long agent session stores each turn once, not
the whole conversation again at every turn (a chain of N turns was O(N^2) bytes). A row without a parent holds its
whole conversation (the first turn, a compaction, a continuation of a response that was not stored).

A row is readable and continuable only with the key it was stored with (``owner``: the principal's id, "" for
the machine's owner and whenever keys are not distinct); another key gets the same 404 as a missing id.

Retention, at each save: rows unused for ``LOCALAI_RESPONSES_TTL`` go; beyond ``LOCALAI_RESPONSES_MAX`` rows, the
least recently used are folded into the rows that continue them (so no chain breaks) and go; beyond
``LOCALAI_RESPONSES_MAX_BYTES``, the least recently used rows go, the last turns of a chain before its first (a
conversation larger than the whole budget is not kept). Continuing a response, and storing one after it, marks its
whole chain used, so a row is never used later than the row it continues: eviction never leaves a chain without
its beginning.
"""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.requests import HTTPConnection

from localai.api.common import runtime_of
from localai.api.security import principal_of
from localai.errors import NotFound
from localai.models.registry import Registry
from localai.settings import Settings

# The rows of a chain, from ``?`` back to its first (depth 0 is the row asked for).
CHAIN = """WITH RECURSIVE chain(id, parent, depth) AS (
    SELECT id, parent, 0 FROM responses WHERE id = ?
    UNION ALL SELECT r.id, r.parent, chain.depth + 1 FROM responses r JOIN chain ON r.id = chain.parent
) """


class PreviousResponseNotFound(NotFound):
    code = "previous_response_not_found"


class ResponseStore:
    """The ``responses`` table for one caller (its key decides which rows it sees). Rows can be large, so every
    read and write runs off the event loop."""

    def __init__(self, request: HTTPConnection) -> None:
        self.registry = runtime_of(request).registry
        self.settings: Settings = request.app.state.settings
        self.owner = principal_of(request.scope)

    async def get(self, response_id: str) -> dict[str, Any]:
        return await self.registry.off_loop(lambda registry: _row(registry, response_id, self.owner))

    async def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The input items that led to a stored response, followed by its output: the history to continue. Marks
        its chain used."""
        return await self.registry.off_loop(lambda registry: _conversation(registry, response_id, self.owner))

    async def save(self, response: dict[str, Any], items: list[dict[str, Any]], conversation: list[dict[str, Any]],
                   parent: str | None) -> None:
        """Store ``response``: linked after ``parent`` with this turn's ``items`` when ``parent`` is stored (and
        this caller's), else with its whole ``conversation``; then apply the retention limits."""
        settings, owner = self.settings, self.owner

        def write(registry: Registry) -> None:
            db = registry.db
            with db.conn:
                linked = parent if parent and db.execute(
                    "SELECT 1 FROM responses WHERE id = ? AND owner = ?", [parent, owner]).fetchone() else None
                text = json.dumps(items if linked else conversation)
                body = json.dumps(response)
                now = time.time()
                db.execute("INSERT OR REPLACE INTO responses (id, created_at, model, previous_response_id, "
                           "conversation, response, parent, owner, bytes, last_used) VALUES (?,?,?,?,?,?,?,?,?,?)",
                           [response["id"], response["created_at"], response["model"],
                            response.get("previous_response_id"), text, body, linked, owner,
                            len(text.encode()) + len(body.encode()), now])
                if linked:
                    _touch(registry, linked, now)
                retain(registry, ttl=settings.responses_ttl, keep=settings.responses_max,
                       budget=settings.responses_max_bytes, now=now)

        await self.registry.off_loop(write)

    async def delete(self, response_id: str) -> None:
        """Remove a response; the responses that continue it keep their history (it is folded into them)."""
        def remove(registry: Registry) -> None:
            _row(registry, response_id, self.owner)
            with registry.db.conn:
                _fold_away(registry, response_id)

        await self.registry.off_loop(remove)


def _missing(response_id: str) -> PreviousResponseNotFound:
    return PreviousResponseNotFound(f"no stored response '{response_id[:100]}' (responses are stored unless 'store' "
                                    "is false, kept for LOCALAI_RESPONSES_TTL after their last use and within "
                                    "LOCALAI_RESPONSES_MAX and LOCALAI_RESPONSES_MAX_BYTES, and read only with the "
                                    "API key that stored them)", param="previous_response_id")


def _row(registry: Registry, response_id: str, owner: str) -> dict[str, Any]:
    rows = list(registry.db.query("SELECT * FROM responses WHERE id = ? AND owner = ?", [response_id, owner]))
    if not rows:
        raise _missing(response_id)
    return rows[0]


def _conversation(registry: Registry, response_id: str, owner: str) -> list[dict[str, Any]]:
    _row(registry, response_id, owner)
    rows = list(registry.db.query(CHAIN + "SELECT r.id, r.parent, r.conversation, r.response FROM chain "
                                  "JOIN responses r ON r.id = chain.id ORDER BY chain.depth DESC", [response_id]))
    if not rows or rows[0]["parent"] is not None:  # its first turns are gone: continuing would lose them
        raise PreviousResponseNotFound(f"the history of stored response '{response_id[:100]}' is no longer complete; "
                                       "send the whole conversation as input", param="previous_response_id")
    history: list[dict[str, Any]] = []
    for row in rows:
        history += json.loads(row["conversation"])
        history += json.loads(row["response"]).get("output", [])
    with registry.db.conn:
        _touch(registry, response_id, time.time())
    return history


def _touch(registry: Registry, response_id: str, now: float) -> None:
    """Mark a row and every row it continues as used now (a row is never used later than its parent)."""
    registry.db.execute(CHAIN + "UPDATE responses SET last_used = ? WHERE id IN (SELECT id FROM chain)",
                        [response_id, now])


def _fold_away(registry: Registry, response_id: str) -> None:
    """Delete a row, first prepending its items and output to the rows that continue it (linked to its parent
    instead), so their conversations stay whole."""
    db = registry.db
    row = next(db.query("SELECT conversation, response, parent FROM responses WHERE id = ?", [response_id]), None)
    if row is None:
        return
    children = list(db.query("SELECT id, conversation, response FROM responses WHERE parent = ?", [response_id]))
    if children:
        before = [*json.loads(row["conversation"]), *json.loads(row["response"]).get("output", [])]
        for child in children:
            text = json.dumps([*before, *json.loads(child["conversation"])])
            db.execute("UPDATE responses SET conversation = ?, parent = ?, bytes = ? WHERE id = ?",
                       [text, row["parent"], len(text.encode()) + len(child["response"].encode()), child["id"]])
    db.execute("DELETE FROM responses WHERE id = ?", [response_id])


def retain(registry: Registry, *, ttl: float, keep: int, budget: int, now: float) -> None:
    """The retention limits (the caller holds a transaction)."""
    db = registry.db
    db.execute("DELETE FROM responses WHERE last_used < ?", [now - ttl])  # its descendants are older still
    excess = db.execute("SELECT COUNT(*) FROM responses").fetchone()[0] - keep
    if excess > 0:
        for (victim,) in db.execute("SELECT id FROM responses ORDER BY last_used ASC, rowid ASC LIMIT ?",
                                    [excess]).fetchall():
            _fold_away(registry, victim)
    total = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM responses").fetchone()[0]
    if total > budget:
        doomed: list[str] = []
        for response_id, size in db.execute("SELECT id, bytes FROM responses ORDER BY last_used ASC, rowid DESC"):
            if total <= budget:
                break
            doomed.append(response_id)
            total -= size
        db.conn.executemany("DELETE FROM responses WHERE id = ?", [(response_id,) for response_id in doomed])
    # A row whose parent is gone (stored before chains were tracked, or a crash mid-retention) can never be
    # continued: it goes with everything after it.
    db.execute("""WITH RECURSIVE orphans(id) AS (
        SELECT id FROM responses WHERE parent IS NOT NULL AND parent NOT IN (SELECT id FROM responses)
        UNION SELECT r.id FROM responses r JOIN orphans o ON r.parent = o.id
    ) DELETE FROM responses WHERE id IN (SELECT id FROM orphans)""")
