"""Command palette providers (ctrl+p): chat with an installed model, resume a stored conversation."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from textual.command import DiscoveryHit, Hit, Hits, Provider

from localai.errors import LocalAIError

if TYPE_CHECKING:
    from .app import LocalAIApp


class ModelCommands(Provider):
    """``Chat with MODEL`` for every installed model."""

    async def startup(self) -> None:
        app = cast("LocalAIApp", self.app)
        try:
            self.names = [model.name for model in await app.api.models(with_details=False)]
        except LocalAIError:
            self.names = []  # no daemon: the palette still opens, without models

    def _commands(self) -> list[tuple[str, str]]:
        return [(f"Chat with {name}", name) for name in self.names]

    def _open(self, name: str) -> None:
        cast("LocalAIApp", self.app).open_chat(model=name)

    async def discover(self) -> Hits:
        for text, name in self._commands():
            yield DiscoveryHit(text, lambda name=name: self._open(name), help="a new conversation")

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for text, name in self._commands():
            score = matcher.match(text)
            if score > 0:
                yield Hit(score, matcher.highlight(text), lambda name=name: self._open(name),
                          help="a new conversation")


class ConversationCommands(Provider):
    """``Resume: TITLE`` for every stored conversation that can be read."""

    async def startup(self) -> None:
        app = cast("LocalAIApp", self.app)
        try:
            self.conversations = [(s.id, s.title, s.model) for s in app.store.summaries() if not s.error]
        except Exception:  # an unreadable database must not break the palette
            self.conversations = []

    def _open(self, conversation_id: str) -> None:
        cast("LocalAIApp", self.app).open_chat(conversation_id=conversation_id)

    async def discover(self) -> Hits:
        for conversation_id, title, model in self.conversations[:10]:
            yield DiscoveryHit(f"Resume: {title}", lambda cid=conversation_id: self._open(cid), help=model)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for conversation_id, title, model in self.conversations:
            text = f"Resume: {title}"
            score = matcher.match(text)
            if score > 0:
                yield Hit(score, matcher.highlight(text), lambda cid=conversation_id: self._open(cid), help=model)
