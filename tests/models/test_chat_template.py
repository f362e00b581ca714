"""Chat templates run sandboxed and bounded: no other files, no runaway loops, no gigabyte prompts."""

from __future__ import annotations

import pytest

from localai.errors import InvalidRequest
from localai.models import chat_template

MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_normal_template_renders() -> None:
    assert chat_template.render(None, MESSAGES) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_runaway_loop_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.3)
    loops = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(InvalidRequest, match="stopped"):
        chat_template.render(loops, MESSAGES)


def test_huge_values_are_refused_before_they_are_built() -> None:
    with pytest.raises(InvalidRequest, match="over the limit"):
        chat_template.render("{{ 'x' * 10000000000 }}", MESSAGES)
    with pytest.raises(InvalidRequest, match="exponent"):
        chat_template.render("{{ 9 ** 99999999 }}", MESSAGES)


def test_includes_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="include"):
        chat_template.render("{% include '/etc/passwd' %}", MESSAGES)
