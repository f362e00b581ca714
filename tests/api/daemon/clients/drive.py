"""Real client libraries against a running localai daemon, one client per run, as their users call them.

Run in the clients' own virtualenv (``make install-clients``; it holds none of localai):
``python tests/api/daemon/clients/drive.py CLIENT BASE_URL`` prints one JSON object: each check's outcome,
``{"ok": bool, "detail": str}``, or ``null`` where the client has no way to do it. The daemon serves ``smollm2``
(the real model) and ``agent`` (the scripted engine on smollm2's template, whose replies the prompt scripts: a tool
call, then an answer once the tool's result is back, so every client's tool round trip is deterministic).

Checks: ``models`` (the client lists the models), ``plain``, ``stream``, ``tools`` (a call, the client's result, the
answer), ``structured`` (JSON of a schema, parsed by the client), ``embed``, ``image`` (an image where the client
can send one: smollm2 reads text only, so the daemon puts a stand-in in its place and the session goes on),
``logprobs``, ``rerank`` (the client's reranker reads the daemon's ``reranker``: the order and scores the daemon's
own /v1/rerank gives, top_n of them).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct
import subprocess
import sys
import tempfile
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

CHECKS = ("models", "plain", "stream", "tools", "structured", "embed", "image", "logprobs", "rerank")
MODEL = "smollm2"
RERANKER = "reranker"  # the reranker fixture (tests/archfixtures.py)
QUERY = "how do I bake bread?"
DOCUMENTS = ["Quarks are bound by gluons.", "Knead the dough, let it rise, bake at 220 C.", "The river was high.",
             "Preheat the oven; a loaf needs steam."]
AGENT = "agent"  # the scripted model
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is sunny in Paris."
TOOL_PROMPT = f"What is the weather in Paris? [[turns:{CALL}|||{ANSWER}]]"
SUNNY = "sunny, 22 C"


class Capital(BaseModel):
    """A schema smollm2 cannot ramble in: an enum and a boolean."""

    capital: Literal["Paris", "Lyon", "Nice"]
    in_europe: bool


def get_weather(city: str) -> str:
    """Current weather for a city."""
    return SUNNY


WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 4, 4, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress((b"\x00" + b"\xc8\x1e\x1e" * 4) * 4)) + chunk(b"IEND", b""))


PNG = png()
PNG_B64 = base64.b64encode(PNG).decode()
PNG_URL = f"data:image/png;base64,{PNG_B64}"

Results = dict[str, dict[str, Any] | None]


def run_checks(checks: dict[str, Callable[[], object] | None]) -> Results:
    """Each check once; a check passes when it returns a truthy value (its detail) and raises nothing."""
    results: Results = {}
    for name in CHECKS:
        check = checks.get(name)
        if check is None:
            results[name] = None
            continue
        try:
            value = check()
            results[name] = {"ok": bool(value), "detail": str(value)[:300]}
        except Exception as exc:  # the cell records what the client raised
            results[name] = {"ok": False, "detail": f"{type(exc).__name__}: {exc}"[:600],
                             "trace": traceback.format_exc()[-2000:]}
    return results


def listed(names: list[str]) -> bool:
    """The served models are among ``names`` (as ``smollm2:latest`` and the rest)."""
    return any(name.split(":")[0] == MODEL for name in names) and any(name.split(":")[0] == AGENT for name in names)


def logprob_entries(entries: list[Any], text: str) -> object:
    """Each generated token's logprob as the client hands it over: tokens that spell the text, logprobs <= 0. A
    token that is part of a character (an emoji is several) shows as U+FFFD, so the tokens' bytes spell it where
    the client hands them over, as OpenAI's do."""
    tokens = [e["token"] if isinstance(e, dict) else e.token for e in entries]
    values = [e["logprob"] if isinstance(e, dict) else e.logprob for e in entries]
    pieces = [e.get("bytes") if isinstance(e, dict) else getattr(e, "bytes", None) for e in entries]
    spelled = (b"".join(bytes(piece) for piece in pieces if piece is not None).decode("utf-8", errors="replace")
               if all(piece is not None for piece in pieces) else "".join(tokens))
    return expect(bool(tokens) and spelled == text and all(v <= 0 for v in values), tokens[:4])


def reranked(pairs: list[tuple[int, float]], base: str, top_n: int) -> object:
    """The client's (index, score) pairs are the daemon's own answer for the same query, best first, top_n of them."""
    import urllib.request

    request = urllib.request.Request(f"{base}/v1/rerank", data=json.dumps(
        {"model": RERANKER, "query": QUERY, "documents": DOCUMENTS}).encode(), headers={"Content-Type":
                                                                                       "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        direct = [(r["index"], r["relevance_score"]) for r in json.load(response)["results"]][:top_n]
    return expect(len(pairs) == top_n and [i for i, _ in pairs] == [i for i, _ in direct]
                  and all(abs(a - b) < 1e-6 for (_, a), (_, b) in zip(pairs, direct, strict=True)), pairs)


def expect(condition: bool, detail: object) -> object:
    if not condition:
        raise AssertionError(f"unexpected: {detail!r}"[:500])
    return detail


# -- LangChain -----------------------------------------------------------------------------------------------------

def langchain_openai(base: str) -> Results:
    import openai
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings

    chat = ChatOpenAI(model=MODEL, base_url=f"{base}/v1", api_key="unused", temperature=0, max_tokens=16)  # type: ignore[arg-type]

    def tools() -> object:
        agent = ChatOpenAI(model=AGENT, base_url=f"{base}/v1", api_key="unused").bind_tools([get_weather])  # type: ignore[arg-type]
        messages: list[Any] = [HumanMessage(TOOL_PROMPT)]
        first = agent.invoke(messages)
        call = first.tool_calls[0]  # type: ignore[attr-defined]
        messages += [first, ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])]
        return expect(agent.invoke(messages).content == ANSWER, call)

    def embed() -> object:
        plain = OpenAIEmbeddings(model=MODEL, base_url=f"{base}/v1", api_key="unused",  # type: ignore[arg-type]
                                 check_embedding_ctx_length=False)
        vector = plain.embed_query("hello world")
        # the default tokenizes with tiktoken first: ids of another tokenizer, which the daemon refuses by name
        default = OpenAIEmbeddings(model=MODEL, base_url=f"{base}/v1", api_key="unused")  # type: ignore[arg-type]
        try:
            default.embed_documents(["def add(a, b):\n    return a + b\n\nprint(add(2, 3))"])
            refused = "accepted"
        except openai.BadRequestError as exc:
            refused = "check_embedding_ctx_length=False" in str(exc)
        return expect(len(vector) > 100 and refused is True, f"{len(vector)} dims; default refused naming the fix")

    return run_checks({
        "models": lambda: expect(listed([m.id for m in openai.OpenAI(base_url=f"{base}/v1", api_key="x")
                                         .models.list()]), "listed through the openai client LangChain uses"),
        "plain": lambda: chat.invoke("Say hello.").content,
        "stream": lambda: "".join(str(c.content) for c in chat.stream("Count to three.")),
        "tools": tools,
        "structured": lambda: ChatOpenAI(model=MODEL, base_url=f"{base}/v1", api_key="unused", temperature=0,  # type: ignore[arg-type]
                                         max_tokens=64).with_structured_output(Capital, method="json_schema")
        .invoke("What is the capital of France?"),
        "embed": embed,
        "image": lambda: chat.invoke([HumanMessage(content=[
            {"type": "text", "text": "What is in this picture?"}, {"type": "image_url", "image_url": {"url": PNG_URL}}
        ])]).content,
        "logprobs": lambda: (lambda reply: logprob_entries(reply.response_metadata["logprobs"]["content"],
                                                           str(reply.content)))(
            chat.bind(logprobs=True, top_logprobs=2).invoke("Say hello.")),
    })


def langchain_ollama(base: str) -> Results:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_ollama import ChatOllama, OllamaEmbeddings

    chat = ChatOllama(model=MODEL, base_url=base, temperature=0, num_predict=16)

    def tools() -> object:
        agent = ChatOllama(model=AGENT, base_url=base).bind_tools([get_weather])
        messages: list[Any] = [HumanMessage(TOOL_PROMPT)]
        first = agent.invoke(messages)
        call = first.tool_calls[0]  # type: ignore[attr-defined]
        messages += [first, ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])]
        return expect(agent.invoke(messages).content == ANSWER, call)

    def models() -> object:
        import ollama

        with ollama.Client(host=base) as native:
            return expect(listed([str(m.model) for m in native.list().models]),
                          "listed through the ollama client LangChain uses")

    return run_checks({
        "models": models,
        "plain": lambda: chat.invoke("Say hello.").content,
        "stream": lambda: "".join(str(c.content) for c in chat.stream("Count to three.")),
        "tools": tools,
        "structured": lambda: ChatOllama(model=MODEL, base_url=base, temperature=0, num_predict=48)
        .with_structured_output(Capital, method="json_schema").invoke("What is the capital of France?"),
        "embed": lambda: len(OllamaEmbeddings(model=MODEL, base_url=base).embed_query("hello world")),
        "image": lambda: chat.invoke([HumanMessage(content=[
            {"type": "text", "text": "What is in this picture?"}, {"type": "image_url", "image_url": PNG_URL}
        ])]).content,
    })


def langchain_anthropic(base: str) -> Results:
    import anthropic
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import HumanMessage, ToolMessage

    chat = ChatAnthropic(model=MODEL, base_url=base, api_key="unused", temperature=0, max_tokens=16)  # type: ignore[arg-type,call-arg]

    def tools() -> object:
        agent = ChatAnthropic(model=AGENT, base_url=base, api_key="unused", max_tokens=256  # type: ignore[arg-type,call-arg]
                              ).bind_tools([get_weather])
        messages: list[Any] = [HumanMessage(TOOL_PROMPT)]
        first = agent.invoke(messages)
        call = first.tool_calls[0]  # type: ignore[attr-defined]
        messages += [first, ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])]
        return expect(agent.invoke(messages).content == ANSWER, call)

    return run_checks({
        "models": lambda: expect(listed([m.id for m in anthropic.Anthropic(base_url=base, api_key="x")
                                         .models.list()]), "listed through the anthropic client LangChain uses"),
        "plain": lambda: chat.invoke("Say hello.").content,
        "stream": lambda: "".join(str(c.content) for c in chat.stream("Count to three.")),
        "tools": tools,
        "structured": lambda: ChatAnthropic(model=MODEL, base_url=base, api_key="unused", max_tokens=48,  # type: ignore[arg-type,call-arg]
                                            temperature=0).with_structured_output(Capital, method="json_schema")
        .invoke("What is the capital of France?"),
        "embed": None,  # Anthropic has no embeddings API
        "image": lambda: chat.invoke([HumanMessage(content=[
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}},
            {"type": "text", "text": "What is in this picture?"}])]).content,
    })


# -- agent frameworks ----------------------------------------------------------------------------------------------

def openai_agents(base: str, transport: Literal["http", "websocket"]) -> Results:
    """The Agents SDK on the Responses API, over HTTP or over its WebSocket mode. It treats a reply cut by
    ``max_output_tokens`` (``response.incomplete``, as OpenAI sends it) as an error, and smollm2 rambles to its cap:
    the text checks use the scripted model, whose reply ends where the prompt says."""
    import agents
    from agents import Agent, ModelSettings, OpenAIProvider, RunConfig, Runner, function_tool
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    agents.set_default_openai_responses_transport(transport)

    def config() -> RunConfig:  # a client per run: each run has its own event loop
        client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
        return RunConfig(model_provider=OpenAIProvider(openai_client=client, use_responses=True))

    def run(agent: Agent[Any], prompt: str | list[Any]) -> Any:
        return Runner.run_sync(agent, prompt, run_config=config(), max_turns=4)

    def stream() -> object:
        async def go() -> str:
            result = Runner.run_streamed(Agent(name="a", model=AGENT), "Count. [[say:One, two, three.]]",
                                         run_config=config())
            deltas = [event.data.delta async for event in result.stream_events()
                      if event.type == "raw_response_event" and event.data.type == "response.output_text.delta"]
            return expect(len(deltas) > 1 and "".join(deltas) == result.final_output, result.final_output)
        return asyncio.run(go())

    weather = function_tool(get_weather)
    return run_checks({
        "models": None,  # the SDK has no model listing
        "plain": lambda: run(Agent(name="a", model=AGENT), "Greet me. [[say:Hello there.]]").final_output,
        "stream": stream,
        "tools": lambda: expect(run(Agent(name="a", model=AGENT, tools=[weather]), TOOL_PROMPT).final_output
                                == ANSWER, "get_weather called, then the answer"),
        "structured": lambda: run(Agent(name="a", model=MODEL, output_type=Capital, model_settings=ModelSettings(
            max_tokens=48, temperature=0)), "What is the capital of France?").final_output,
        "embed": None,  # the SDK has no embeddings
        "image": lambda: run(Agent(name="a", model=AGENT), [{"role": "user", "content": [
            {"type": "input_text", "text": "What is in this picture? [[say:A red square.]]"},
            {"type": "input_image", "image_url": PNG_URL, "detail": "auto"}]}]).final_output,
    })


def pydantic_ai(base: str) -> Results:
    from pydantic_ai import Agent, BinaryContent
    from pydantic_ai.embeddings import Embedder
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=f"{base}/v1", api_key="unused")
    model = OpenAIChatModel(MODEL, provider=provider)
    settings: Any = {"max_tokens": 16, "temperature": 0}

    def stream() -> object:
        async def go() -> str:
            async with Agent(model, model_settings=settings).run_stream("Count to three.") as result:
                return "".join([piece async for piece in result.stream_text(delta=True)])
        return asyncio.run(go())

    def tools() -> object:
        agent = Agent(OpenAIChatModel(AGENT, provider=provider), tools=[get_weather])
        return expect(agent.run_sync(TOOL_PROMPT).output == ANSWER, "get_weather called, then the answer")

    def embed() -> object:
        from pydantic_ai.embeddings.openai import OpenAIEmbeddingModel

        embedder = Embedder(OpenAIEmbeddingModel(MODEL, provider=provider))
        return len(embedder.embed_query_sync("hello world").embeddings[0])

    return run_checks({
        "models": None,  # pydantic-ai has no model listing
        "plain": lambda: Agent(model, model_settings=settings).run_sync("Say hello.").output,
        "stream": stream,
        "tools": tools,
        "structured": lambda: Agent(model, output_type=Capital, model_settings={"max_tokens": 64, "temperature": 0}
                                    ).run_sync("What is the capital of France?").output,
        "embed": embed,
        "image": lambda: Agent(model, model_settings=settings).run_sync([
            "What is in this picture?", BinaryContent(data=PNG, media_type="image/png")]).output,
    })


def litellm_client(base: str) -> Results:
    import litellm

    common: dict[str, Any] = {"api_base": f"{base}/v1", "api_key": "unused"}
    model = f"openai/{MODEL}"

    def tools() -> object:
        spec = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                                  "parameters": WEATHER_SCHEMA}}]
        messages: list[dict[str, Any]] = [{"role": "user", "content": TOOL_PROMPT}]
        first = litellm.completion(model=f"openai/{AGENT}", messages=messages, tools=spec, **common)
        call = first.choices[0].message.tool_calls[0]
        result = get_weather(**json.loads(call.function.arguments))
        messages += [first.choices[0].message.model_dump(), {"role": "tool", "tool_call_id": call.id,
                                                             "content": result}]
        final = litellm.completion(model=f"openai/{AGENT}", messages=messages, tools=spec, **common)
        return expect(final.choices[0].message.content == ANSWER, call.function.name)

    def stream() -> object:
        chunks = litellm.completion(model=model, messages=[{"role": "user", "content": "Count to three."}],
                                    stream=True, max_tokens=16, **common)
        return "".join(c.choices[0].delta.content or "" for c in chunks)

    return run_checks({
        "models": None,  # litellm lists providers' known models, not a server's
        "plain": lambda: litellm.completion(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                            max_tokens=16, **common).choices[0].message.content,
        "stream": stream,
        "tools": tools,
        "structured": lambda: Capital.model_validate_json(litellm.completion(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=48,
            response_format=Capital, **common).choices[0].message.content),
        "embed": lambda: len(litellm.embedding(model=model, input=["hello world"], **common).data[0]["embedding"]),
        "image": lambda: litellm.completion(model=model, max_tokens=16, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"}, {"type": "image_url", "image_url": {"url": PNG_URL}}
        ]}], **common).choices[0].message.content,
        "logprobs": lambda: (lambda reply: logprob_entries(reply.choices[0].logprobs["content"]
                                                           if isinstance(reply.choices[0].logprobs, dict)
                                                           else reply.choices[0].logprobs.content,
                                                           reply.choices[0].message.content))(
            litellm.completion(model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
                               logprobs=True, top_logprobs=2, **common)),
        "rerank": lambda: reranked([(r["index"], r["relevance_score"]) for r in litellm.rerank(
            model=f"cohere/{RERANKER}", query=QUERY, documents=DOCUMENTS, top_n=3, api_base=base,
            api_key="unused").results], base, 3),
    })


def langchain_cohere(base: str) -> Results:
    """LangChain's reranker (CohereRerank, a document compressor) on Cohere's client pointed at the daemon."""
    from langchain_cohere import CohereRerank
    from langchain_core.documents import Document

    def rerank() -> object:
        reranker = CohereRerank(model=RERANKER, base_url=base, cohere_api_key="unused", top_n=2)
        kept = reranker.compress_documents([Document(page_content=text) for text in DOCUMENTS], QUERY)
        return reranked([(DOCUMENTS.index(doc.page_content), doc.metadata["relevance_score"]) for doc in kept], base,
                        2)

    return run_checks({"rerank": rerank})  # Cohere's chat and embed APIs are not served (only its rerank shape)


def llama_index(base: str) -> Results:
    from llama_index.core.base.llms.types import ChatMessage, ImageBlock, TextBlock
    from llama_index.core.tools import FunctionTool
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding
    from llama_index.llms.openai_like import OpenAILike

    def llm(model: str = MODEL, tokens: int = 16) -> OpenAILike:
        return OpenAILike(model=model, api_base=f"{base}/v1", api_key="unused", is_chat_model=True,
                          is_function_calling_model=True, max_tokens=tokens, temperature=0, context_window=4096)

    def tools() -> object:
        agent = llm(AGENT, 256)
        tool = FunctionTool.from_defaults(fn=get_weather)
        messages = [ChatMessage(role="user", content=TOOL_PROMPT)]
        first = agent.chat_with_tools([tool], chat_history=messages)
        calls = agent.get_tool_calls_from_response(first, error_on_no_tool_call=True)
        messages += [first.message, ChatMessage(role="tool", content=tool(**calls[0].tool_kwargs).content,
                                                additional_kwargs={"tool_call_id": calls[0].tool_id})]
        return expect(agent.chat(messages).message.content == ANSWER, calls[0].tool_name)

    return run_checks({
        "models": None,  # llama-index has no model listing
        "plain": lambda: llm().complete("Say hello.").text,
        "stream": lambda: "".join(r.delta or "" for r in llm().stream_complete("Count to three.")),
        "tools": tools,
        "structured": lambda: llm(tokens=64).as_structured_llm(Capital).complete(
            "What is the capital of France?").raw,
        "embed": lambda: len(OpenAILikeEmbedding(model_name=MODEL, api_base=f"{base}/v1", api_key="unused")
                             .get_text_embedding("hello world")),
        "image": lambda: llm().chat([ChatMessage(role="user", blocks=[
            TextBlock(text="What is in this picture?"), ImageBlock(image=PNG, image_mimetype="image/png")])]
        ).message.content,
    })


def llm_cli(base: str) -> Results:
    """Simon Willison's ``llm`` CLI, configured as its users point it at an OpenAI-compatible server
    (``extra-openai-models.yaml``); its embeddings go to the OpenAI model names, which the daemon aliases."""
    home = Path(tempfile.mkdtemp(prefix="llm-home-"))
    (home / "extra-openai-models.yaml").write_text(
        "".join(f"- model_id: {name}\n  model_name: {name}\n  api_base: {base}/v1\n  supports_tools: true\n"
                f"  supports_schema: true\n  vision: true\n" for name in (MODEL, AGENT)))
    env = {**os.environ, "LLM_USER_PATH": str(home), "OPENAI_API_KEY": "unused", "OPENAI_BASE_URL": f"{base}/v1"}
    binary = str(Path(sys.executable).with_name("llm"))

    def llm(*args: str) -> str:
        done = subprocess.run([binary, *args], env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"llm {' '.join(args)[:80]} exited {done.returncode}: {done.stderr[-400:]}")
        return done.stdout.strip()

    image = home / "picture.png"
    image.write_bytes(PNG)
    function = "def get_weather(city: str) -> str:\n    return 'sunny, 22 C'\n"
    return run_checks({
        "models": lambda: expect(f"OpenAI Chat: {MODEL}" in llm("models", "list"), "configured models listed"),
        "plain": lambda: llm("-m", MODEL, "-o", "max_tokens", "16", "-o", "temperature", "0", "--no-stream",
                             "Say hello."),
        "stream": lambda: llm("-m", MODEL, "-o", "max_tokens", "16", "-o", "temperature", "0", "Count to three."),
        "tools": lambda: expect(llm("-m", AGENT, "--functions", function, TOOL_PROMPT) == ANSWER,
                                "get_weather called by llm, then the answer"),
        "structured": lambda: Capital.model_validate_json(llm(
            "-m", MODEL, "-o", "max_tokens", "48", "-o", "temperature", "0", "--schema",
            json.dumps(Capital.model_json_schema()), "What is the capital of France?")),
        "embed": lambda: len(json.loads(llm("embed", "-m", "3-small", "-c", "hello world"))),
        "image": lambda: llm("-m", MODEL, "-o", "max_tokens", "16", "-a", str(image), "What is in this picture?"),
    })


CLIENTS: dict[str, Callable[[str], Results]] = {
    "langchain-openai": langchain_openai,
    "langchain-ollama": langchain_ollama,
    "langchain-anthropic": langchain_anthropic,
    "openai-agents-http": lambda base: openai_agents(base, "http"),
    "openai-agents-websocket": lambda base: openai_agents(base, "websocket"),
    "pydantic-ai": pydantic_ai,
    "litellm": litellm_client,
    "langchain-cohere": langchain_cohere,
    "llama-index": llama_index,
    "llm-cli": llm_cli,
}


def offline_tiktoken() -> None:
    """tiktoken downloads its vocabularies on first use (no network here): its cache gets cl100k_base from the
    bpe-openai package's copy (byte-identical: tiktoken checks the file's sha256), as LangChain's default needs."""
    import gzip
    import hashlib

    try:
        import bpe_openai
    except ImportError:  # a venv whose clients do not tokenize (llama-index's)
        return

    url = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
    cache = Path(tempfile.gettempdir()) / "localai-clients-tiktoken"
    cache.mkdir(exist_ok=True)
    target = cache / hashlib.sha1(url.encode()).hexdigest()
    if not target.exists():
        source = Path(bpe_openai.__file__).parent / "data" / "cl100k_base.tiktoken.gz"
        target.write_bytes(gzip.decompress(source.read_bytes()))
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)


def main() -> None:
    client, base = sys.argv[1], sys.argv[2].rstrip("/")
    offline_tiktoken()
    print(json.dumps(CLIENTS[client](base)))


if __name__ == "__main__":
    main()
