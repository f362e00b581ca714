"""Crashes, disconnects, scheduling and security, each against a real daemon of its own."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import Daemon, free_port, start_daemon
from tests.observe import cpu_seconds, helper_processes, wait_for

PROMPT = [{"role": "user", "content": "Count slowly from one to one thousand."}]
LONG = {"model": "smollm2", "messages": PROMPT, "max_tokens": 4000, "ignore_eos": True, "temperature": 0}


def loaded(daemon: Daemon) -> list[dict[str, object]]:
    with daemon.http() as http:
        models: list[dict[str, object]] = http.get("/api/ps").json()["models"]
        return models


def test_worker_killed_mid_stream_ends_the_stream_with_an_error(fresh_daemon: Daemon) -> None:
    events: list[str] = []
    with fresh_daemon.http() as http, http.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: ") and '"content"' in line:
                events.append(line)
                if len(events) == 3:
                    break
        pid = int(loaded(fresh_daemon)[0]["pid"])  # type: ignore[call-overload]
        os.kill(pid, signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
    payloads = [json.loads(line[6:]) for line in rest if line != "data: [DONE]"]
    errors = [p["error"] for p in payloads if "error" in p]
    assert errors and errors[-1]["code"] == "worker_crashed"
    assert "data: [DONE]" not in rest
    # the daemon keeps serving, and the next request loads the model again
    with fresh_daemon.http() as http:
        assert http.get("/health").status_code == 200
        again = http.post("/v1/chat/completions", json={"model": "smollm2", "messages": PROMPT, "max_tokens": 3})
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] > 0
    assert int(loaded(fresh_daemon)[0]["pid"]) != pid  # type: ignore[call-overload]


def test_worker_killed_during_a_plain_request_gives_a_json_error(fresh_daemon: Daemon) -> None:
    with fresh_daemon.http() as http:
        http.post("/api/generate", json={"model": "smollm2"})  # load it
        pid = int(loaded(fresh_daemon)[0]["pid"])  # type: ignore[call-overload]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            idle = cpu_seconds(pid)
            future = pool.submit(http.post, "/v1/chat/completions", json=LONG)
            wait_for(lambda: loaded(fresh_daemon)[0]["active_requests"] == 1, "the request to hold a slot")
            # the worker has taken it (a request it never took is retried, test below): it is computing, half a
            # second of CPU time of its 4000 tokens (an idle worker uses next to none)
            wait_for(lambda: cpu_seconds(pid) > idle + 0.5, "the worker to work on the request")
            assert not future.done()
            os.kill(pid, signal.SIGKILL)
            response = future.result(timeout=60)
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "worker_crashed"


def test_a_request_the_dead_worker_never_took_goes_to_a_new_one(fresh_daemon: Daemon) -> None:
    """kill -9 just as a request is sent (the worker is stopped, so the request waits unread in its socket): the
    client gets its answer from a fresh worker instead of a 500."""
    with fresh_daemon.http() as http:
        http.post("/api/generate", json={"model": "smollm2"})  # load it
        pid = int(loaded(fresh_daemon)[0]["pid"])  # type: ignore[call-overload]
        os.kill(pid, signal.SIGSTOP)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(http.post, "/v1/chat/completions",
                                 json={"model": "smollm2", "messages": PROMPT, "max_tokens": 3})
            wait_for(lambda: loaded(fresh_daemon)[0]["active_requests"] == 1, "the request to hold a slot")
            os.kill(pid, signal.SIGKILL)
            response = future.result(timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] > 0
    assert int(loaded(fresh_daemon)[0]["pid"]) != pid  # type: ignore[call-overload]


def test_client_disconnect_stops_the_generation(fresh_daemon: Daemon) -> None:
    with fresh_daemon.http() as http, http.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()  # keep a reference: dropping the iterator would close the connection early
        for line in lines:
            if '"content":"' in line and '"role"' not in line:
                break
        assert loaded(fresh_daemon)[0]["active_requests"] == 1
        r.close()
    # 4000 tokens would take minutes; the slot is free again almost at once
    wait_for(lambda: loaded(fresh_daemon)[0]["active_requests"] == 0, "the slot to be free", timeout=10)


def test_full_queue_answers_503_with_retry_after(tmp_path: Path, smollm2_path: Path) -> None:
    with start_daemon(tmp_path / "d", max_queue="1", num_parallel="1") as daemon:
        body = {**LONG, "max_tokens": 8}
        # The interleaving is made, not hoped for (four requests sent at once were not always at once): one
        # request holds the only slot (streaming), one waits in the queue (its one place), then two more come.
        with daemon.http(timeout=600) as http, concurrent.futures.ThreadPoolExecutor(1) as pool:
            http.post("/api/generate", json={"model": "smollm2"})
            with http.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as running:
                lines = running.iter_lines()  # kept: an iterator dropped would close the connection
                for line in lines:
                    if '"content":"' in line and '"role"' not in line:
                        break  # it is generating (the role's chunk comes first): the slot is taken
                queued = pool.submit(http.post, "/v1/chat/completions", json=body)
                wait_for(lambda: loaded(daemon)[0]["queued"] == 1, "the second request to be queued")
                # a 503 comes at once; a request queued instead would wait for the stream, which never ends here
                responses = [http.post("/v1/chat/completions", json=body, timeout=60) for _ in range(2)]
                running.close()  # the slot is free: the queued request runs
            responses.append(queued.result(timeout=300))
        busy = [r for r in responses if r.status_code == 503]
        assert busy and all(r.headers["retry-after"] for r in busy)
        assert busy[0].json()["error"]["code"] == "server_busy"
        assert any(r.status_code == 200 for r in responses)


def test_keep_alive_zero_unloads_and_max_loaded_models_evicts(tmp_path: Path, smollm2_path: Path) -> None:
    with start_daemon(tmp_path / "d", max_loaded_models="1") as daemon, daemon.http() as http:
        # another load of the same weights (a copy would share smollm2's worker: see test_personas)
        assert http.post("/api/create", json={"model": "other", "modelfile": "FROM smollm2\nPARAMETER num_ctx 2048\n"}
                         ).status_code == 200
        http.post("/api/generate", json={"model": "smollm2"})
        assert [m["name"] for m in loaded(daemon)] == ["smollm2:135m"]
        http.post("/api/generate", json={"model": "other"})
        assert [m["name"] for m in loaded(daemon)] == ["other:latest"]  # the idle one made room
        reply = http.post("/api/generate", json={"model": "other", "prompt": "Hi", "stream": False,
                                                  "options": {"num_predict": 2}, "keep_alive": 0})
        assert reply.status_code == 200 and reply.json()["done"] is True
        wait_for(lambda: loaded(daemon) == [], "other to be unloaded", timeout=30)


def test_keep_alive_expires(tmp_path: Path, smollm2_path: Path) -> None:
    with start_daemon(tmp_path / "d", keep_alive="1s") as daemon:
        with daemon.http() as http:
            http.post("/api/generate", json={"model": "smollm2"})
        wait_for(lambda: loaded(daemon) == [], "smollm2 to expire", timeout=20)


def test_foreign_host_header_is_403(daemon: Daemon) -> None:
    with daemon.http() as http:
        refused = http.get("/v1/models", headers={"Host": "evil.example.com"})
        assert refused.status_code == 403 and "not allowed" in refused.json()["error"]["message"]
        for host in ("localhost", f"127.0.0.1:{daemon.port}", "[::1]", "app.localhost"):
            assert http.get("/v1/models", headers={"Host": host}).status_code == 200
        assert http.post("/api/tags", headers={"Host": "attacker.test"}).status_code == 403


def test_api_key_is_required_on_tcp_but_not_on_the_socket(tmp_path: Path, smollm2_path: Path) -> None:
    with start_daemon(tmp_path / "d", api_key="sekret", origins="http://app.test") as daemon:
        with daemon.http() as http:
            assert http.get("/v1/models").status_code == 401
            assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert http.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
            assert http.get("/v1/models", headers={"x-api-key": "sekret"}).status_code == 200
            assert http.get("/health").status_code == 200
            allowed = http.options("/v1/models", headers={"Origin": "http://app.test",
                                                           "Access-Control-Request-Method": "GET"})
            assert allowed.headers.get("access-control-allow-origin") == "http://app.test"
            other = http.options("/v1/models", headers={"Origin": "http://other.test",
                                                         "Access-Control-Request-Method": "GET"})
            assert "access-control-allow-origin" not in other.headers
        with daemon.unix() as unix:
            assert unix.get("/v1/models").status_code == 200


def test_no_cors_headers_without_configured_origins(daemon: Daemon) -> None:
    with daemon.http() as http:
        response = http.get("/v1/models", headers={"Origin": "http://localhost:5173"})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


def test_a_page_from_another_site_is_refused_even_without_a_preflight(daemon: Daemon) -> None:
    """A website may POST text/plain to localhost without a CORS preflight; its Origin header gives it away."""
    with daemon.http() as http:
        refused = http.post("/api/generate", headers={"Origin": "http://evil.example", "Content-Type": "text/plain"},
                            content='{"model": "smollm2", "prompt": "hi", "stream": false}')
        assert refused.status_code == 403 and "LOCALAI_ORIGINS" in refused.json()["error"]  # Ollama's error shape
        assert http.get("/api/ps", headers={"Origin": "https://attacker.test"}).status_code == 403
    with daemon.unix() as unix:  # no browser reaches the socket
        assert unix.get("/api/ps", headers={"Origin": "https://attacker.test"}).status_code == 200


def test_second_daemon_on_the_same_home_refuses_to_start(daemon: Daemon) -> None:
    with pytest.raises(RuntimeError, match="already serving"):
        start_daemon(daemon.home)


def test_invalid_settings_fail_with_a_message(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="invalid configuration"):
        start_daemon(tmp_path / "d", keep_alive="forever")


def test_ollama_errors_use_the_ollama_shape(daemon: Daemon) -> None:
    with daemon.http() as http:
        missing = http.post("/api/chat", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
        assert missing.status_code == 404 and isinstance(missing.json()["error"], str)
        bad = http.post("/api/chat", json={"model": "smollm2", "messages": [{"role": "robot", "content": "x"}]})
        assert bad.status_code == 400 and "unknown role" in bad.json()["error"]
        unparsable = http.post("/api/generate", content=b"{", headers={"content-type": "application/json"})
        assert unparsable.status_code == 400


def test_ollama_chat_streams_ndjson_with_timings(daemon: Daemon) -> None:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "options": {"num_predict": 5}}
    with daemon.http() as http:
        lines = [json.loads(line) for line in http.post("/api/chat", json=body).text.splitlines()]
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] > 0 and lines[-1]["prompt_eval_count"] > 0
    assert all(not line["done"] for line in lines[:-1])
    assert "".join(line["message"]["content"] for line in lines)
    _ = httpx  # the module is used through Daemon.http


HANGS_ON_LONG = ("{% if messages | length > 4 %}{% set r = range(99999) %}{% for a in r %}{% for b in r %}{% endfor %}"
                 "{% endfor %}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")


def test_sigterm_stops_the_daemon_while_templates_hang(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path / "d", engine="scripted")
    modelfile = f'FROM smollm2\nTEMPLATE """{HANGS_ON_LONG}"""\n'
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(5)]
    with daemon.http(timeout=60) as http:
        assert http.post("/api/create", json={"model": "hangs", "modelfile": modelfile}).status_code == 200

    def ask() -> int:
        try:
            return httpx.post(f"{daemon.base_url}/api/chat", timeout=60,
                              json={"model": "hangs", "stream": False, "messages": long}).status_code
        except httpx.HTTPError:
            return 0

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        asking = [pool.submit(ask) for _ in range(12)]
        # a render process is looping in the template (a tenth of a second of CPU time in it): the signal comes
        # while a template hangs, not before any has started
        wait_for(lambda: any(cpu_seconds(pid) > 0.1 for pid in
                             helper_processes(daemon.process.pid, "localai.models.renderer")), "a hanging render")
        daemon.process.send_signal(signal.SIGTERM)
        # 0, not 1: it stopped by itself, not cut at the 25 s grace (the wait's 60 s only keeps a hang from lasting)
        code = daemon.process.wait(timeout=60)
        assert code == 0 and "did not stop within" not in daemon.log(), daemon.log()[-2000:]
        # 400: the template was stopped; 500/503/none: cut off by the shutdown (uvicorn's, for requests it cancels)
        assert {future.result(timeout=60) for future in asking} <= {0, 400, 500, 503}
    assert not daemon.socket_path.exists() and not (daemon.home / "localai.pid").exists()


def test_a_shutdown_that_never_finishes_is_cut_at_the_grace_period(tmp_path: Path) -> None:
    """Whatever hangs in the shutdown (here: the wait for replies being prefilled), the process exits once the grace
    period is over, its workers killed and its files removed."""
    script = ("import asyncio\nfrom localai import daemon\nfrom localai.runtime.runtime import Runtime\n"
              "from localai.settings import Settings\ndaemon.SHUTDOWN_GRACE = 2.0\n"
              "async def stuck(self, timeout=10.0):\n    await asyncio.sleep(3600)\n"
              "Runtime.settle = stuck\ndaemon.serve(Settings())\n")
    home, port = tmp_path / "home", free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALAI_")}
    env.update({"LOCALAI_HOME": str(home), "LOCALAI_HOST": f"127.0.0.1:{port}", "LOCALAI_DISCOVER": "",
                "LOCALAI_ENGINE": "scripted"})
    with subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True) as process:
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/health"), "the daemon to start", timeout=60)
        assert httpx.post(f"http://127.0.0.1:{port}/api/chat", timeout=60, json={
            "model": "smollm2", "stream": False, "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1 and "did not stop within 2 s" in stderr, stderr[-2000:]
    assert not (home / "localai.sock").exists() and not (home / "localai.pid").exists()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
