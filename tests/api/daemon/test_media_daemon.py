"""Media, structured outputs and token-id embeddings through the real daemon, the real smollm2 model and the real
SDKs: what Claude Code, the OpenAI and Ollama clients send keeps a session going on a text-only model."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Literal

import anthropic
import ollama
import openai
import pytest
from pydantic import BaseModel

from tests import media_files as files
from tests.conftest import Daemon

PNG = files.png(8, 8)
PNG_B64 = base64.b64encode(PNG).decode()


@pytest.fixture
def claude(daemon: Daemon) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=daemon.base_url, api_key="unused", max_retries=0) as client:
        yield client


def test_claude_codes_read_of_a_png_keeps_the_session(claude: anthropic.Anthropic, daemon: Daemon) -> None:
    """Claude Code's Read tool answers with the image in a tool_result: a 400 there ended the session."""
    raw = claude.messages.with_raw_response.create(model="smollm2", max_tokens=16, messages=[
        {"role": "user", "content": "Look at shot.png"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01", "name": "Read",
                                           "input": {"file_path": "shot.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}}]}]},
    ], extra_body={"temperature": 0})
    message = raw.parse()
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens > 0
    assert raw.headers["x-localai-omitted"].startswith("1 left out (this model reads text only): image image/png")
    assert "left out of smollm2:135m's prompt: image image/png" in daemon.log()


def test_openai_and_ollama_images_answer(daemon: Daemon) -> None:
    with openai.OpenAI(base_url=f"{daemon.base_url}/v1", api_key="unused", max_retries=0) as client:
        image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG_B64}"}}
        raw = client.chat.completions.with_raw_response.create(model="smollm2", max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is in the picture?"}, image]}])
        assert raw.parse().choices[0].message.content
        assert raw.headers["x-localai-omitted"].startswith("1 left out")
    with ollama.Client(host=daemon.base_url) as native:
        reply = native.chat(model="smollm2", options={"num_predict": 8, "temperature": 0},
                            messages=[{"role": "user", "content": "Describe it.", "images": [PNG]}])
    assert reply.message.content


def test_a_pdf_document_reaches_the_model(claude: anthropic.Anthropic) -> None:
    pdf = files.pdf_with_text("The launch code is PELICAN.")
    count = claude.messages.count_tokens(model="smollm2", messages=[{"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                        "data": base64.b64encode(pdf).decode()}},
        {"type": "text", "text": "What is the launch code?"}]}])
    plain = claude.messages.count_tokens(model="smollm2", messages=[{"role": "user", "content": (
        "[document, 1 pages]\nThe launch code is PELICAN.\nWhat is the launch code?")}])
    assert count.input_tokens == plain.input_tokens  # the model got exactly the PDF's text
    with pytest.raises(anthropic.BadRequestError, match="encrypted with a password"):
        claude.messages.create(model="smollm2", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                            "data": base64.b64encode(files.encrypted_pdf()).decode()}}]}])


class City(BaseModel):
    """A schema smollm2 cannot ramble in (the SDK moves string lengths out of the schema it sends)."""

    capital_of_france: Literal["Paris", "Lyon", "Nice"]
    in_europe: bool


@pytest.mark.parametrize("route", ["messages", "beta.messages"])
def test_anthropic_structured_output_parses(claude: anthropic.Anthropic, route: str) -> None:
    """The SDK's messages.parse() (output_config.format) and beta.messages.parse() (output_format, on
    /v1/messages?beta=true): smollm2 answers in JSON of the schema, which the SDK parses."""
    api = claude.beta.messages if route == "beta.messages" else claude.messages
    parsed = api.parse(model="smollm2", max_tokens=64, output_format=City,  # type: ignore[attr-defined]
                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    city = parsed.parsed_output
    assert isinstance(city, City) and city.capital_of_france in ("Paris", "Lyon", "Nice")


# OpenAI's cl100k_base ids (what LangChain's OpenAIEmbeddings sends by default), from the bpe-openai package's
# copy of the vocabulary: the first has ids past smollm2's 49,152, the second spells text smollm2 cuts differently
PARIS = [60704, 374, 279, 6864, 315, 9822, 13, 1102, 374, 3967, 369, 279, 469, 3168, 301, 22703, 11, 51677, 1778,
         439, 279, 9928, 49606, 11, 323, 1202, 30203, 5512, 13]  # "Paris is the capital of France. It is known..."
CODE = [755, 923, 2948, 11, 293, 997, 262, 471, 264, 489, 293, 271, 1374, 26995, 7, 17, 11, 220, 18, 595]


def test_embeddings_with_the_models_own_token_ids_and_with_tiktokens(daemon: Daemon, smollm2_path: object) -> None:
    from llama_cpp import Llama

    vocab = Llama(model_path=str(smollm2_path), vocab_only=True, verbose=False)
    own = vocab.tokenize(b"The quick brown fox", add_bos=False)
    with daemon.http() as http:
        text = http.post("/v1/embeddings", json={"model": "smollm2", "input": "The quick brown fox"}).json()
        ids = http.post("/v1/embeddings", json={"model": "smollm2", "input": own})
        assert ids.status_code == 200, ids.text
        assert ids.json()["data"][0]["embedding"] == pytest.approx(text["data"][0]["embedding"], abs=1e-5)
        for foreign, cause in ((PARIS, "outside this model's vocabulary"), (CODE, "not how this model's tokenizer")):
            refused = http.post("/v1/embeddings", json={"model": "smollm2", "input": [own, foreign]})
            assert refused.status_code == 400, refused.text
            message = refused.json()["error"]["message"]
            assert message.startswith("input 1") and cause in message and "check_embedding_ctx_length=False" in message
