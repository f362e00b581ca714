"""``n`` choices through the real daemon on smollm2: parallel sequences that start from the first choice's
evaluated prompt (computed once), streamed and not, in chat and completions; bad values refused naming ``n``, and a
client that leaves mid-stream stops every choice."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import pytest

from tests.conftest import Daemon

SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 8  # ~100 tokens: worth sharing
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a fruit."}]


def computed(http: httpx.Client) -> float:
    """Prompt tokens the daemon evaluated so far (not reused from a cache or another sequence)."""
    text = http.get("/metrics").text
    return sum(float(v) for v in re.findall(r'^localai_prompt_tokens_computed_total\{model="smollm2[^"]*"\} (\S+)',
                                             text, re.MULTILINE))


def test_n_choices_compute_the_prompt_once_and_sample_each_with_its_own_seed(daemon: Daemon) -> None:
    body = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 8, "temperature": 1.0, "seed": 11}
    with daemon.http() as http:
        before = computed(http)
        three = http.post("/v1/chat/completions", json={**body, "n": 3,
                                                        "messages": [*MESSAGES[:1], {"role": "user",
                                                                                     "content": "Name a colour."}]})
        spent = computed(http) - before
        one = http.post("/v1/chat/completions", json=body).json()
        again = http.post("/v1/chat/completions", json={**body, "n": 3}).json()
    assert three.status_code == 200, three.text
    result = three.json()
    choices = result["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2] and all(c["message"]["content"] for c in choices)
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)
    prompt = result["usage"]["prompt_tokens"]
    assert 0 < result["usage"]["completion_tokens"] <= 24  # every choice's tokens, the prompt once
    assert result["usage"]["total_tokens"] == prompt + result["usage"]["completion_tokens"]
    # the others started from the first's live state: the prompt was computed once, not three times
    assert spent < prompt + 2 * 16, (spent, prompt)
    # choice 0 is the request as n=1 sends it (seed 11), the others sample with seed 11 + index
    assert again["choices"][0]["message"]["content"] == one["choices"][0]["message"]["content"]
    assert len({c["message"]["content"] for c in again["choices"]}) > 1  # different seeds, different samples


def test_n_choices_stream_each_with_its_index_and_completions_too(daemon: Daemon) -> None:
    with daemon.http() as http, http.stream("POST", "/v1/chat/completions", json={
            "model": "smollm2", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        completions = http.post("/v1/completions", json={"model": "smollm2", "prompt": "The sky is", "n": 2,
                                                          "max_tokens": 4, "temperature": 0, "logprobs": 1}).json()
    texts: dict[int, str] = {0: "", 1: ""}
    finished = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
            if choice["finish_reason"]:
                finished[choice["index"]] = choice["finish_reason"]
    assert set(finished) == {0, 1} and texts[0] and texts[0] == texts[1]  # greedy: both the same answer
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert sorted(roles) == [0, 1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 12
    assert [c["index"] for c in completions["choices"]] == [0, 1]
    assert completions["choices"][0]["text"] == completions["choices"][1]["text"]
    assert all(len(c["logprobs"]["tokens"]) >= 1 for c in completions["choices"])


@pytest.mark.parametrize("n", [0, 9, -1, "two", 2.5])
def test_a_bad_n_is_a_400_naming_it(daemon: Daemon, n: Any) -> None:
    with daemon.http() as http:
        response = http.post("/v1/chat/completions", json={"model": "smollm2", "messages": MESSAGES, "n": n})
    assert response.status_code == 400, response.text
    assert "'n'" in response.text or '"n"' in response.text or "n:" in response.text


def test_a_client_that_leaves_mid_stream_stops_every_choice(daemon: Daemon) -> None:
    body = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True, "n": 3,
            "stream": True, "temperature": 0.7}
    with daemon.http() as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            seen = set()
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    seen.update(c["index"] for c in json.loads(line[6:])["choices"])
                if seen == {0, 1, 2}:
                    break  # every choice is generating: leave

        def active() -> int:
            return sum(m["active_requests"] for m in http.get("/api/ps").json()["models"])

        deadline = time.monotonic() + 20  # 3 x 400 tokens would take far longer: they were stopped
        while active() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert active() == 0
        after = http.post("/v1/chat/completions", json={"model": "smollm2", "messages": MESSAGES, "max_tokens": 4,
                                                        "temperature": 0, "n": 2})
    assert after.status_code == 200 and len(after.json()["choices"]) == 2
    assert after.json()["usage"]["completion_tokens"] <= 8
