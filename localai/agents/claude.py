"""Claude Code: Anthropic Messages, configured through its environment only (no files)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from localai.agents.base import ANTHROPIC_MESSAGES, Integration, Launch, Package, Target


class ClaudeCode(Integration):
    name = "claude"
    title = "Claude Code"
    binary = "claude"
    protocol = ANTHROPIC_MESSAGES
    wiring = "environment: ANTHROPIC_BASE_URL, ANTHROPIC_AUTH_TOKEN, model tiers, context and output limits"
    package = Package("npm", "@anthropic-ai/claude-code@2.1.197")
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
            # The window it compacts against (honoured for models not named claude-*), and its reply size.
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
        # Claude Code sends its own session id (X-Claude-Code-Session-Id), which the daemon keys its cache on.
        return Launch([program, "--model", model, *extra], env)
