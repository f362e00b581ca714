"""Templates render in processes of their own: one that never ends is killed at its deadline, one that eats memory
ends its process, and neither holds the renders of other templates nor outlives the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from localai.errors import ModelfileError, ServerBusy
from localai.models import renderer
from localai.models.chat_template import RenderCall
from localai.models.renderer import Renderer, RenderFailed
from tests.observe import wait_for

# No call, attribute or output inside the loops: nothing a check inside the process could see.
HANGS = "{% set r = range(99999) %}{% for a in r %}{% for b in r %}{% endfor %}{% endfor %}x"
# Passes a short conversation, hangs on a long one (what a create-time check cannot catch).
HANGS_LATER = ("{% if messages | length > 4 %}" + HANGS + "{% endif %}"
               "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
MEMORY = "{% set x = 'a' * 60000000 %}{{ [x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, " \
         "x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x] | join('') | length }}"


def call(source: str | None, turns: int = 1) -> RenderCall:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(turns)]
    return RenderCall(source=source, messages=messages, bos_token="", eos_token="", add_generation_prompt=True,
                      extra={})


@pytest.fixture
def pool() -> Iterator[Renderer]:
    instance = Renderer(main=2, seconds=1.0)
    yield instance
    instance.close()


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set when a render process has been sent a request and its answer is being read: a render is under way."""
    event = threading.Event()
    read = renderer.HelperProcess._read

    def reading(self: renderer.HelperProcess, size: int, deadline: float, demote_at: float | None = None) -> bytes:
        event.set()
        return read(self, size, deadline, demote_at)

    monkeypatch.setattr(renderer.HelperProcess, "_read", reading)
    return event


@pytest.fixture
def demoted(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set when a render process's priority has been lowered (a render on the main lane past DEMOTE_AFTER)."""
    event = threading.Event()
    demote = renderer.HelperProcess._demote

    def demoting(self: renderer.HelperProcess) -> None:
        demote(self)
        event.set()

    monkeypatch.setattr(renderer.HelperProcess, "_demote", demoting)
    return event


def pids(pool: Renderer) -> set[int]:
    return {process.pid for process in pool._processes}


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet is not)."""
    stat = Path(f"/proc/{pid}/stat")
    if stat.parent.parent.exists():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_renders_reuse_their_processes(pool: Renderer) -> None:
    first = pool.render([call(None)])
    assert first[0].text == "<|im_start|>user\nturn 0<|im_end|>\n<|im_start|>assistant\n"
    before = pids(pool)
    for _ in range(20):
        assert pool.render([call(None)])[0].text == first[0].text
    assert pids(pool) == before and len(before) == 3  # two trusted and one on probation, never restarted
    assert pool.trusted(None)


def test_a_loop_that_never_ends_is_killed_and_its_process_replaced(pool: Renderer) -> None:
    pool.render([call(None)])
    before = pids(pool)
    with pytest.raises(RenderFailed, match="deadline"):
        pool.render([call(HANGS)])
    gone = before - pids(pool)  # killed and reaped before the render's answer
    assert len(gone) == 1 and not any(alive(pid) for pid in gone)
    assert not pool.trusted(HANGS)
    assert pool.render([call(None)])[0].text  # the others still render


def test_a_hanging_templates_backlog_never_holds_other_templates(pool: Renderer) -> None:
    """The backlog may wait 5 s for the processes; the normal render only its 1 s deadline, so one that waited
    behind the backlog would be refused (ServerBusy), whatever the machine's speed. (Before, ``not all(done)``
    after the normal render said only that it came back before the backlog was gone.)"""
    assert pool.render([call(HANGS_LATER)])[0].text  # trusted: a short conversation renders
    hanging = [pool.submit([call(HANGS_LATER, turns=6)], seconds=5.0) for _ in range(12)]
    normal = pool.submit([call(None)])
    assert normal.result(timeout=30)[0].text  # within its own deadline: it did not wait for them
    for future in hanging:
        with pytest.raises(RenderFailed):
            future.result(timeout=30)
    assert not pool.trusted(HANGS_LATER)  # quarantined: its renders now run one at a time on probation
    assert pool.render([call(HANGS_LATER)])[0].text  # and a short conversation still renders there


def test_errors_of_a_template_are_outcomes_not_failures_of_the_pool(pool: Renderer) -> None:
    outcomes = pool.render([call("{{ range(100000000) | list }}"), call("{{ raise_exception('no system') }}"),
                            call("{{ 1 / 0 }}"), call(None)])
    assert "Range too big" in (outcomes[0].error or "")
    assert "no system" in (outcomes[1].error or "")
    assert "ZeroDivisionError" in (outcomes[2].error or "")
    assert outcomes[3].text


def test_a_template_that_eats_memory_ends_its_process_not_the_pool(pool: Renderer) -> None:
    try:
        outcome = pool.render([call(MEMORY)])[0]
        assert outcome.error is not None and "MiB" in outcome.error  # MemoryError under the address-space cap
    except RenderFailed as exc:
        assert "died" in exc.message  # or killed on the way there
    assert pool.render([call(None)])[0].text


def test_a_render_process_that_dies_mid_render_is_a_400_and_replaced(pool: Renderer, sent: threading.Event) -> None:
    slow = pool.submit([call(HANGS)], seconds=30)
    assert sent.wait(30)  # its process has it
    for pid in pids(pool):
        os.kill(pid, signal.SIGKILL)  # whichever renders it: the others are replaced as they are used
    with pytest.raises(RenderFailed, match="died"):
        slow.result(timeout=30)
    for _ in range(3):
        outcome = None
        try:
            outcome = pool.render([call(None)])[0]
        except RenderFailed:
            continue  # a killed idle process is noticed by the render that uses it
        assert outcome.text
        break
    else:
        pytest.fail("the pool never recovered")


def test_closing_refuses_what_waits_and_ends_the_processes(pool: Renderer, sent: threading.Event) -> None:
    pool.render([call(None)])
    started = pids(pool)
    sent.clear()
    waiting = [pool.submit([call(HANGS)], seconds=30) for _ in range(3)]  # one runs (probation), two wait
    assert sent.wait(30)
    pool.close()
    for future in waiting:
        with pytest.raises((ServerBusy, RenderFailed)):
            future.result(timeout=10)
    assert not any(alive(pid) for pid in started)  # close() killed and reaped them
    with pytest.raises(ServerBusy):
        pool.submit([call(None)])


def test_a_render_process_killed_while_its_answer_is_read_has_died_not_failed_with_an_os_error(
        pool: Renderer) -> None:
    """close() kills the processes while their lanes' threads read their answers: a read from a killed process (its
    selector and pipe closed under it) is a process that died, which close() answers as the daemon shutting down;
    it escaped as `OSError: [Errno 9] Bad file descriptor` (a fresh clone's make test, once)."""
    pool.render([call(None)])
    process = next(iter(pool._processes))
    process.kill()  # what close() does to a process a lane is reading from
    with pytest.raises(renderer.Died):
        process._read(4, time.monotonic() + 5)


def test_render_processes_end_with_the_process_that_started_them() -> None:
    script = ("import threading, time\nfrom localai.models import renderer\nsent = threading.Event()\n"
              "read = renderer.HelperProcess._read\n"
              "def reading(self, *args):\n    sent.set()\n    return read(self, *args)\n"
              "renderer.HelperProcess._read = reading\npool = renderer.Renderer(main=2)\n"
              "pool.submit([{'source': " + repr(HANGS) + ", 'messages': [], 'bos_token': '', 'eos_token': '', "
              "'add_generation_prompt': True, 'extra': {}}], seconds=60)\nsent.wait(60)\n"
              "while len(pool._processes) < 3:\n    time.sleep(0.01)\n"  # every lane's process started
              "print(' '.join(str(p.pid) for p in pool._processes), flush=True)\ntime.sleep(60)\n")
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as parent:
        assert parent.stdout is not None
        children = [int(pid) for pid in parent.stdout.readline().split()]
        parent.kill()
    assert len(children) == 3
    # each notices its parent gone (limit_process's watch, every second); the one looping in a render included
    wait_for(lambda: not any(alive(pid) for pid in children), "the render processes to end", timeout=10)


def test_create_refuses_a_template_that_cannot_render_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    instance = Renderer(main=2, seconds=1.0)
    monkeypatch.setattr(renderer, "_pool", instance)
    with pytest.raises(ModelfileError, match="TEMPLATE: the chat template ran past its 1 s deadline"):
        renderer.check_renders(HANGS, "TEMPLATE")
    renderer.check_renders(HANGS_LATER, "TEMPLATE")  # what only a longer conversation hangs on passes here
    renderer.check_renders("{{ raise_exception('no system role') }}", "TEMPLATE")  # refusing is not hanging
    instance.close()


def test_a_quarantined_template_has_one_render_at_a_time_and_none_waiting(pool: Renderer) -> None:
    with pytest.raises(RenderFailed):
        pool.render([call(HANGS)])  # overran: quarantined
    running = pool.submit([call(HANGS)])
    refused = pool.submit([call(HANGS)])
    assert refused.done() and not running.done()  # refused at once, while the one render still runs
    with pytest.raises(RenderFailed, match="another of its renders is running"):
        refused.result()
    with pytest.raises(RenderFailed):
        running.result(timeout=30)


CALLS = "{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"


def test_a_template_stopped_by_its_own_deadline_check_is_quarantined_and_its_process_kept(pool: Renderer) -> None:
    pool.render([call(None)])
    before = pids(pool)
    outcome = pool.render([call(CALLS)])[0]  # it calls at every step: the process stops it itself
    assert outcome.overran and "longer than" in (outcome.error or "")
    assert not pool.trusted(CALLS) and pids(pool) == before


def test_a_slow_render_on_the_main_lane_is_demoted_and_its_process_replaced(pool: Renderer,
                                                                           demoted: threading.Event) -> None:
    assert pool.render([call("{{ 'x' }}")])[0].text == "x"  # trusted
    slow = "{% if messages | length > 2 %}" + CALLS + "{% endif %}x"
    assert pool.render([call(slow)])[0].text == "x"
    base = os.getpriority(os.PRIO_PROCESS, 0)
    running = pool.submit([call(slow, turns=3)])
    assert demoted.wait(30)  # past DEMOTE_AFTER: its process now yields the CPU to everything else
    niced = {pid for pid in pids(pool) if os.getpriority(os.PRIO_PROCESS, pid) == renderer.PROBATION_NICE}
    assert len(niced) == 2  # the probation process, and the demoted one
    running.exception(timeout=30)  # its lane retired the demoted process before answering
    assert len(niced & pids(pool)) == 1  # the demoted one is gone; the probation process stays
    assert pool.render([call(None)])[0].text  # a fresh one at full priority serves
    priorities = sorted(os.getpriority(os.PRIO_PROCESS, pid) for pid in pids(pool))
    assert priorities.count(renderer.PROBATION_NICE) == 1 and set(priorities) == {base, renderer.PROBATION_NICE}
