"""Claude Code: Anthropic Messages, configured through its environment only (no files).

Claude Code checks every request against the window it is told before sending it (2.1.332, read from its
binary): it refuses one of ``window - min(reply limit, 20000) - 3000`` tokens or more itself ("Prompt is too
long", ``terminal_reason: blocking_limit``) unless ``CLAUDE_CODE_BLOCKING_LIMIT_OVERRIDE`` sets that limit, and it
auto-compacts at ``window - min(reply limit, 20000) - 13000`` (``CLAUDE_AUTOCOMPACT_PCT_OVERRIDE`` and
``CLAUDE_CODE_AUTO_COMPACT_WINDOW`` can only lower that). Its first request alone is ~14k tokens (system prompt
and tool schemas), so on a small window it would refuse before sending anything, and compact on every turn
(until its "Autocompact is thrashing" breaker ends the run). It is always told the real window (it sizes file
reads by it); where the window leaves too little room for its own compaction, the refusal is lifted and
auto-compaction is off, and the daemon fits each request to the window instead (``/compact`` still works).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from localai.agents.base import ANTHROPIC_MESSAGES, Integration, Launch, Package, Target

# Claude Code's own arithmetic (see above): the reply reserve it subtracts is capped at REPLY_CAP, and it
# compacts COMPACT_MARGIN tokens before the rest of the window is full.
REPLY_CAP = 20_000
COMPACT_MARGIN = 13_000
# Its compaction is worth keeping when the conversation gets this much room above its ~14k-token first
# request before compacting: 64k-token windows keep it (36k), 48k ones do not (24k: compaction every few turns).
OWN_COMPACTION_FROM = 32_768
NO_BLOCKING_LIMIT = 1_000_000_000  # "refuse only past this many tokens": never, the daemon fits the request


def compacts_on_its_own(context_length: int, max_output_tokens: int) -> bool:
    """Whether Claude Code's own window checks and auto-compaction work on this window."""
    return context_length - min(max_output_tokens, REPLY_CAP) - COMPACT_MARGIN >= OWN_COMPACTION_FROM


class ClaudeCode(Integration):
    name = "claude"
    title = "Claude Code"
    binary = "claude"
    protocol = ANTHROPIC_MESSAGES
    wiring = "environment: ANTHROPIC_BASE_URL, ANTHROPIC_AUTH_TOKEN, model tiers, context and output limits"
    package = Package("npm", "@anthropic-ai/claude-code@2.1.332")
    extra_locations: ClassVar[tuple[str, ...]] = (".local/bin/claude", ".claude/local/claude")

    def command(self, target: Target, program: str, extra: Sequence[str]) -> Launch:
        model = target.model
        env = {
            "ANTHROPIC_BASE_URL": target.base_url,  # the root: Claude Code appends /v1/messages
            "ANTHROPIC_AUTH_TOKEN": target.key,  # sent as a bearer token
            "ANTHROPIC_API_KEY": "",  # a set API key would make interactive Claude Code ask to approve it
            "ANTHROPIC_MODEL": model,
            # Every tier Claude Code picks from (main, fast, sub-agents) is the one local model.
            "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": model,
            "CLAUDE_CODE_SUBAGENT_MODEL": model,
            # The model's window (honoured for models not named claude-*), and its reply size.
            "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(target.context_length),
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(target.max_output_tokens),
            # No telemetry, error reports, update checks or surveys; and no per-request attribution text in the
            # system prompt, which would change every request's prefix and defeat the prompt cache.
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_FEEDBACK_COMMAND": "1",
            "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        }
        if not compacts_on_its_own(target.context_length, target.max_output_tokens):
            env["CLAUDE_CODE_BLOCKING_LIMIT_OVERRIDE"] = str(NO_BLOCKING_LIMIT)
            env["DISABLE_AUTO_COMPACT"] = "1"
        # Claude Code sends its own session id (X-Claude-Code-Session-Id), which the daemon keys its cache on.
        return Launch([program, "--model", model, *extra], env)
