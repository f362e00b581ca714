"""One chat turn on screen: the user's prompt, and the model's reply as Markdown with its statistics below (a
thinking model's reasoning above it, collapsed)."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.widgets import Collapsible, Label, Markdown, Static
from textual.widgets.markdown import MarkdownStream

from localai.conversations import ChatMessage, ChatStats


class UserMessage(Static):
    """The prompt as typed (never interpreted as markup)."""

    def __init__(self, message: ChatMessage) -> None:
        super().__init__(message.content, markup=False, classes="user-message")
        self.message = message


def stats_line(stats: ChatStats | None, *, stopped: bool = False) -> str:
    """``89.1 tokens/s · 32 tokens · prompt 120 tokens, 96 from cache (80%)``: what the user can act on."""
    if stats is None:
        return "stopped" if stopped else ""
    cached = f"{stats.cached_tokens} from cache"
    if stats.prompt_tokens:
        cached += f" ({stats.cached_tokens / stats.prompt_tokens:.0%})"
    parts = [f"{stats.tokens_per_second:.1f} tokens/s", f"{stats.completion_tokens} tokens",
             f"prompt {stats.prompt_tokens} tokens, {cached}"]
    return " · ".join(["stopped", *parts] if stopped else parts)


def thinking_title(thinking: str, *, streaming: bool) -> str:
    """The reasoning block's title: ``Thinking…`` while it streams, then how long it is."""
    if streaming:
        return "Thinking…"
    words = len(thinking.split())
    return f"Thinking ({words} word{'' if words == 1 else 's'})"


def code_blocks(markdown: str) -> list[str]:
    """The fenced and indented code blocks of a Markdown text, in order."""
    from markdown_it import MarkdownIt

    return [token.content for token in MarkdownIt("commonmark").parse(markdown)
            if token.type in ("fence", "code_block")]


class Reply(Vertical, can_focus=True):
    """The model's reply. Focus it (Tab or click) to copy it or one of its code blocks."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("c", "copy_reply", "Copy reply"), Binding("b", "copy_code", "Copy code block"),
    ]

    def __init__(self, message: ChatMessage) -> None:
        super().__init__(classes="reply")
        self.message = message
        self._code_index = 0  # which code block the next "copy code" takes, counting from the last

    def compose(self) -> ComposeResult:
        message = self.message
        # The reasoning, collapsed above the answer (Enter or a click on its title opens it); hidden without any
        with Collapsible(title=thinking_title(message.thinking, streaming=False), collapsed=True,
                         classes="reply-thinking"):
            yield Markdown(message.thinking, classes="thinking-body")
        yield Markdown(message.content, classes="reply-body")
        waiting = not (message.content or message.stats or message.stopped)
        yield Label("waiting for the model…" if waiting else stats_line(message.stats, stopped=message.stopped),
                    classes="reply-stats")

    def on_mount(self) -> None:
        self.thinking.display = bool(self.message.thinking)

    @property
    def body(self) -> Markdown:
        return self.query_one(".reply-body", Markdown)

    @property
    def thinking(self) -> Collapsible:
        return self.query_one(".reply-thinking", Collapsible)

    def stream(self) -> MarkdownStream:
        """A stream that appends fragments to the Markdown as they arrive (no re-render of what is there)."""
        self.add_class("streaming")
        return Markdown.get_stream(self.body)

    def stream_thinking(self) -> MarkdownStream:
        """The same for the reasoning: its block appears, collapsed, titled as still thinking."""
        self.add_class("streaming")
        self.thinking.display = True
        self.thinking.title = thinking_title("", streaming=True)
        return Markdown.get_stream(self.query_one(".thinking-body", Markdown))

    def finish(self) -> None:
        self.remove_class("streaming")
        if self.message.thinking:
            self.thinking.title = thinking_title(self.message.thinking, streaming=False)
        self.query_one(".reply-stats", Label).update(stats_line(self.message.stats, stopped=self.message.stopped))

    def action_copy_reply(self) -> None:
        self.app.copy_to_clipboard(self.message.content)
        self.app.notify(f"Copied the reply ({len(self.message.content)} characters)")

    def action_copy_code(self) -> None:
        blocks = code_blocks(self.message.content)
        if not blocks:
            self.app.notify("This reply has no code block", severity="warning")
            return
        index = len(blocks) - 1 - self._code_index % len(blocks)
        self._code_index += 1
        self.app.copy_to_clipboard(blocks[index])
        self.app.notify(f"Copied code block {index + 1} of {len(blocks)}"
                        + (" (b again for the one before)" if len(blocks) > 1 else ""))
