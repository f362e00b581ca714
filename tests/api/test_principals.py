"""Several API keys (a key file): each key's requests reuse prompt-cache prefixes only among themselves, a
``cache_salt`` partitions further, and ``/api/cache`` shows and removes a key's own entries only. In-process on the
scripted engine, whose prefix reuse is real (the serving loop and the store run as with a model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from localai.api.app import create_app
from localai.api.security import KeyRing, key_id
from localai.settings import Settings
from tests.api.conftest import scripted_settings

KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"
SECRET = "You are the vault's assistant. The vault's PIN is 4812; never say it. " * 3


@pytest.fixture(scope="module")
def api_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# one key per line\n{KEY_A}\n\n{KEY_B}\n")
    return scripted_settings(api_key_file=keys)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(api: TestClient, key: str, text: str, session: str, system: str = SECRET, **extra: Any) -> dict[str, Any]:
    response = api.post("/v1/chat/completions", headers={**auth(key), "x-session-id": session}, json={
        "model": "smollm2", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}], **extra})
    assert response.status_code == 200, response.text
    return {"cached": response.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
            "source": response.headers.get("x-localai-cache")}


def test_every_key_of_the_file_is_accepted_and_nothing_else(api: TestClient) -> None:
    assert api.get("/v1/models").status_code == 401
    assert api.get("/v1/models", headers=auth("key-c")).status_code == 401
    assert api.get("/v1/models", headers=auth(KEY_A)).status_code == 200
    assert api.get("/v1/models", headers={"x-api-key": KEY_B}).status_code == 200


def test_another_keys_guess_learns_nothing_and_the_same_key_reuses(api: TestClient) -> None:
    chat(api, KEY_A, "What is the PIN?", "victim-1")
    # each guess salted apart, so the attacker's guesses do not share prefixes among themselves either
    right = chat(api, KEY_B, "Is the PIN 4812?", "attacker-1", cache_salt="guess-1")
    wrong = chat(api, KEY_B, "Is the PIN 1234?", "attacker-2", cache_salt="guess-2")
    assert right["cached"] == wrong["cached"] == 0 and right["source"] == wrong["source"] == "miss"
    mine = chat(api, KEY_A, "Is the PIN 4812?", "victim-sub-agent")  # another session of the same key
    assert mine["cached"] > len(SECRET)  # reuse within a key is unchanged


def test_a_cache_salt_partitions_within_a_key(api: TestClient) -> None:
    system = "You keep the team's notes; the launch date is March 3rd. " * 3
    chat(api, KEY_A, "Salted question one.", "salt-1", system, cache_salt="team-blue")
    # unsalted or salted otherwise: another partition (at most the chat template's opening, from the key's others)
    assert chat(api, KEY_A, "Salted question two.", "salt-2", system)["cached"] < 30
    assert chat(api, KEY_A, "Salted question three.", "salt-3", system, cache_salt="team-red")["cached"] < 30
    blue = chat(api, KEY_A, "Salted question four.", "salt-4", system, cache_salt="team-blue")
    assert blue["cached"] > len(system)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/responses", {"input": "x"}),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}),
    ("/api/chat", {"stream": False, "messages": [{"role": "user", "content": "x"}]}),
    ("/api/generate", {"stream": False, "prompt": "x"}),
])
def test_every_dialect_takes_a_cache_salt_and_refuses_a_bad_one(api: TestClient, path: str,
                                                                 body: dict[str, Any]) -> None:
    good = api.post(path, headers=auth(KEY_A), json={"model": "smollm2", "cache_salt": "s1", **body})
    assert good.status_code == 200, good.text
    for bad in ("", "x" * 2000, 5):
        response = api.post(path, headers=auth(KEY_A), json={"model": "smollm2", "cache_salt": bad, **body})
        assert response.status_code == 400 and "cache_salt" in response.text, response.text


def test_the_cache_listing_shows_and_removes_only_the_callers_entries(api: TestClient) -> None:
    chat(api, KEY_A, "An entry of key A. " * 3, "listing-a")
    chat(api, KEY_B, "An entry of key B. " * 3, "listing-b")
    mine = api.get("/api/cache", headers=auth(KEY_A)).json()
    theirs = api.get("/api/cache", headers=auth(KEY_B)).json()
    assert mine["entries"] and theirs["entries"]
    assert all(e["partition"].split(".")[0] == key_id(KEY_A) for e in mine["entries"])
    assert all(e["partition"].split(".")[0] == key_id(KEY_B) for e in theirs["entries"])
    assert mine["stats"]["entries"] == len(mine["entries"])
    foreign = theirs["entries"][0]["id"]
    assert api.delete(f"/api/cache/{foreign}", headers=auth(KEY_A)).json() == {"removed": 0}
    assert api.post("/api/cache/pin", headers=auth(KEY_A), json={"entry": foreign}).status_code == 400
    assert api.post("/api/cache/prune", headers=auth(KEY_A), json={}).status_code == 403
    assert api.delete(f"/api/cache/{foreign}", headers=auth(KEY_B)).json() == {"removed": 1}


def test_keys_from_the_settings(tmp_path: Path) -> None:
    assert KeyRing.load("only", None).principal("only") == ""  # one key: every caller is the owner, as before
    both = KeyRing.load("k1", None)
    assert both.principal("k2") is None and not both.distinct
    keys = tmp_path / "keys"
    keys.write_text("k2\n# a comment\nk3\n")
    ring = KeyRing.load("k1", keys)
    assert ring.distinct and ring.principal("k3") == key_id("k3") and ring.principal("k4") is None
    assert key_id("k3") not in ("k3",) and len(key_id("k3")) == 16  # an id, never the key
    keys.write_text("# nothing but a comment\n")
    with pytest.raises(ValueError, match="holds no key"):
        KeyRing.load(None, keys)
    with pytest.raises(ValueError, match="LOCALAI_API_KEY_FILE"):
        create_app(scripted_settings(api_key_file=tmp_path / "missing"), None)  # type: ignore[arg-type]


def test_a_stored_response_is_read_and_continued_only_with_the_key_that_stored_it(api: TestClient) -> None:
    body = {"model": "smollm2", "input": "keep this [[say:MINE]]", "max_output_tokens": 4}
    stored = api.post("/v1/responses", headers=auth(KEY_A), json=body).json()["id"]
    assert api.get(f"/v1/responses/{stored}", headers=auth(KEY_B)).status_code == 404
    continued = api.post("/v1/responses", headers=auth(KEY_B),
                         json={**body, "input": "go on", "previous_response_id": stored})
    assert continued.status_code == 404 and "previous_response_not_found" in continued.text
    assert api.delete(f"/v1/responses/{stored}", headers=auth(KEY_B)).status_code == 404
    with api.websocket_connect("ws://localhost/v1/responses", headers=auth(KEY_B)) as socket:
        socket.send_json({"type": "response.create", **body, "previous_response_id": stored})
        assert socket.receive_json()["status"] == 404
    assert api.get(f"/v1/responses/{stored}", headers=auth(KEY_A)).status_code == 200
    mine = api.post("/v1/responses", headers=auth(KEY_A),
                    json={**body, "input": "go on", "previous_response_id": stored})
    assert mine.status_code == 200, mine.text


def test_health_without_a_key_says_only_ok(api: TestClient) -> None:
    assert api.get("/health").json() == {"status": "ok"}
    assert api.get("/health", headers=auth("wrong")).json() == {"status": "ok"}
    full = api.get("/health", headers=auth(KEY_B)).json()
    assert full["status"] == "ok" and "version" in full and "loaded_models" in full


def test_a_remembered_context_cut_never_reaches_another_keys_conversation(api: TestClient) -> None:
    """Key A's over-long conversation is fitted (messages dropped) and the cut remembered for its next turn; key B
    opening the same way with a short conversation is not cut (its middle reaches the model, and B learns nothing
    of what A sent)."""
    created = api.post("/api/create", headers=auth(KEY_A),
                       json={"model": "scripted-fit-1k", "modelfile": "FROM smollm2\nPARAMETER num_ctx 1024\n"})
    assert created.status_code == 200, created.text
    opening = [{"role": "system", "content": "You fit conversations."}, {"role": "user", "content": "Read this."},
               {"role": "assistant", "content": "Send it."}]

    def ask(key: str, middle: str) -> dict[str, str]:
        messages = [*opening, {"role": "user", "content": middle}, {"role": "assistant", "content": "Read."},
                    {"role": "user", "content": "What did it say?"}]
        response = api.post("/v1/chat/completions", headers=auth(key),
                            json={"model": "scripted-fit-1k", "messages": messages, "max_tokens": 4})
        assert response.status_code == 200, response.text
        return dict(response.headers)

    assert "x-localai-context-fitted" in ask(KEY_A, "A's long document. " * 200)
    assert "x-localai-context-fitted" not in ask(KEY_B, "B's short note.")
    assert "x-localai-context-fitted" not in ask(KEY_A, "A's short note.")  # nor A's other conversation


def test_a_key_removes_only_its_own_session_pins_and_learns_no_names(api: TestClient) -> None:
    """Key B can neither unpin key A's session nor tell a pinned session name from an unknown one; its pin of the
    same name is its own and leaves A's in force."""
    from localai.promptcache.pins import load_pins

    chat(api, KEY_A, "An entry to keep. " * 3, "pinned-by-a")
    assert api.post("/api/cache/pin", headers=auth(KEY_A), json={"session": "pinned-by-a"}).status_code == 200
    foreign = api.request("DELETE", "/api/cache/pin", headers=auth(KEY_B), json={"session": "pinned-by-a"})
    unknown = api.request("DELETE", "/api/cache/pin", headers=auth(KEY_B), json={"session": "pinned-by-nobody"})
    assert foreign.status_code == unknown.status_code == 200 and foreign.json() == unknown.json() == {"removed": False}
    short = api.post("/api/cache/pin", headers=auth(KEY_B), json={"session": "pinned-by-a", "ttl": 1})
    assert short.status_code == 200
    assert any(p.session == "pinned-by-a" and p.owner == key_id(KEY_A) and p.expires_at > short.json()["expires_at"]
               for p in load_pins())  # B's short pin did not replace A's
    mine = api.get("/api/cache", headers=auth(KEY_A)).json()["entries"]
    assert any(e["session"] == "pinned-by-a" and e["pinned_until"] for e in mine)
    removed = api.request("DELETE", "/api/cache/pin", headers=auth(KEY_A), json={"session": "pinned-by-a"})
    assert removed.json() == {"removed": True}
