"""Stored responses, in-process on the scripted engine: a ``previous_response_id`` chain stores each turn once, the
history it continues stays whole through retention and deletion, and the byte budget holds. The scripted engine
answers with the last ``[[say:...]]`` in its prompt, so a reply tells whether the first turn is still in the
history it was given."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from localai.settings import Settings
from tests.api.conftest import scripted_settings

BUDGET = 256 << 10


@pytest.fixture(scope="module")
def api_settings() -> Settings:
    return scripted_settings(responses_max=8, responses_max_bytes=BUDGET)


def respond(api: TestClient, text: str, previous: str | None = None, **extra: Any) -> dict[str, Any]:
    body = {"model": "smollm2", "input": text, "max_output_tokens": 8, **extra}
    if previous:
        body["previous_response_id"] = previous
    response = api.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def reply(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def rows(api_home: Path) -> list[tuple[str, str | None, int]]:
    with sqlite3.connect(api_home / "localai.db") as db:
        return db.execute("SELECT id, parent, bytes FROM responses ORDER BY rowid").fetchall()


def test_a_chain_stores_each_turn_once(api: TestClient, api_home: Path) -> None:
    before = {row[0] for row in rows(api_home)}
    turn = "lorem ipsum dolor sit amet " * 18  # ~500 bytes a turn: six fit the context (4096, in bytes here)
    previous = None
    for index in range(6):
        text = f"turn {index}: {turn}" + (" [[say:FIRST]]" if index == 0 else "")
        result = respond(api, text, previous)
        previous = result["id"]
    assert reply(result) == "FIRST"  # the first turn is in the history the sixth was given
    mine = [row for row in rows(api_home) if row[0] not in before]
    assert len(mine) == 6 and all(parent is not None for _, parent, _ in mine[1:])
    sizes = [size for _, _, size in mine]
    assert max(sizes[1:]) < 1.2 * min(sizes[1:])  # the sixth turn stores what the second did, not 5x its input


def test_beyond_the_row_limit_a_chains_oldest_turns_fold_into_the_next(api: TestClient, api_home: Path) -> None:
    previous = respond(api, "the start [[say:ORIGIN]]")["id"]
    for index in range(10):  # more turns than LOCALAI_RESPONSES_MAX (8): its first rows go
        result = respond(api, f"and then {index}", previous)
        previous = result["id"]
    assert len(rows(api_home)) <= 8
    assert reply(result) == "ORIGIN"
    assert reply(respond(api, "once more", previous)) == "ORIGIN"  # still whole


def test_deleting_a_response_keeps_the_ones_after_it_whole(api: TestClient) -> None:
    first = respond(api, "deleted later [[say:KEPT]]")["id"]
    second = respond(api, "second", first)["id"]
    assert api.delete(f"/v1/responses/{first}").status_code == 200
    assert api.get(f"/v1/responses/{first}").status_code == 404
    assert reply(respond(api, "third", second)) == "KEPT"


def test_the_byte_budget_holds_and_the_newest_stays(api: TestClient, api_home: Path) -> None:
    ids = [respond(api, f"independent {index} " + "x" * 40_000)["id"] for index in range(10)]
    assert sum(size for _, _, size in rows(api_home)) <= BUDGET
    assert api.get(f"/v1/responses/{ids[-1]}").status_code == 200
    assert api.get(f"/v1/responses/{ids[0]}").status_code == 404


def test_a_chain_whose_beginning_is_gone_is_a_clear_404(api: TestClient, api_home: Path) -> None:
    first = respond(api, "to be lost")["id"]
    second = respond(api, "after it", first)["id"]
    with sqlite3.connect(api_home / "localai.db") as db:  # as a crash mid-retention could leave it
        db.execute("DELETE FROM responses WHERE id = ?", [first])
    response = api.post("/v1/responses", json={"model": "smollm2", "input": "go on", "previous_response_id": second})
    assert response.status_code == 404 and "no longer complete" in response.text, response.text


def test_responses_stored_before_chains_still_continue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json
    from types import SimpleNamespace

    import sqlite_utils

    from localai.api import response_store
    from localai.models import db as database

    old = sqlite_utils.Database(tmp_path / "old.db")
    monkeypatch.setattr(database, "MIGRATIONS", database.MIGRATIONS[:3])  # the schema responses had before
    database.migrate(old)
    old["responses"].insert({"id": "resp_old", "created_at": 1_700_000_000, "model": "m", "previous_response_id": None,
                             "conversation": json.dumps([{"role": "user", "content": "hi"}]),
                             "response": json.dumps({"output": [{"type": "message", "content": "hello"}]})})
    monkeypatch.undo()
    database.migrate(old)
    [row] = old.query("SELECT parent, owner, bytes, last_used FROM responses")
    assert row["parent"] is None and row["owner"] == "" and row["bytes"] > 0 and row["last_used"] == 1_700_000_000
    history = response_store._conversation(SimpleNamespace(db=old), "resp_old", "")  # type: ignore[arg-type]
    assert history == [{"role": "user", "content": "hi"}, {"type": "message", "content": "hello"}]
