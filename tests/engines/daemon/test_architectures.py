"""The prompt cache through a real daemon on the architectures agents run on (random-weight fixtures of llama.cpp's
own: tests/archfixtures.py). Every reuse path (a live sequence, the RAM tier, the disk after a restart, a
sub-agent sharing the system prompt, a branch from a turn of the history, an edited history, a retry of the same
prompt live, after an edit and after a restart, a conversation fitted past the window) answers exactly as a cold
daemon does, and reuses at least 95% of what the dense control (llama's fixture with the same chat template, so the
same tokenizer and prompts) reuses on the same conversation; an edit reuses up to the last checkpoint before it.
Plus what a file llama.cpp cannot load gets: a clear error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import httpx
import llama_cpp
import pytest

from localai.engines.slot_cache import CHECKPOINT_MARGIN
from tests.archfixtures import BY_NAME, FIXTURES, rewrite
from tests.conftest import Daemon, start_daemon

NAMES = [fixture.name for fixture in FIXTURES]
SYSTEM = ("You are a careful coding agent working in a Python repository. Follow its conventions, run the tests "
          "before you answer, keep every change small and explain it in a sentence or two. ") * 2
TASK = "Please look at main.py and tell me what the function parse_args does."
EDITED = "Please look at util.py and tell me what the helper load_config does, and whether it caches."
FOLLOW_UPS = ["Now change it to accept a --verbose flag.", "Run the tests and report what fails.",
              "Fix the first failure.", "Show me the diff."]


class Conversation:
    """One session's turns against one model: each request, its answer, cached tokens and cache source."""

    def __init__(self, daemon: Daemon, model: str, session: str, first: str = TASK) -> None:
        self.daemon, self.model, self.session = daemon, model, session
        self.messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": first}]

    def ask(self) -> dict[str, Any]:
        result = ask(self.daemon, self.model, self.messages, self.session)
        result["messages"] = list(self.messages)
        return result

    def answer(self, result: dict[str, Any], follow_up: str) -> None:
        self.messages += [{"role": "assistant", "content": result["text"]}, {"role": "user", "content": follow_up}]


def ask(daemon: Daemon, model: str, messages: list[dict[str, str]], session: str,
        salt: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0,
                            "prompt_cache_key": session}
    if salt is not None:
        body["cache_salt"] = salt  # a partition of its own: no sequence's live state is reused for it
    with daemon.http(timeout=300) as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    usage = data["usage"]
    return {"text": data["choices"][0]["message"]["content"] or "", "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"],
            "source": response.headers.get("x-localai-cache", "miss"),
            "fitted": response.headers.get("x-localai-context-fitted")}


def create(daemon: Daemon, name: str, path: Path, extra: str = "") -> None:
    with daemon.http() as http:
        created = http.post("/api/create", json={"model": name, "modelfile": f"FROM {path}\n{extra}"})
    assert created.status_code == 200, created.text


def paths(daemon: Daemon, model: str) -> dict[str, dict[str, Any]]:
    """The reuse paths in the order an agent meets them, on ``model`` (two sequences: the third session takes
    the first one's, which then comes back from the RAM tier): among them turn 2 asked twice (a client retrying
    the same prompt: its reply in the KV is not part of the prompt), and turn 3 again after the session sent an
    edited history."""
    s1 = Conversation(daemon, model, "s1")
    sub = Conversation(daemon, model, "sub", first="Find where the configuration file is read, without editing.")
    other = Conversation(daemon, model, "s3", first="Summarise the README in three lines.")
    seen = {"t1": s1.ask()}
    s1.answer(seen["t1"], FOLLOW_UPS[0])
    seen["t2 live"] = s1.ask()
    seen["retry"] = s1.ask()
    seen["sub-agent"] = sub.ask()  # the parent's system prompt and tools, a task of its own
    branch = Conversation(daemon, model, "branch")  # the parent's history after its first turn, another request
    branch.messages = [*s1.messages[:-1], {"role": "user", "content": "Instead, list the tests for it."}]
    seen["branch"] = branch.ask()
    seen["other"] = other.ask()  # both sequences taken: s1's goes
    s1.answer(seen["t2 live"], FOLLOW_UPS[1])
    seen["t3 ram"] = s1.ask()
    edited = Conversation(daemon, model, "s1", first=EDITED)
    edited.messages += s1.messages[2:]
    seen["edited"] = edited.ask()
    seen["retry after edit"] = ask(daemon, model, seen["t3 ram"]["messages"], "s1")
    seen["retry after edit"]["messages"] = seen["t3 ram"]["messages"]
    s1.answer(seen["t3 ram"], FOLLOW_UPS[2])
    seen["t4 before restart"] = s1.ask()
    s1.answer(seen["t4 before restart"], FOLLOW_UPS[3])
    seen["next"] = {"messages": list(s1.messages)}  # asked after the restart
    return seen


def after_restart(daemon: Daemon, model: str, seen: dict[str, dict[str, Any]]) -> None:
    """The walk's requests after a restart, where only the disk remembers: the next turn, then turn 4 again (a
    client retrying after a crash: it returns to the prompt-end checkpoint, on disk with the turn)."""
    seen["after restart"] = ask(daemon, model, seen["next"]["messages"], "s1")
    seen["after restart"]["messages"] = seen.pop("next")["messages"]
    seen["retry after restart"] = ask(daemon, model, seen["t4 before restart"]["messages"], "s1")
    seen["retry after restart"]["messages"] = seen["t4 before restart"]["messages"]


def fitted(daemon: Daemon, model: str) -> dict[str, dict[str, Any]]:
    """A conversation longer than a 512-token window: fitted (old turns dropped), then its next turn."""
    long = Conversation(daemon, model, "long")
    for turn in range(10):
        long.messages += [{"role": "assistant", "content": f"Step {turn}: " + "read the module and noted it. " * 6},
                          {"role": "user", "content": FOLLOW_UPS[turn % 4] + " Keep going. " * 4}]
    first = long.ask()
    long.answer(first, "And then?")
    return {"fitted": first, "after fitting": long.ask()}


def cold_answers(home: Path, runs: list[tuple[str, Path, str, list[dict[str, str]]]]) -> list[str]:
    """Each prompt answered by a daemon without a cache, each in a cache partition of its own (no live state
    either: a sequence is reused only within its partition, so every prompt is prefilled from nothing). A model
    with a Modelfile ``extra`` (the small window) keeps one partition, where the daemon remembers how it fitted the
    conversation's earlier turn, and is unloaded before each prompt instead."""
    with start_daemon(home, cache_max_bytes="0") as daemon:
        created: set[str] = set()
        answers = []
        for number, (model, path, extra, messages) in enumerate(runs):
            if model not in created:
                create(daemon, model, path, extra)
                created.add(model)
            if extra:
                with daemon.http() as http:
                    http.post("/api/generate", json={"model": model, "keep_alive": 0})
            cold = ask(daemon, model, messages, "cold", salt="fitted" if extra else f"cold-{number}")
            assert cold["cached"] == 0, cold
            answers.append(cold["text"])
        return answers


@pytest.mark.parametrize("name", NAMES)
def test_every_reuse_path_answers_as_a_cold_daemon_and_reuses_as_the_dense_control(
        arch_fixtures: Path, name: str, tmp_path: Path) -> None:
    fixture = BY_NAME[name]
    model = arch_fixtures / f"{name}.gguf"
    control = tmp_path / "control.gguf"  # llama's weights, this family's template: the same prompts, dense
    rewrite(arch_fixtures / "llama.gguf", control, _template(model))
    small = "PARAMETER num_ctx 512\n"
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for which, path in ((name, model), ("control", control)):  # homes of their own: the llama fixture is its control
        with start_daemon(tmp_path / which) as daemon:
            create(daemon, which, path)
            create(daemon, f"{which}-512", path, small)
            results[which] = paths(daemon, which)
            results[which].update(fitted(daemon, f"{which}-512"))
        with start_daemon(tmp_path / which) as daemon:  # a restart: only the disk remembers
            after_restart(daemon, which, results[which])

    mine, dense = results[name], results["control"]
    keys = check_answers(tmp_path / "cold", name, model, mine, small)
    check_reuse(f"{name} ({fixture.kind})", mine, dense, keys)


def check_answers(home: Path, name: str, path: Path, mine: dict[str, dict[str, Any]], small: str) -> list[str]:
    """Every request of a walk answered again by a cold daemon (``name``-512 with ``small`` for the fitted ones):
    the answers must be the same. Returns the requests' keys."""
    keys = [key for key, seen in mine.items() if "messages" in seen]
    runs = [(name if "fit" not in key else f"{name}-512", path, small if "fit" in key else "", mine[key]["messages"])
            for key in keys]
    cold = cold_answers(home, runs)
    for key, expected in zip(keys, cold, strict=True):
        assert mine[key]["text"] == expected, (name, key)  # every path: the cold daemon's answer
    return keys


def check_reuse(label: str, mine: dict[str, dict[str, Any]], dense: dict[str, dict[str, Any]],
                keys: list[str]) -> None:
    """A walk's reuse against the dense control's on the same conversation (printed, then asserted)."""
    table = {key: (mine[key]["cached"], mine[key]["prompt"], dense[key]["cached"], dense[key]["prompt"])
             for key in keys}
    print(f"{label}: " + ", ".join(f"{k} {a}/{b} (control {c}/{d})" for k, (a, b, c, d) in table.items()))
    assert {mine[key]["source"] for key in keys} >= {"live", "ram", "disk"}
    for key in ("t2 live", "retry", "t3 ram", "retry after edit", "t4 before restart", "sub-agent", "branch",
                "after restart", "retry after restart", "after fitting"):
        share, control_share = mine[key]["cached"] / mine[key]["prompt"], dense[key]["cached"] / dense[key]["prompt"]
        assert share >= 0.95 * control_share, (label, key, table[key])
    assert mine["fitted"]["fitted"] and "dropped_messages=0" not in mine["fitted"]["fitted"]
    # an edit of the first task: back to the last checkpoint before it (the shared system segment)
    assert mine["edited"]["cached"] <= dense["edited"]["cached"]
    assert mine["edited"]["cached"] >= min(mine["sub-agent"]["cached"], dense["edited"]["cached"]) > 0


@pytest.mark.parametrize("name", ["nemotron_h", "granitehybrid"])
def test_a_cold_prompt_sent_again_evaluates_its_last_token_only(arch_fixtures: Path, name: str,
                                                                tmp_path: Path) -> None:
    """A hybrid keeps, in RAM, the state before a cold prompt's last token: the same prompt again (a retry, a
    regenerate, a benchmark's held prompt) evaluates one token, as a dense model does, not the CHECKPOINT_MARGIN
    tokens after the prompt-end checkpoint. That state is not saved: after a restart the retry returns to the
    checkpoint on disk, and a cold prompt's turn writes one recurrent state, not two. (Not on Qwen3.5's fixtures:
    their thinking template renders the reply in the history without its reasoning, so the follow-up that caches
    the reply cuts the sequence back to the prompt-end checkpoint, and the state before the last token goes with
    what came after it; a retry there evaluates CHECKPOINT_MARGIN tokens, as before.)"""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    with start_daemon(tmp_path / "home") as daemon:
        create(daemon, name, arch_fixtures / f"{name}.gguf")
        first = ask(daemon, name, messages, "s1")
        again = ask(daemon, name, messages, "s1")
        assert first["cached"] == 0 and again["prompt"] == first["prompt"]
        assert again["cached"] == again["prompt"] - 1 and again["text"] == first["text"], (first, again)
    with start_daemon(tmp_path / "home") as daemon:
        restarted = ask(daemon, name, messages, "s1")
    assert restarted["cached"] == restarted["prompt"] - CHECKPOINT_MARGIN and restarted["source"] == "disk", restarted
    assert restarted["text"] == first["text"]


def _template(path: Path) -> str:
    reader = gguf.GGUFReader(path)
    return str(reader.get_field(gguf.Keys.Tokenizer.CHAT_TEMPLATE).contents())


def test_an_architecture_llama_cpp_does_not_know_is_a_clear_error(arch_fixtures: Path, tmp_path: Path) -> None:
    """A GGUF of an architecture this llama.cpp does not know (a newer model): the error names the architecture
    and the llama-cpp-python that would need an upgrade; the daemon and other models go on."""
    future = tmp_path / "future.gguf"
    _copy_with_architecture(arch_fixtures / "llama.gguf", future, "futurenet")
    truncated = tmp_path / "truncated.gguf"
    data = (arch_fixtures / "qwen35.gguf").read_bytes()
    truncated.write_bytes(data[:len(data) * 2 // 3])
    with start_daemon(tmp_path / "home") as daemon:
        create(daemon, "future", future)
        with daemon.http() as http:
            refused = http.post("/v1/chat/completions", json={"model": "future", "max_tokens": 4,
                                                             "messages": [{"role": "user", "content": "hi"}]})
            assert refused.status_code in (400, 422, 500, 503), refused.text
            message = refused.text
            assert "futurenet" in message and f"llama-cpp-python {llama_cpp.__version__}" in message, message
            create_truncated = http.post("/api/create", json={"model": "cut", "modelfile": f"FROM {truncated}\n"})
            if create_truncated.status_code == 200:  # taken at create: then loading it says what is wrong
                cut = http.post("/v1/chat/completions", json={"model": "cut", "max_tokens": 4,
                                                             "messages": [{"role": "user", "content": "hi"}]})
                assert cut.status_code >= 400 and ("truncated" in cut.text or "incomplete" in cut.text), cut.text
            else:
                assert create_truncated.status_code == 400, create_truncated.text
                assert "truncated" in create_truncated.text or "incomplete" in create_truncated.text
            create(daemon, "llama", arch_fixtures / "llama.gguf")
            fine = http.post("/v1/chat/completions", json={"model": "llama", "max_tokens": 4,
                                                          "messages": [{"role": "user", "content": "hi"}]})
            assert fine.status_code == 200, fine.text
        assert httpx.get(f"{daemon.base_url}/health").status_code == 200


def _copy_with_architecture(source: Path, target: Path, arch: str) -> None:
    from gguf.scripts.gguf_new_metadata import copy_with_new_metadata

    reader = gguf.GGUFReader(source)
    old = str(reader.get_field(gguf.Keys.General.ARCHITECTURE).contents())
    writer = gguf.GGUFWriter(target, arch=arch)
    renamed = [field.name for field in reader.fields.values() if field.name.startswith(f"{old}.")]
    empty = [field.name for field in reader.fields.values()
             if field.types and field.types[0] == gguf.GGUFValueType.ARRAY and not field.data]
    copy_with_new_metadata(reader, writer, {}, [*renamed, *empty])


def test_show_says_what_the_cache_keeps_and_whether_speculative_decoding_runs(arch_fixtures: Path,
                                                                              tmp_path: Path) -> None:
    """Speculative decoding never runs on a state that cannot drop a rejected draft (recurrent layers, a sliding
    window): off for those models even when asked, and /api/show says so, before and after the model loads."""
    with start_daemon(tmp_path / "home") as daemon, daemon.http() as http:
        for name in ("llama", "qwen35", "gpt-oss"):
            create(daemon, name, arch_fixtures / f"{name}.gguf")
        shown = {name: http.post("/api/show", json={"model": name}).json() for name in ("llama", "qwen35", "gpt-oss")}
        assert shown["llama"]["speculative"].startswith("when asked") and "checkpoints" not in shown["llama"]["state"]
        assert shown["qwen35"]["speculative"].startswith("off: recurrent layers")
        assert shown["gpt-oss"]["speculative"].startswith("off: a 32-token sliding window")
        for name in ("qwen35", "gpt-oss"):
            assert "checkpoints" in shown[name]["state"]
            asked = http.post("/v1/chat/completions", json={
                "model": name, "max_tokens": 16, "temperature": 0, "speculative": "on",
                "messages": [{"role": "user", "content": "Repeat: one two three one two three one two three"}]})
            assert asked.status_code == 200, asked.text
            details = asked.json()["usage"].get("completion_tokens_details") or {}
            assert not details.get("accepted_prediction_tokens") and not details.get("rejected_prediction_tokens")
            again = http.post("/api/show", json={"model": name}).json()  # loaded: the worker's own report
            assert (again["state"], again["speculative"]) == (shown[name]["state"], shown[name]["speculative"])
