"""Images, audio and documents in every dialect, on a text-only model (the scripted engine, in-process): 200, a
stand-in where the medium stood in the rendered prompt (``[[echo]]`` makes the engine reply its prompt), and the
``X-LocalAI-Omitted`` header saying what was left out; documents reach the model as their text; broken ones are a
400 naming the block. The real model, the real SDKs and the daemon's log are in
tests/api/daemon/test_media_daemon.py."""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

import pytest
from starlette.testclient import TestClient

from tests import media_files as files
from tests.metagguf import metadata_gguf

PNG = files.png()
PNG_URL = files.data_url(PNG, "image/png")
STAND_IN = re.compile(r"\[image \(image/png, (\d+) bytes, sha256 ([0-9a-f]{16})\): this model reads text only\]")
ECHO = "[[echo]]"
MODEL = "media"


@pytest.fixture(scope="module", autouse=True)
def media_model(api: TestClient, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A ChatML model without stop strings or an output cap, so ``[[echo]]`` gives back the whole prompt."""
    weights = metadata_gguf(tmp_path_factory.mktemp("gguf") / "media.gguf", arch="llama", context_length=16384)
    created = api.post("/api/create", json={"model": MODEL, "modelfile": f"FROM {weights}\nPARAMETER num_ctx 8192\n"})
    assert created.status_code == 200, created.text
    return MODEL


def stand_ins(text: str) -> list[tuple[int, str]]:
    return [(int(size), digest) for size, digest in STAND_IN.findall(text)]


def expected(data: bytes = PNG) -> tuple[int, str]:
    return len(data), hashlib.sha256(data).hexdigest()[:16]


def openai_reply(api: TestClient, messages: list[dict[str, Any]], **extra: Any) -> tuple[str, dict[str, str]]:
    response = api.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, **extra})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"], dict(response.headers)


def anthropic_reply(api: TestClient, messages: list[dict[str, Any]], **extra: Any) -> tuple[str, dict[str, str]]:
    response = api.post("/v1/messages", json={"model": MODEL, "max_tokens": 2048, "messages": messages,
                                              **extra})
    assert response.status_code == 200, response.text
    return "".join(b.get("text", "") for b in response.json()["content"]), dict(response.headers)


def responses_reply(api: TestClient, items: list[dict[str, Any]]) -> tuple[str, dict[str, str]]:
    response = api.post("/v1/responses", json={"model": MODEL, "input": items, "store": False})
    assert response.status_code == 200, response.text
    texts = [part["text"] for item in response.json()["output"] if item["type"] == "message"
             for part in item["content"]]
    return "".join(texts), dict(response.headers)


def ollama_reply(api: TestClient, path: str, body: dict[str, Any]) -> tuple[str, dict[str, str]]:
    response = api.post(path, json={"model": MODEL, "stream": False, **body})
    assert response.status_code == 200, response.text
    payload = response.json()
    return payload["message"]["content"] if "message" in payload else payload["response"], dict(response.headers)


CALL_OPENAI = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}]}
CALL_ANTHROPIC = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                                    "input": {"file_path": "a.png"}}]}
IMAGE_ANTHROPIC = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": files.b64(PNG)}}


# The same image sent by each dialect's own means, in the user's content or in a tool's result
CASES = {
    "openai-user": lambda api: openai_reply(api, [{"role": "user", "content": [
        {"type": "text", "text": f"What is this? {ECHO}"}, {"type": "image_url", "image_url": {"url": PNG_URL}}]}]),
    "openai-tool": lambda api: openai_reply(api, [
        {"role": "user", "content": f"Take a screenshot. {ECHO}"}, CALL_OPENAI,
        {"role": "tool", "tool_call_id": "call_1", "content": [
            {"type": "text", "text": "Here it is:"}, {"type": "image_url", "image_url": {"url": PNG_URL}}]}]),
    "anthropic-user": lambda api: anthropic_reply(api, [{"role": "user", "content": [
        IMAGE_ANTHROPIC, {"type": "text", "text": f"What is this? {ECHO}"}]}]),
    "anthropic-tool": lambda api: anthropic_reply(api, [
        {"role": "user", "content": f"Read a.png {ECHO}"}, CALL_ANTHROPIC,
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [IMAGE_ANTHROPIC]}]}]),
    "responses-user": lambda api: responses_reply(api, [{"role": "user", "content": [
        {"type": "input_text", "text": f"What is this? {ECHO}"}, {"type": "input_image", "image_url": PNG_URL}]}]),
    "responses-tool": lambda api: responses_reply(api, [
        {"role": "user", "content": f"Take a screenshot. {ECHO}"},
        {"type": "function_call", "call_id": "call_9", "name": "screenshot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_9", "output": [
            {"type": "input_image", "image_url": PNG_URL}]}]),
    "ollama-user": lambda api: ollama_reply(api, "/api/chat", {"messages": [
        {"role": "user", "content": f"What is this? {ECHO}", "images": [files.b64(PNG)]}]}),
    "ollama-tool": lambda api: ollama_reply(api, "/api/chat", {"messages": [
        {"role": "user", "content": f"Take a screenshot. {ECHO}"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "screenshot", "arguments": {}}}]},
        {"role": "tool", "tool_name": "screenshot", "content": "Here it is:", "images": [files.b64(PNG)]}]}),
    "ollama-generate": lambda api: ollama_reply(api, "/api/generate", {"prompt": f"What is this? {ECHO}",
                                                                      "images": [files.b64(PNG)]}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_image_on_a_text_only_model_becomes_a_stand_in(api: TestClient, case: str) -> None:
    prompt, headers = CASES[case](api)
    assert stand_ins(prompt) == [expected()], prompt
    omitted = headers["x-localai-omitted"]
    assert omitted.startswith("1 left out (this model reads text only): image image/png; ")
    assert f"sha256={expected()[1]}" in omitted and f"{len(PNG)} bytes" in omitted


def test_the_stand_in_stands_where_the_image_was(api: TestClient) -> None:
    other = files.png(rgb=(0, 0, 255))
    prompt, headers = openai_reply(api, [{"role": "user", "content": [
        {"type": "text", "text": f"first {ECHO}"}, {"type": "image_url", "image_url": {"url": PNG_URL}},
        {"type": "text", "text": "between"}, {"type": "image_url", "image_url": {"url": files.data_url(other,
                                                                                                     "image/png")}},
        {"type": "text", "text": "last"}]}])
    found = stand_ins(prompt)
    assert found == [expected(), expected(other)]
    first, second = (prompt.index(digest) for _, digest in found)
    assert prompt.index("first") < first < prompt.index("between") < second < prompt.index("last")
    assert headers["x-localai-omitted"].startswith("2 left out")
    # in a tool result too, and the same image always gives the same text (the cached prefix holds)
    again, _ = anthropic_reply(api, [{"role": "user", "content": f"go {ECHO}"}, CALL_ANTHROPIC, {
        "role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "before"}, IMAGE_ANTHROPIC, {"type": "text", "text": "after"}]}]}])
    assert stand_ins(again) == [expected()]
    assert again.index("before") < again.index(expected()[1]) < again.index("after")
    assert STAND_IN.search(prompt).group(0) == STAND_IN.search(again).group(0)  # type: ignore[union-attr]


def test_a_request_of_only_an_image_still_answers(api: TestClient) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": PNG_URL}}]}]}),
        ("/v1/messages", {"max_tokens": 16, "messages": [{"role": "user", "content": [IMAGE_ANTHROPIC]}]}),
        ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": PNG_URL}]}]}),
        ("/api/chat", {"stream": False, "messages": [{"role": "user", "images": [files.b64(PNG)]}]}),
        ("/api/generate", {"stream": False, "images": [files.b64(PNG)], "prompt": ""}),
    ):
        response = api.post(path, json={"model": MODEL, **body})
        assert response.status_code == 200, (path, response.text)
        if path != "/api/generate":  # Ollama's empty prompt only loads the model: nothing was read
            assert "x-localai-omitted" in response.headers, path


def test_streamed_replies_carry_the_header_too(api: TestClient) -> None:
    with api.stream("POST", "/v1/messages", json={"model": MODEL, "max_tokens": 16, "stream": True,
                                                   "messages": [{"role": "user", "content": [IMAGE_ANTHROPIC]}]}
                    ) as response:
        assert response.status_code == 200
        assert response.headers["x-localai-omitted"].startswith("1 left out")
        assert "message_stop" in "".join(response.iter_text())


def test_audio_urls_and_unknown_files_get_stand_ins(api: TestClient) -> None:
    wav = files.wav()
    prompt, headers = openai_reply(api, [{"role": "user", "content": [
        {"type": "text", "text": ECHO},
        {"type": "input_audio", "input_audio": {"data": files.b64(wav), "format": "wav"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"type": "file", "file": {"file_data": files.data_url(b"PK\x03\x04zip", "application/zip"),
                                  "filename": "a.zip"}}]}])
    assert f"[audio (audio/wav, {len(wav):,} bytes, sha256 {hashlib.sha256(wav).hexdigest()[:16]}): this model " \
           "reads text only]" in prompt
    assert "[image at https://example.com/cat.png: not fetched: localai does not download files a request names]" \
        in prompt
    assert "[document a.zip (application/zip, 7 bytes" in prompt and "localai reads PDF and text documents" in prompt
    assert headers["x-localai-omitted"].startswith("3 left out")
    assert "a.zip" not in headers["x-localai-omitted"]  # a client's file name never reaches a header


def test_count_tokens_counts_the_stand_in(api: TestClient) -> None:
    plain = api.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": [
        {"role": "user", "content": "Look."}]}).json()["input_tokens"]
    with_image = api.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Look."}, IMAGE_ANTHROPIC]}]})
    assert with_image.status_code == 200, with_image.text
    text = f"\n[image (image/png, {len(PNG)} bytes, sha256 {expected()[1]}): this model reads text only]"
    assert with_image.json()["input_tokens"] == plain + len(text.encode())  # the scripted engine's tokens are bytes


# -- documents ---------------------------------------------------------------------------------------------------

def anthropic_document(data: bytes, title: str | None = "report.pdf") -> dict[str, Any]:
    block: dict[str, Any] = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                                            "data": files.b64(data)}}
    if title:
        block["title"] = title
    return block


def test_a_pdf_reaches_the_model_as_its_text(api: TestClient) -> None:
    pdf = files.pdf_with_text("Quarterly revenue rose (by 12%).", "Costs fell.")
    prompt, headers = anthropic_reply(api, [{"role": "user", "content": [
        anthropic_document(pdf), {"type": "text", "text": f"Summarize. {ECHO}"}]}])
    assert "[document: report.pdf, 2 pages]\nQuarterly revenue rose (by 12%).\n\nCosts fell." in prompt
    assert "x-localai-omitted" not in headers
    # Responses' input_file, and chat completions' file part, read the same way
    prompt, _ = responses_reply(api, [{"role": "user", "content": [
        {"type": "input_file", "filename": "r.pdf", "file_data": files.data_url(pdf, "application/pdf")},
        {"type": "input_text", "text": ECHO}]}])
    assert "[document: r.pdf, 2 pages]\nQuarterly revenue rose" in prompt
    prompt, _ = openai_reply(api, [{"role": "user", "content": [
        {"type": "file", "file": {"filename": "r.pdf", "file_data": files.b64(pdf)}}, {"type": "text", "text": ECHO}]}])
    assert "Costs fell." in prompt
    # and inside a tool result
    prompt, _ = anthropic_reply(api, [{"role": "user", "content": f"Read it {ECHO}"}, CALL_ANTHROPIC,
                                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                                    "content": [anthropic_document(pdf, None)]}]}])
    assert "[document, 2 pages]\nQuarterly revenue" in prompt


def test_text_documents_pass_through(api: TestClient) -> None:
    prompt, headers = anthropic_reply(api, [{"role": "user", "content": [
        {"type": "document", "title": "notes.txt", "source": {"type": "text", "media_type": "text/plain",
                                                              "data": "Buy milk."}},
        {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "Walk the dog."}]}},
        {"type": "text", "text": ECHO}]}])
    assert "[document: notes.txt]\nBuy milk." in prompt and "Walk the dog." in prompt
    assert "x-localai-omitted" not in headers
    prompt, _ = responses_reply(api, [{"role": "user", "content": [
        {"type": "input_file", "filename": "todo.md", "file_data": files.data_url(b"- ship it", "text/markdown")},
        {"type": "input_text", "text": ECHO}]}])
    assert "[document: todo.md]\n- ship it" in prompt


def test_a_pdf_without_text_gets_a_stand_in(api: TestClient) -> None:
    scan = files.image_only_pdf()
    prompt, headers = anthropic_reply(api, [{"role": "user", "content": [
        anthropic_document(scan, "scan.pdf"), {"type": "text", "text": ECHO}]}])
    assert (f"[document scan.pdf (application/pdf, 1 pages, {len(scan):,} bytes, sha256 "
            f"{hashlib.sha256(scan).hexdigest()[:16]}): no text could be extracted from it") in prompt
    assert headers["x-localai-omitted"].startswith("1 left out (no text could be extracted")


@pytest.mark.parametrize(("data", "needle"), [
    pytest.param(files.pdf_with_text("cut short")[:150], "cannot be read: it is damaged, cut short or not a PDF",
                 id="truncated"),
    pytest.param(b"%PDF-1.4 and then nothing a PDF has", "cannot be read", id="garbage"),
    pytest.param(files.encrypted_pdf(), "the PDF is encrypted with a password; send it decrypted, or its text",
                 id="encrypted"),
    pytest.param(files.pdf_bomb(400), "inflates to more than its reader allows", id="bomb"),
])
def test_a_broken_pdf_is_a_400_naming_the_block(api: TestClient, data: bytes, needle: str) -> None:
    response = api.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "read this"}, anthropic_document(data)]}]})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert message.startswith("messages.2.content.1.source.data: ") and needle in message
    responses = api.post("/v1/responses", json={"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_file", "filename": "x.pdf", "file_data": files.data_url(data, "application/pdf")}]}]})
    assert responses.status_code == 400 and responses.json()["error"]["param"] == "input.0.content.0.file_data"
    assert api.post("/v1/messages", json={"model": MODEL, "max_tokens": 8,  # still serving
                                          "messages": [{"role": "user", "content": "hi"}]}).status_code == 200


def test_a_pdf_that_takes_too_long_is_stopped(api: TestClient) -> None:
    """A stream just under pypdf's inflate cap, full of text operators: reading it takes far longer than the limit
    (here 2 s), and the reader's process is killed at the limit."""
    reader = api.app.state.runtime.documents  # type: ignore[attr-defined]
    reader.timeout = 2.0
    try:
        started = time.monotonic()
        response = api.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": [
            {"role": "user", "content": [anthropic_document(files.pdf_bomb(70))]}]})
        assert response.status_code == 400, response.text
        assert "reading the PDF took longer than 2 s; send the document's text instead" in response.text
        assert time.monotonic() - started < 30  # bounded by the limit, not by the file
    finally:
        reader.timeout = 30.0


def test_a_50_mb_pdf_is_over_the_request_limit(api: TestClient) -> None:
    big = files.large_pdf(50)
    response = api.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": [anthropic_document(big)]}]})
    assert response.status_code == 413, response.text
    assert "LOCALAI_MAX_REQUEST_BYTES" in response.json()["error"]["message"]
