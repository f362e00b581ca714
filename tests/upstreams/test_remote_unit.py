"""Remote models without a server: Modelfile forms and refusals, the hash ring, upstream errors and deltas."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import httpx
import pytest

from localai.errors import ModelfileError, UpstreamTimeout, UpstreamUnavailable
from localai.metrics import Metrics
from localai.models.modelfile import parse
from localai.models.registry import Registry
from localai.models.remote_spec import RemoteSpec
from localai.schema import Message, TextBlock, ToolCallBlock, ToolCallDelta, ToolCallStart, ToolResultBlock
from localai.upstreams.pool import RemotePool
from localai.upstreams.ring import HashRing
from localai.upstreams.translation import _Call, _call_events, context_error, openai_messages


def registry(tmp_path: Path) -> Registry:
    return Registry.open(tmp_path / "localai.db")


def test_a_remote_modelfile_creates_a_remote_model(tmp_path: Path) -> None:
    text = ("FROM http://gpu-box:8000/v1/\nPARAMETER upstream_model Qwen/Qwen3-Coder-480B\n"
            "PARAMETER replica http://gpu-box-2:8000/v1\nPARAMETER replica https://gpu-box-3/v1\n"
            "PARAMETER api_key_env VLLM_KEY\nPARAMETER timeout 30\nPARAMETER num_ctx 65536\nSYSTEM You code.\n")
    record = registry(tmp_path).create("big", parse(text))
    assert record.remote and record.engine == "remote" and record.path == "http://gpu-box:8000/v1"
    assert record.size == 0 and record.context_length == 65536
    spec = RemoteSpec.of(record.path, record.parameters)
    assert spec.replicas == ("http://gpu-box:8000/v1", "http://gpu-box-2:8000/v1", "https://gpu-box-3/v1")
    assert spec.upstream_model == "Qwen/Qwen3-Coder-480B" and spec.api_key_env == "VLLM_KEY" and spec.timeout == 30
    again = parse(record.modelfile().render())  # `show --modelfile` gives back a Modelfile that makes the same model
    assert RemoteSpec.of(again.from_, again.parameters) == spec
    # a model FROM the remote one is remote too, with its own settings on top
    child = registry(tmp_path).create("big-fast", parse("FROM big\nPARAMETER temperature 0\nPARAMETER priority 5"))
    assert child.remote and RemoteSpec.of(child.path, child.parameters).priority == 5
    assert "VLLM_KEY" in json.dumps(child.parameters)


@pytest.mark.parametrize(("text", "expected"), [
    ("FROM http://host:8000/v1\nPARAMETER api_key sk-live-123", "never holds an API key"),
    ("FROM http://user:sk-live-123@host:8000/v1", "holds credentials"),
    ("FROM http://host:8000/v1\nPARAMETER replica ftp://host/v1", "not an http(s) URL"),
    ("FROM http://host:8000/v1?key=1", "query"),
    ("FROM http://host:8000/v1\nPARAMETER api_key_env 1-not-a-name", "environment variable"),
    ("FROM http://host:8000/v1\nPARAMETER routing random", "routing must be one of"),
    ("FROM http://host:8000/v1\nPARAMETER timeout 0", "timeout must be between"),
    ("FROM http://host:8000/v1\nTEMPLATE \"{{ messages }}\"", "TEMPLATE does not apply"),
    ("FROM http://host:port/v1", "not a valid URL"),
])
def test_bad_remote_modelfiles_are_refused_clearly(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ModelfileError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        registry(tmp_path).create("bad", parse(text))
    assert not registry(tmp_path).exists("bad")


def test_remote_parameters_on_local_weights_are_refused(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not read: refused before")
    with pytest.raises(ModelfileError, match="only remote models take it"):
        registry(tmp_path).create("local", parse(f"FROM {gguf}\nPARAMETER upstream_model x"))


def test_the_ring_spreads_sessions_and_a_new_replica_moves_few() -> None:
    two = HashRing(["http://a/v1", "http://b/v1"])
    three = HashRing(["http://a/v1", "http://b/v1", "http://c/v1"])
    keys = [f"session-{n}" for n in range(3000)]
    owners = [two.preference(key)[0] for key in keys]
    assert 0.4 < owners.count("http://a/v1") / len(keys) < 0.6
    moved = [key for key, owner in zip(keys, owners, strict=True) if three.preference(key)[0] != owner]
    assert all(three.preference(key)[0] == "http://c/v1" for key in moved)  # only to the new replica
    assert 0.2 < len(moved) / len(keys) < 0.45  # about a third, not a reshuffle
    assert sorted(two.preference("x")) == ["http://a/v1", "http://b/v1"]  # every replica, owner first


def test_upstream_context_errors_are_recognised() -> None:
    vllm = json.dumps({"error": {"message": "This model's maximum context length is 2048 tokens. However, you "
                                 "requested 3036 tokens (3031 in the messages, 5 in the completion).",
                                 "code": "context_length_exceeded"}}).encode()
    assert context_error(vllm, 400) == (2048, 3031)
    server = json.dumps({"error": {"code": 400, "message": "the request exceeds the available context size",
                                   "type": "exceed_context_size_error", "n_prompt_tokens": 5000, "n_ctx": 4096}})
    assert context_error(server.encode(), 400) == (4096, 5000)
    assert context_error(b'{"error": {"message": "prompt is too long for the context"}}', 400) == (None, None)
    assert context_error(b'{"error": {"message": "temperature must be positive"}}', 400) is None
    assert context_error(vllm, 500) is None
    assert context_error(b"<html>bad gateway</html>", 400) is None


def test_tool_call_deltas_that_repeat_their_id_make_one_call() -> None:
    calls: dict[int, _Call] = {}
    chunks = [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{"}},
              {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                            "arguments": '"city": "Paris"'}},
              {"index": 0, "function": {"arguments": "}"}}]
    events = [event for chunk in chunks for event in _call_events(calls, chunk)]
    assert events[0] == ToolCallStart(0, "call_1", "get_weather")
    assert "".join(e.arguments for e in events if isinstance(e, ToolCallDelta)) == '{"city": "Paris"}'
    # a name that arrives after the first arguments: the start waits for it, the arguments are not lost
    late: dict[int, _Call] = {}
    first = _call_events(late, {"index": 0, "id": "c", "function": {"arguments": '{"a": '}})
    second = _call_events(late, {"index": 0, "function": {"name": "f", "arguments": "1}"}})
    assert first == [] and second == [ToolCallStart(0, "c", "f"), ToolCallDelta(0, '{"a": 1}')]


def test_messages_translate_to_chat_completions() -> None:
    messages = [Message("developer", [TextBlock("Be brief.")]), Message("user", [TextBlock("Weather?")]),
                Message("assistant", [ToolCallBlock("c1", "get_weather", {"city": "Paris"}),
                                      ToolCallBlock("c2", "get_time", {})]),
                Message("user", [ToolResultBlock("c1", "sunny"), ToolResultBlock("c2", "noon")])]
    assert openai_messages(messages) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"}]


@pytest.mark.parametrize(("error", "message", "sends"), [
    (httpx.ReadError, "the connection broke", 1),
    (httpx.RemoteProtocolError, "peer closed connection without sending complete message body", 1),
    (httpx.ReadTimeout, "timed out", 1),
    (httpx.ConnectError, "the connection broke", 2),
    (httpx.WriteError, "the connection broke", 2),
    (httpx.RemoteProtocolError, "Server disconnected without sending a response.", 2),
])
def test_a_post_is_sent_again_only_when_it_never_reached_the_server(error: type[httpx.TransportError], message: str,
                                                                     sends: int) -> None:
    """A read error after the request was sent means the upstream may be generating (and billing): one POST only.
    A connect or write error, or a kept-alive connection closed before any answer, means it never started: one more
    try on a new connection is safe."""
    seen: list[bytes] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request.content)
        raise error(message, request=request)

    async def go() -> None:
        pool = RemotePool("paid", RemoteSpec(replicas=("http://upstream.test/v1",)), Metrics(), 60.0)
        pool.client = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
        op = {"id": "r1", "key": "s", "path": "/chat/completions", "headers": {}, "body": {"stream": True}}
        try:
            with pytest.raises((UpstreamUnavailable, UpstreamTimeout)):
                async for _ in pool.generate(op):
                    pass
        finally:
            await pool.close()

    asyncio.run(go())
    assert len(seen) == sends


@pytest.mark.parametrize("hang_up", [httpx.ReadError("", request=None),  # type: ignore[arg-type]
                                     httpx.RemoteProtocolError("Server disconnected without sending a response.")])
def test_an_empty_stream_then_a_dropped_connection_still_reaches_the_context_error(hang_up: httpx.TransportError
                                                                                   ) -> None:
    """llama-cpp-python's server answers a prompt over its context with an empty stream and drops the connection;
    asked again without streaming, the request may meet that connection's reset (a race with the kernel: it made
    the remote test flaky) or a clean close. Either way it is asked once more on a new connection, and the
    conversation gets the context error that fitting acts on, not "no replica could take the request"."""
    seen: list[bool] = []
    too_long = {"error": {"message": "This model's maximum context length is 2048 tokens. However, you requested "
                                     "2301 tokens (2293 in the messages, 8 in the completion).",
                          "type": "invalid_request_error"}}

    def upstream(request: httpx.Request) -> httpx.Response:
        stream = bool(json.loads(request.content).get("stream"))
        seen.append(stream)
        if stream:
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"")
        if len(seen) == 2:  # the re-ask went out on the connection the server dropped
            hang_up.request = request
            raise hang_up
        return httpx.Response(400, json=too_long)

    async def go() -> list[dict[str, object]]:
        pool = RemotePool("big", RemoteSpec(replicas=("http://upstream.test/v1",)), Metrics(), 60.0)
        pool.client = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
        op = {"id": "r1", "key": "s", "path": "/chat/completions", "headers": {}, "body": {"stream": True},
              "size": 9000}
        try:
            return [frame async for frame in pool.generate(op)]
        finally:
            await pool.close()

    frames = asyncio.run(go())
    assert seen == [True, False, False]
    assert frames[-1]["ev"] == "error" and frames[-1]["kind"] == "context_length", frames
    assert "2048" in str(frames[-1]["message"])


def test_images_go_upstream_as_image_url_parts_where_they_stood() -> None:
    from localai.schema import MediaBlock
    from localai.upstreams.translation import IMAGE_TOKENS, prompt_size

    png = MediaBlock("image", "image/png", data=b"\x89PNG fake")
    linked = MediaBlock("image", "image/jpeg", reference="https://example.com/cat.jpg")
    messages = openai_messages([Message("user", [TextBlock("look: "), png, TextBlock("and "), TextBlock("this"),
                                                 linked]), Message("assistant", [TextBlock("a cat")])])
    assert messages[0]["content"] == [
        {"type": "text", "text": "look: "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORyBmYWtl"}},
        {"type": "text", "text": "and this"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}}]
    assert messages[1]["content"] == "a cat"  # text alone stays a string
    # fitting counts an image as IMAGE_TOKENS, not as its base64 (a 1 MB screenshot is not 350k tokens)
    big = MediaBlock("image", "image/png", data=b"\0" * 1_000_000)
    shaped = openai_messages([Message("user", [TextBlock("hi"), big])])
    assert prompt_size(shaped, None) < 4 * IMAGE_TOKENS + 200


def test_a_refusal_that_may_be_about_images_is_recognised() -> None:
    from localai.runtime.media import refused_images

    assert refused_images("image input is not supported - hint: you may need to provide the mmproj")
    assert refused_images("Qwen2 is not a multimodal model")
    assert refused_images("no replica could take the request: http://x/v1: HTTP 500: can only concatenate str")
    assert not refused_images("the upstream refused the API key (HTTP 401)")


class HungUpstream:
    """A replica that accepts connections and reads requests, and never answers (counts the requests it got)."""

    def __init__(self) -> None:
        self.requests = 0
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> str:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.writers.append(writer)
            while await reader.readline() not in (b"\r\n", b""):
                pass
            self.requests += 1
            await reader.read()  # until the client gives up

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        await self.server.wait_closed()


def test_listing_a_remote_model_starts_no_health_checks_and_never_waits_on_a_hung_upstream(tmp_path: Path) -> None:
    """Defects 7 and 12 of the third probe round: a model merely listed started a health loop that never stopped
    (and metric series), and every listing waited the connect timeout + 2 s on an upstream that accepts connections
    and never answers. Now a listing starts one background question a pool, waits for it only a moment, and the
    health checks run while the model is used, stop when it is idle, and take their series with them."""
    from localai.upstreams import pool as pools
    from localai.upstreams.pool import Remotes

    async def run() -> None:
        async with (hung := HungUpstream()) as url:
            record = registry(tmp_path).create("hung", parse(f"FROM {url}\nPARAMETER timeout 30"))
            metrics = Metrics()
            remotes = Remotes(metrics, health_interval=0.05)
            for _ in range(5):
                info = await remotes.describe(record)  # returns while the question is still unanswered
                assert info["upstream_model"] is None and info["replicas"][0]["url"] == url
            pool = remotes.pools[record.name]
            assert pool._refreshing is not None and not pool._refreshing.done()
            assert hung.requests == 1  # one question in flight, however many listings waited on it
            series = f'model="{record.name}"'
            assert not pool.in_use and series not in metrics.render(0, 0).decode()  # listed: no checks, no series
            remotes.pool(record)  # a request uses it: the checks run
            assert pool.in_use and series in metrics.render(0, 0).decode()
            pool.last_used = -1e9  # idle for long (instead of waiting a minute)
            health = pool._health
            assert health is not None
            await asyncio.wait_for(health, 10)
            assert not pool.in_use
            remotes.pool(record)
            assert pool.in_use  # the next request starts them again
            remotes.forget(record.name)
            await asyncio.gather(*remotes._retiring)
            assert not pool.in_use and series not in metrics.render(0, 0).decode()  # a deleted model leaves none
            assert pools.LISTING_WAIT < 2  # the documented bound on a listing's wait

    asyncio.run(run())
