"""Chat: a conversation streamed as Markdown, kept in SQLite, each conversation its own prompt-cache session."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, ClassVar

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.reactive import var
from textual.widgets import Footer, Static
from textual.widgets.markdown import MarkdownStream

from localai.conversations import ChatMessage, ChatStats, Conversation, title_from
from localai.errors import LocalAIError

from ..api import InstalledModel
from ..widgets.messages import Reply, UserMessage
from ..widgets.prompt import PromptInput
from .base import LocalAIScreen
from .conversations import ConversationsScreen
from .dialogs import ChooseScreen
from .settings import SettingsScreen


class ChatScreen(LocalAIScreen):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new", "New"),
        Binding("ctrl+l", "conversations", "Conversations"),
        Binding("ctrl+o", "choose_model", "Model"),
        Binding("ctrl+t", "settings", "Settings"),
        Binding("ctrl+r", "copy_reply", "Copy reply"),
        Binding("ctrl+b", "copy_code", "Copy code"),
    ]

    generating: var[bool] = var(False, bindings=True)
    conversation: Conversation

    def compose(self) -> ComposeResult:
        yield Static(id="chat-info")
        yield VerticalScroll(id="messages")
        yield PromptInput(id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self.conversation = Conversation.new(self.tui.model, options=self.tui.default_options)
        self.query_one("#messages", VerticalScroll).anchor()
        self._show_info()
        self.query_one(PromptInput).focus()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            return self.generating  # shown in the footer only while a reply streams
        return True

    # -- conversations --------------------------------------------------------------------------

    def new_conversation(self, model: str | None = None) -> None:
        self._cancel_reply()
        model = model or self.conversation.model
        self.tui.model = model
        self.conversation = Conversation.new(model, system=self.conversation.system,
                                             options=self.tui.default_options)
        self.query_one("#messages", VerticalScroll).remove_children()
        self._show_info()
        self.query_one(PromptInput).focus()

    def resume(self, conversation_id: str) -> None:
        """Show a stored conversation; a damaged one is reported and the current one stays."""
        try:
            conversation = self.tui.store.load(conversation_id)
        except LocalAIError as exc:
            self.tui.report(exc, title="Cannot open the conversation")
            return
        self._cancel_reply()
        self.conversation = conversation
        self.tui.model = conversation.model
        messages = self.query_one("#messages", VerticalScroll)
        messages.remove_children()
        messages.mount_all(UserMessage(m) if m.role == "user" else Reply(m) for m in conversation.messages)
        messages.anchor()
        self._show_info()
        self.query_one(PromptInput).focus()

    def _show_info(self) -> None:
        conversation = self.conversation
        options = " ".join(f"{key}={value}" for key, value in sorted(conversation.options.items()))
        parts = [f"[b]{conversation.display_title}[/b]", f"model [b]{conversation.model}[/b]",
                 f"session {conversation.id[:8]}"]
        if conversation.system:
            parts.append("system prompt set")
        if options:
            parts.append(options)
        self.query_one("#chat-info", Static).update(" · ".join(parts))

    def _save(self) -> None:
        try:
            self.tui.store.save(self.conversation)
        except Exception as exc:  # sqlite3 errors (a locked or read-only database): keep chatting, say so
            self.tui.report(exc, title="The conversation could not be saved")

    # -- sending and streaming --------------------------------------------------------------------

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        text = event.text.strip()
        if not text:
            return
        if self.generating:
            self.notify("A reply is still streaming: Esc stops it", severity="warning")
            return
        event.prompt.clear()
        prompt = ChatMessage("user", text)
        self.conversation.messages.append(prompt)
        if not self.conversation.title:
            self.conversation.title = title_from(text)
            self._show_info()
        reply = Reply(ChatMessage("assistant", ""))
        messages = self.query_one("#messages", VerticalScroll)
        await messages.mount(UserMessage(prompt), reply)  # composed before the reply's first piece arrives
        messages.anchor()
        self.generating = True
        self.generate(prompt, reply)

    @work(exclusive=True, group="reply", exit_on_error=False)
    async def generate(self, prompt: ChatMessage, reply: Reply) -> None:
        """Stream the reply. Cancelling this worker (Esc) closes the HTTP stream, which stops decoding."""
        message = reply.message
        conversation = self.conversation
        stream: MarkdownStream | None = None  # started with the first text, so an early failure has none to stop
        thinking: MarkdownStream | None = None  # the reasoning's, likewise
        failed: BaseException | None = None
        try:
            await self.api.client.ensure_running()  # starts the daemon again if it went away
            async for item in self.api.chat(conversation):
                thought = item.get("message", {}).get("thinking", "")
                if thought:
                    message.thinking += thought
                    thinking = thinking or reply.stream_thinking()
                    await thinking.write(thought)
                text = item.get("message", {}).get("content", "")
                if text:
                    message.content += text
                    stream = stream or reply.stream()
                    await stream.write(text)
                if item.get("done"):
                    message.stats = ChatStats.from_final(item)
        except asyncio.CancelledError:
            message.stopped = True
            raise
        except Exception as exc:
            failed = exc
        finally:
            for started in (thinking, stream):
                if started is not None:
                    # A stream stopped before its task first ran re-raises that task's cancellation: not ours.
                    with contextlib.suppress(asyncio.CancelledError):
                        await started.stop()
            self._finish(conversation, prompt, reply, failed)

    def _finish(self, conversation: Conversation, prompt: ChatMessage, reply: Reply,
                failed: BaseException | None) -> None:
        self.generating = False
        message = reply.message
        if failed is not None:
            self.tui.report(failed)
        if message.content or message.thinking or message.stats is not None:
            if failed is not None:
                message.stopped = True
            conversation.messages.append(message)
            reply.finish()
            self._save()
            return
        # Nothing came back: take the prompt out again and give it back to the input, to send once fixed.
        if conversation.messages and conversation.messages[-1] is prompt:
            conversation.messages.pop()
        for widget in self.query(UserMessage):
            if widget.message is prompt:
                widget.remove()
        reply.remove()
        if conversation is self.conversation:
            prompt_input = self.query_one(PromptInput)
            if not prompt_input.text:
                prompt_input.text = prompt.content

    def _cancel_reply(self) -> None:
        for worker in self.workers:
            if worker.group == "reply" and worker.is_running:
                worker.cancel()

    def action_stop(self) -> None:
        self._cancel_reply()

    # -- copying --------------------------------------------------------------------------------

    def _reply(self) -> Reply | None:
        focused = self.focused
        if isinstance(focused, Reply):
            return focused
        replies = self.query(Reply)
        return replies.last() if replies else None

    def action_copy_reply(self) -> None:
        reply = self._reply()
        if reply is None:
            self.notify("No reply to copy yet", severity="warning")
        else:
            reply.action_copy_reply()

    def action_copy_code(self) -> None:
        reply = self._reply()
        if reply is None:
            self.notify("No reply to copy from yet", severity="warning")
        else:
            reply.action_copy_code()

    # -- dialogs --------------------------------------------------------------------------------

    def action_new(self) -> None:
        self.new_conversation()

    def action_conversations(self) -> None:
        def chosen(conversation_id: str | None) -> None:
            if conversation_id == "":
                self.new_conversation()
            elif conversation_id:
                self.resume(conversation_id)

        self.app.push_screen(ConversationsScreen(current=self.conversation.id), chosen)

    @work(exclusive=True, group="models", exit_on_error=False)
    async def action_choose_model(self) -> None:
        models = await self.api.models(with_details=False)
        options = [(m.name, f"{m.name}  [dim]{m.parameter_size} {m.quantization}[/dim]") for m in models]
        chosen = await self.app.push_screen_wait(ChooseScreen("Model for this conversation", options,
                                                              current=self._current_model_name(models)))
        if chosen:
            self.conversation.model = chosen
            self.tui.model = chosen
            self._show_info()
            if self.conversation.messages:
                self._save()

    def _current_model_name(self, models: list[InstalledModel]) -> str | None:
        model = self.conversation.model
        names = [m.name for m in models]
        for candidate in (model, f"{model}:latest"):
            if candidate in names:
                return candidate
        return None

    def action_settings(self) -> None:
        def saved(result: tuple[str, dict[str, Any]] | None) -> None:
            if result is None:
                return
            self.conversation.system, self.conversation.options = result
            self._show_info()
            if self.conversation.messages:
                self._save()
            self.notify("Applies from the next message")

        self.app.push_screen(SettingsScreen(self.conversation.system, self.conversation.options), saved)
