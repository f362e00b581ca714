"""Untrusted chat templates, in-process on the scripted engine: one that cannot render a short conversation in time
is refused when the model is created (from a Modelfile's TEMPLATE or a GGUF's own), one that hangs or fails on a
conversation is a 400 naming the model, and renders of other models go on meanwhile."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from localai.models import renderer
from localai.models.modelfile import MAX_TEMPLATE_CHARS
from tests.metagguf import metadata_gguf

LOOP = "{% set r = range(99999) %}{% for a in r %}{% for b in r %}{% endfor %}{% endfor %}"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HANGS_ON_LONG = "{% if messages | length > 4 %}" + LOOP + "{% endif %}" + CHATML


@pytest.fixture(autouse=True)
def short_deadline(api: TestClient, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(renderer.pool(), "seconds", 1.0)
    yield


def create(api: TestClient, name: str, template: str, base: str = "smollm2") -> dict[str, object]:
    modelfile = f'FROM {base}\nPARAMETER temperature 0\nTEMPLATE """{template}"""\n'
    response = api.post("/api/create", json={"model": name, "modelfile": modelfile})
    return {**response.json(), "status": response.status_code}


def chat(api: TestClient, model: str, turns: int = 1) -> tuple[int, str]:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(turns)]
    response = api.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 4})
    return response.status_code, response.text


def test_a_template_that_never_ends_is_refused_at_create(api: TestClient) -> None:
    created = create(api, "tpl-loop", LOOP)
    assert created["status"] == 400, created
    assert "TEMPLATE" in str(created["error"]) and "deadline" in str(created["error"])
    assert api.post("/api/show", json={"model": "tpl-loop"}).status_code == 404


def test_a_gguf_whose_own_template_never_ends_is_refused_at_create(api: TestClient, tmp_path: Path) -> None:
    weights = metadata_gguf(tmp_path / "hostile.gguf", arch="llama", context_length=4096, template=LOOP)
    response = api.post("/api/create", json={"model": "tpl-gguf", "modelfile": f"FROM {weights}\n"})
    assert response.status_code == 400, response.text
    assert "the chat template in the weights" in response.json()["error"]
    fine = metadata_gguf(tmp_path / "fine.gguf", arch="llama", context_length=4096, template=CHATML)
    assert api.post("/api/create", json={"model": "tpl-gguf-ok", "modelfile": f"FROM {fine}\n"}).status_code == 200


@pytest.mark.parametrize(("template", "needle"), [
    ("{{ " + "(" * 100_000 + "1" + ")" * 100_000 + " }}", "nested too deeply"),
    ("{% if true %}" * 5000 + "x" + "{% endif %}" * 5000, "nested too deeply"),
    ("x" * (MAX_TEMPLATE_CHARS + 1), "over the limit of"),
], ids=["100k-parentheses", "5000-ifs", "over-the-size-limit"])
def test_a_gguf_whose_own_template_a_modelfile_would_refuse_is_refused_at_create(
        api: TestClient, tmp_path: Path, template: str, needle: str) -> None:
    """The weights' template meets TEMPLATE's bounds: before, a GGUF header's was only rendered, which a template
    that never parses does not overrun, so the model was created and every request to it was a 400."""
    assert create(api, "tpl-modelfile", template)["status"] == 400  # what a Modelfile's TEMPLATE gets
    weights = metadata_gguf(tmp_path / "deep.gguf", arch="llama", context_length=4096, template=template)
    name = f"tpl-deep-{len(template)}"
    response = api.post("/api/create", json={"model": name, "modelfile": f"FROM {weights}\n"})
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert "the chat template in the weights" in error and needle in error and "TEMPLATE of its own" in error, error
    assert api.post("/api/show", json={"model": name}).status_code == 404
    given = f'FROM {weights}\nTEMPLATE """{CHATML}"""\n'  # the fix the error names
    assert api.post("/api/create", json={"model": name, "modelfile": given}).status_code == 200


def test_a_template_that_hangs_on_a_conversation_is_a_400_naming_the_model(api: TestClient) -> None:
    assert create(api, "tpl-later", HANGS_ON_LONG)["status"] == 200  # a short conversation renders
    assert chat(api, "tpl-later")[0] == 200
    status, text = chat(api, "tpl-later", turns=7)
    assert status == 400 and "tpl-later" in text and "deadline" in text, text
    assert chat(api, "smollm2")[0] == 200


def test_other_models_answer_while_a_hanging_template_has_requests_waiting(api: TestClient) -> None:
    assert create(api, "tpl-many", HANGS_ON_LONG)["status"] == 200
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        hanging = [pool.submit(chat, api, "tpl-many", 7) for _ in range(10)]
        # Each hanging render holds a process until the render deadline, which is also how long a waiting render
        # may wait: a chat queued behind them would be refused (503), whatever the machine's speed. (Before, `not
        # all(done)` after the chats said only that they came back before the backlog was gone.)
        normal = [chat(api, "smollm2") for _ in range(3)]
        assert all(status == 200 for status, _ in normal), normal
        results = [future.result(timeout=60) for future in hanging]
    assert all(status == 400 and "tpl-many" in text for status, text in results), results


@pytest.mark.parametrize(("template", "needle"), [
    ("{{ raise_exception('this model takes no system role') }}", "takes no system role"),
    ("{{ range(100000000) | list }}", "Range too big"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ messages[99]['content'] }}", "tpl-broken"),
])
def test_a_template_that_fails_is_a_400_naming_the_model(api: TestClient, template: str, needle: str) -> None:
    assert create(api, "tpl-broken", template)["status"] == 200  # failing is not hanging: creating it is fine
    status, text = chat(api, "tpl-broken")
    assert status == 400 and "tpl-broken" in text and needle in text, text
