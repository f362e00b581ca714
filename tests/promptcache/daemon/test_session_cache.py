"""The persisted prompt cache through the real daemon: restart, sharing, corruption."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tests.conftest import Daemon, cached, chat, corrupt_cache_files, start_daemon

SYSTEM = "You are a careful coding assistant. " + "Follow the project's conventions and explain briefly. " * 12


def test_resume_after_restart_is_cached_and_gives_the_same_greedy_output(tmp_path: Path, smollm2_path: Path) -> None:
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a linked list?"}]
    with start_daemon(tmp_path / "home") as daemon:
        first = chat(daemon, turn1)
    turn2 = [*turn1, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And a queue?"}]
    with start_daemon(tmp_path / "home") as daemon:  # a new daemon and worker: only the disk remembers
        resumed = chat(daemon, turn2)
    assert cached(resumed) >= first["usage"]["prompt_tokens"] - 1
    with start_daemon(tmp_path / "nocache", cache_max_bytes="0") as baseline:
        fresh = chat(baseline, turn2)
    assert cached(fresh) == 0
    assert resumed["choices"][0]["message"]["content"] == fresh["choices"][0]["message"]["content"]


def test_a_second_session_reuses_the_shared_system_prompt(fresh_daemon: Daemon) -> None:
    first = chat(fresh_daemon, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Task A"}],
                 prompt_cache_key="agent-a")
    second = chat(fresh_daemon, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Task B"}],
                  prompt_cache_key="agent-b")
    assert cached(first) == 0
    assert cached(second) > 100  # the system prompt was computed once


def test_corrupt_cache_files_are_recomputed_not_served(tmp_path: Path, smollm2_path: Path) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}]
    with start_daemon(tmp_path / "home") as daemon:
        expected = chat(daemon, messages)
    assert corrupt_cache_files(tmp_path / "home")
    with start_daemon(tmp_path / "home") as daemon:
        again = chat(daemon, messages)
        assert cached(again) == 0
        assert again["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
        assert "dropping damaged cache block" in (tmp_path / "home" / "logs" / "workers.log").read_text()


def long_conversation(turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": SYSTEM}]
    for index in range(turns):
        messages.append({"role": "user", "content": f"Step {index}: " + "read the file and report. " * 40})
        messages.append({"role": "assistant", "content": f"Done with step {index}. " + "All fine. " * 30})
    messages.append({"role": "user", "content": "FINAL QUESTION: what is 2+2?"})
    return messages


def small_context_model(daemon: Daemon, name: str = "small", extra: str = "") -> str:
    """A 2,048-token copy of smollm2, so fitted prompts stay quick to prefill on a CPU."""
    with daemon.http() as http:
        created = http.post("/api/create", json={"model": name,
                                                 "modelfile": f"FROM smollm2\nPARAMETER num_ctx 2048\n{extra}"})
    assert created.status_code == 200, created.text
    return name


def test_an_over_long_conversation_is_fitted_keeps_the_last_message_and_keeps_caching(fresh_daemon: Daemon) -> None:
    model = small_context_model(fresh_daemon)
    messages = long_conversation(12)  # about 4,500 tokens against a 2,048-token context
    with fresh_daemon.http() as http:
        first = http.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 8})
        assert first.status_code == 200, first.text
        fitted = first.headers["x-localai-context-fitted"]
        assert "dropped_messages=" in fitted and "dropped_messages=0" not in fitted
        assert first.json()["usage"]["prompt_tokens"] < 2048
        # the next turn of the same conversation reuses the same cut, so its prefix is cached
        messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And 3+3?"}]
        second = http.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 8})
        assert second.status_code == 200
        usage = second.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"] * 0.8
        # the last user message always survives: a model asked to repeat it can see it
        echo = http.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 30, "temperature": 0,
            "messages": [*long_conversation(12)[:-1], {"role": "user", "content": "Repeat exactly: PURPLE-ELEPHANT"}],
        })
        assert echo.status_code == 200 and echo.headers.get("x-localai-context-fitted")


def test_fitting_off_gives_a_context_error_and_caching_still_works(fresh_daemon: Daemon) -> None:
    with fresh_daemon.http() as http:
        refused = http.post("/v1/chat/completions", json={
            "model": small_context_model(fresh_daemon), "messages": long_conversation(12), "max_tokens": 8,
            "fit_context": False})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "context_length_exceeded" and "2048" in error["message"]
        short = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
        chat(fresh_daemon, short, fit_context=False)
        again = chat(fresh_daemon, short, fit_context=False)
        assert cached(again) > 100


def test_fitting_can_be_turned_off_in_a_modelfile(fresh_daemon: Daemon) -> None:
    model = small_context_model(fresh_daemon, "strict", "PARAMETER fit_context false\n")
    with fresh_daemon.http() as http:
        refused = http.post("/v1/chat/completions", json={
            "model": model, "messages": long_conversation(12), "max_tokens": 8})
        assert refused.status_code == 400 and "fitting is off" in refused.json()["error"]["message"]


def test_metrics_count_cache_work(fresh_daemon: Daemon) -> None:
    shared = [{"role": "system", "content": SYSTEM}]
    chat(fresh_daemon, [*shared, {"role": "user", "content": "A"}], prompt_cache_key="a")
    chat(fresh_daemon, [*shared, {"role": "user", "content": "B"}], prompt_cache_key="b")
    with fresh_daemon.http() as http:
        text = http.get("/metrics").text

    def value(name: str) -> float:
        lines = [line for line in text.splitlines() if line.startswith(name) and not line.startswith("#")]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    assert value("localai_prompt_cache_hits_total") >= 1
    assert value("localai_prompt_cache_tokens_restored_total") > 100
    assert value("localai_prompt_tokens_cached_total") > 100
    assert value("localai_prompt_tokens_computed_total") > 100
    assert value("localai_requests_total") == 2
    assert value("localai_loaded_models") == 1


def test_three_interleaved_sessions_each_keep_their_own_history(fresh_daemon: Daemon) -> None:
    conversations = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Task {i}"}]
                     for i in range(3)]
    for turn in range(3):
        for index, messages in enumerate(conversations):
            result = chat(fresh_daemon, messages, prompt_cache_key=f"s{index}")
            if turn > 0:  # everything but the newest turn was cached, whatever ran in between
                assert cached(result) >= result["usage"]["prompt_tokens"] - 40
            messages += [{"role": "assistant", "content": result["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"Next step {turn}"}]


def test_a_worker_killed_during_a_cache_write_leaves_nothing_bad(tmp_path: Path, smollm2_path: Path) -> None:
    import os
    import signal

    messages = [{"role": "system", "content": SYSTEM * 3}, {"role": "user", "content": "Hello"}]
    with start_daemon(tmp_path / "home") as daemon:
        expected = chat(daemon, messages)
        with daemon.http() as http:
            pid = http.get("/api/ps").json()["models"][0]["pid"]
        os.kill(pid, signal.SIGKILL)  # right after the response: the entry is likely being written
    cache_dir = tmp_path / "home" / "cache"
    with start_daemon(tmp_path / "home") as daemon:
        again = chat(daemon, messages)
        assert again["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
        assert not list(cache_dir.rglob(".tmp-*"))
        from localai.promptcache.blocks import read_block

        for path in cache_dir.rglob("*.blk"):  # whatever survived is whole
            read_block(path, with_payload=True)


def test_system_prompt_is_stored_as_its_own_shared_entry_and_the_api_manages_pins(fresh_daemon: Daemon) -> None:
    chat(fresh_daemon, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "One"}],
         prompt_cache_key="first")
    with fresh_daemon.http() as http:
        for _ in range(100):  # the conversation's entry is saved after its reply is prefilled, just after the response
            kinds = {e["kind"] for e in http.get("/api/cache").json()["entries"]}
            if kinds == {"system", "history"}:
                break
            time.sleep(0.05)
        assert kinds == {"system", "history"}
        pinned = http.post("/api/cache/pin", json={"session": "first", "ttl": "10m"})
        assert pinned.status_code == 200 and pinned.json()["session"] == "first"
        assert any(e["pinned_until"] for e in http.get("/api/cache").json()["entries"])
        bad = http.post("/api/cache/pin", json={"ttl": "10m"})
        assert bad.status_code == 400
        assert http.request("DELETE", "/api/cache/pin", json={"session": "first"}).json()["removed"] is True


def test_claude_codes_per_request_billing_line_does_not_cost_the_prefix(daemon: Daemon) -> None:
    """Claude Code started without `localai launch` puts a billing line with a per-request hash first in its
    system prompt (llama.cpp #20623, Ollama #14918): the daemon drops it, so the next request reuses everything."""

    def ask(cch: str) -> dict[str, int]:
        body = {"model": "smollm2", "max_tokens": 4, "temperature": 0, "system": [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.170.a1b; cc_entrypoint=cli; "
                                     f"cch={cch};"},
            {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "What is a stack?"}]}
        with daemon.http() as http:
            response = http.post("/v1/messages", json=body, headers={"X-Claude-Code-Session-Id": "billing-line"})
        assert response.status_code == 200, response.text
        usage: dict[str, int] = response.json()["usage"]
        return usage

    ask("3fa1c")
    second = ask("9d04e")  # only the hash changed
    total = second["input_tokens"] + second["cache_read_input_tokens"]
    assert second["cache_read_input_tokens"] >= total - 2, second  # before: ~25 tokens, up to the hash
    with daemon.http() as http:  # and the model never sees the line
        counted = [http.post("/v1/messages/count_tokens", json={"model": "smollm2", "system": system, "messages": [
            {"role": "user", "content": "hi"}]}).json()["input_tokens"]
            for system in ("x-anthropic-billing-header: cch=1;\nBe brief.", "Be brief.")]
    assert counted[0] == counted[1]


def poll_divergences(daemon: Daemon, session: str, count: int) -> list[dict[str, Any]]:
    """The recorded divergences of a session, once ``count`` are there (they are written just after admission)."""
    found: list[dict[str, Any]] = []
    for _ in range(100):
        listed = daemon.cli("cache", "diverged", "--json")
        assert listed.returncode == 0, listed.stderr
        found = [d for d in json.loads(listed.stdout) if d["session"] == session]
        if len(found) >= count:
            break
        time.sleep(0.1)
    return found


PATH = {"type": "object", "properties": {"path": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} a file", "parameters": PATH}}
         for name in ("read", "write")]


def test_a_prompt_that_parts_from_its_session_is_diagnosed_and_shown(daemon: Daemon) -> None:
    """Replayed turns of one session: tools sent in another order, then a date changed in the system prompt. Each
    is logged and listed by `localai cache diverged` with the token where it parted and the cause."""
    dated = "Today is 2026-11-23. " + SYSTEM
    first = [{"role": "system", "content": dated}, {"role": "user", "content": "What is a queue?"}]
    later = [*first, {"role": "assistant", "content": "A queue is FIFO."}, {"role": "user", "content": "And a stack?"}]
    chat(daemon, first, tools=TOOLS, max_tokens=2, prompt_cache_key="parting")
    chat(daemon, later, tools=TOOLS[::-1], max_tokens=2, prompt_cache_key="parting")
    redated = [{"role": "system", "content": dated.replace("23", "24")}, *later[1:]]
    third = chat(daemon, redated, tools=TOOLS[::-1], max_tokens=2, prompt_cache_key="parting")
    found = poll_divergences(daemon, "parting", 2)
    assert [d["cause"] for d in found] == ["tools reordered", "system prompt changed"], found
    reordered, redated_entry = found
    assert 0 < reordered["offset_tokens"] < reordered["previous_tokens"] and reordered["early"]
    assert 0 < redated_entry["offset_tokens"] < 20, redated_entry  # the date is among the first tokens
    assert "became '4. You are a careful" in redated_entry["detail"]
    assert cached(third) <= redated_entry["offset_tokens"] + 1  # the cache could not reuse what came after
    shown = daemon.cli("cache", "diverged")
    assert shown.returncode == 0 and "tools reordered" in shown.stdout and "parting" in shown.stdout
    assert "localai cache diverged" in daemon.cli("cache", "ls").stdout
    assert "parts from its last one at token" in daemon.log()
    assert any(d["session"] == "parting" for d in daemon.get("/api/cache").json()["divergences"])
    with open(daemon.home / "cache" / "divergences.jsonl", "a") as handle:  # a damaged record is skipped
        handle.write("{damaged\n")
    assert len(poll_divergences(daemon, "parting", 2)) == 2


def test_a_reminder_the_template_moves_to_the_front_does_not_cost_the_prefix(daemon: Daemon) -> None:
    """A template that joins every system message into the system prompt (as DeepSeek's do) would put an agent's
    mid-conversation reminder before the whole conversation; localai keeps it in place, so the next turn reuses
    everything the last one computed, and no divergence is recorded."""
    from tests.runtime.test_prompt import HOISTING

    with daemon.http() as http:
        created = http.post("/api/create", json={"model": "hoisting",
                                                 "modelfile": f'FROM smollm2\nTEMPLATE """{HOISTING}"""'})
    assert created.status_code == 200, created.text
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a queue?"}]
    reply = chat(daemon, first, model="hoisting", max_tokens=4, prompt_cache_key="reminded")
    answer = reply["choices"][0]["message"]["content"]
    later = [*first, {"role": "assistant", "content": answer},
             {"role": "developer", "content": "Reminder: the tests live in tests/."},
             {"role": "user", "content": "And a stack?"}]
    second = chat(daemon, later, model="hoisting", max_tokens=4, prompt_cache_key="reminded")
    assert cached(second) >= reply["usage"]["prompt_tokens"], second["usage"]
    # A barrier, not a sleep (an absence after 0.5 s passed whenever recording took longer): a third turn that does
    # part, at its system prompt. Its record is written after the second turn's would have been (that one's token
    # count went to the worker first), so once it is there the only early record must be its own.
    parted = [{"role": "system", "content": "You are a different agent."}, first[1]]
    chat(daemon, parted, model="hoisting", max_tokens=4, prompt_cache_key="reminded")
    early = [d for d in poll_divergences(daemon, "reminded", 1) if d["early"]]
    assert len(early) == 1 and early[0]["offset_chars"] < len(SYSTEM), early  # the barrier's, at the system prompt


def test_anthropic_cache_control_pins_the_prefix_for_its_ttl(daemon: Daemon) -> None:
    """Breakpoints pin the conversation's entry and the shared system entry for their TTL (the longest one sent);
    a malformed breakpoint is a 400 naming it."""
    body: dict[str, Any] = {
        "model": "smollm2", "max_tokens": 2, "temperature": 0,
        "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is a heap?",
                                                   "cache_control": {"type": "ephemeral"}}]}]}
    with daemon.http() as http:
        answered = http.post("/v1/messages", json=body, headers={"X-Claude-Code-Session-Id": "pinned-cc"})
        assert answered.status_code == 200, answered.text
        entries: list[dict[str, Any]] = []
        # the conversation's entry is saved once its reply is prefilled, by the writer thread, which on this shared
        # daemon may still be writing earlier tests' blocks: a full suite once took longer than 5 s here
        for _ in range(600):
            entries = http.get("/api/cache").json()["entries"]
            if any(e["session"] == "pinned-cc" for e in entries):
                break
            time.sleep(0.05)
        mine = [e for e in entries if e["session"] == "pinned-cc"]
        system = [e for e in entries if e["kind"] == "system" and e["pinned_until"]]
        assert mine and all(e["pinned_until"] > time.time() + 3000 for e in mine), mine
        assert system and max(e["pinned_until"] for e in system) > time.time() + 3000
        for control, param in (({"type": "forever"}, "system.0.cache_control"),
                               ({"type": "ephemeral", "ttl": "2h"}, "system.0.cache_control.ttl")):
            bad = {**body, "system": [{"type": "text", "text": "x", "cache_control": control}]}
            refused = http.post("/v1/messages", json=bad)
            assert refused.status_code == 400, refused.text
            assert param in refused.text, refused.text


def test_a_stop_right_after_the_replies_keeps_every_sessions_kept_reply(tmp_path: Path, smollm2_path: Path) -> None:
    """SIGTERM as soon as two sessions' replies are out: the replies' follow-up prefills and saves still finish,
    so after a restart each session's next turn reuses as many tokens as it does without a restart."""
    from concurrent.futures import ThreadPoolExecutor

    def turn1(session: int) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Session {session}: what is a linked list? " + "Be brief. " * 20}]

    def both(daemon: Daemon, conversations: list[list[dict[str, str]]]) -> list[dict[str, Any]]:
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda pair: chat(daemon, pair[1], max_tokens=60, prompt_cache_key=f"s{pair[0]}"),
                                 enumerate(conversations)))

    def turn2(first: list[dict[str, Any]]) -> list[list[dict[str, str]]]:
        return [[*turn1(s), {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And a queue?"}] for s, reply in enumerate(first)]

    with start_daemon(tmp_path / "steady") as daemon:
        steady_first = both(daemon, [turn1(0), turn1(1)])
        steady = both(daemon, turn2(steady_first))
    with start_daemon(tmp_path / "home") as daemon:
        first = both(daemon, [turn1(0), turn1(1)])
    # the context manager's stop is the SIGTERM, sent the moment both replies are in
    with start_daemon(tmp_path / "home") as daemon:
        resumed = both(daemon, turn2(first))
    for session in range(2):
        # greedy: the same replies, so the two runs' second turns are the same prompts
        assert first[session]["choices"][0]["message"] == steady_first[session]["choices"][0]["message"]
        assert resumed[session]["usage"]["prompt_tokens"] == steady[session]["usage"]["prompt_tokens"]
        assert cached(steady[session]) > turn_tokens(first[session])  # the kept reply is part of what is reused
        assert cached(resumed[session]) >= cached(steady[session]) - 1, (session, resumed, steady)


def turn_tokens(reply: dict[str, Any]) -> int:
    """A first turn's prompt and reply tokens."""
    return int(reply["usage"]["prompt_tokens"]) + int(reply["usage"]["completion_tokens"]) - 8


def test_a_stop_signalled_to_the_whole_process_group_keeps_the_last_turn(tmp_path: Path, smollm2_path: Path) -> None:
    """SIGTERM to the daemon and its workers together (Ctrl-C in a terminal, ``kill -- -PGID``) within 50 ms of
    the last reply's final byte, sessions one after another: the last turn's save (its prompt and kept reply) still
    reaches the disk, so after a restart the next turn reuses as much as without the stop. Before, the workers died
    on the signal with the turn's save queued, and the session fell back to the turn before."""
    import os
    import signal

    import httpx

    def turn1(session: int) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Session {session}: what is a linked list? " + "Be brief. " * 20}]

    def ask(daemon: Daemon, messages: list[dict[str, str]], session: int, *, stop: bool = False) -> dict[str, Any]:
        body = {"model": "smollm2", "messages": messages, "max_tokens": 40, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "prompt_cache_key": f"s{session}"}
        text, usage = "", {}
        with httpx.Client(base_url=daemon.base_url, timeout=300) as http, \
                http.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    if stop:  # the final byte is in: signal the whole group at once
                        os.killpg(daemon.process.pid, signal.SIGTERM)
                    break
                if line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    text += "".join(c["delta"].get("content") or "" for c in chunk.get("choices", []))
        return {"text": text, "usage": usage}

    def second(first: dict[str, Any], session: int) -> list[dict[str, str]]:
        return [*turn1(session), {"role": "assistant", "content": first["text"]},
                {"role": "user", "content": "A queue?"}]

    def third(first: dict[str, Any], reply: dict[str, Any], session: int) -> list[dict[str, str]]:
        return [*second(first, session), {"role": "assistant", "content": reply["text"]},
                {"role": "user", "content": "And a stack?"}]

    with start_daemon(tmp_path / "steady") as daemon:
        s1, _ = ask(daemon, turn1(1), 1), ask(daemon, turn1(2), 2)
        t2 = ask(daemon, second(s1, 1), 1)
        steady = ask(daemon, third(s1, t2, 1), 1)
    daemon = start_daemon(tmp_path / "home", own_group=True)
    s1, _ = ask(daemon, turn1(1), 1), ask(daemon, turn1(2), 2)
    t2 = ask(daemon, second(s1, 1), 1, stop=True)
    assert daemon.process.wait(timeout=60) == 0
    with start_daemon(tmp_path / "home") as daemon:
        resumed = ask(daemon, third(s1, t2, 1), 1)
    assert resumed["text"] == steady["text"]  # greedy: the same conversation
    turn2_tokens = t2["usage"]["prompt_tokens"]
    reused = resumed["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert reused > turn2_tokens  # the kept reply is part of what is reused, not only the turn before's state
    assert reused >= steady["usage"]["prompt_tokens_details"]["cached_tokens"] - 1, (resumed, steady)
