"""Every integration's generated environment, arguments and files, and ``--restore`` of edited user files."""

from __future__ import annotations

import itertools
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from localai import paths
from localai.agents import INTEGRATIONS, Integration, Target, get
from localai.agents.files import AgentFiles
from localai.errors import AgentError

TARGET = Target(base_url="http://127.0.0.1:5555", model="smollm2", context_length=8192, max_output_tokens=256,
                session_id="launch-1")
KEYED = Target(base_url="http://127.0.0.1:5555", model="smollm2", context_length=8192, max_output_tokens=256,
               api_key="s3cret", session_id="launch-1")


@pytest.fixture(autouse=True)
def user_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The agents' idea of the user's home: a fresh directory, with no relocation variables set."""
    home = tmp_path / "user"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for key in ("PI_CODING_AGENT_DIR", "HERMES_HOME", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(key, raising=False)
    return home


def run(integration: Integration, target: Target = TARGET,
        extra: tuple[str, ...] = ()) -> tuple[list[str], dict[str, str]]:
    integration.configure(target)
    launch = integration.command(target, integration.binary, list(extra))
    return launch.argv, launch.env


def overrides(argv: list[str]) -> dict[str, Any]:
    """Codex's ``-c key=value`` flags, values parsed (they are TOML literals written as JSON)."""
    return {pair.split("=", 1)[0]: json.loads(pair.split("=", 1)[1])
            for flag, pair in itertools.pairwise(argv) if flag == "-c"}


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()} if root.exists() else set()


def test_claude_is_configured_by_environment_only(user_home: Path) -> None:
    argv, env = run(get("claude"), extra=("-p", "hi"))
    assert argv == ["claude", "--model", "smollm2", "-p", "hi"]
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:5555"  # the root: Claude Code appends /v1/messages
    assert env["ANTHROPIC_AUTH_TOKEN"] == "localai" and env["ANTHROPIC_API_KEY"] == ""
    for tier in ("MODEL", "DEFAULT_OPUS_MODEL", "DEFAULT_SONNET_MODEL", "DEFAULT_HAIKU_MODEL"):
        assert env[f"ANTHROPIC_{tier}"] == "smollm2"
    assert env["CLAUDE_CODE_SUBAGENT_MODEL"] == "smollm2"
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "8192" and env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "256"
    assert env["DISABLE_TELEMETRY"] == env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert run(get("claude"), KEYED)[1]["ANTHROPIC_AUTH_TOKEN"] == "s3cret"
    assert files_under(user_home) == set()


@pytest.mark.parametrize(("context", "output", "its_own"), [
    (8192, 2048, False),  # smollm2: Claude Code's first request alone is over its own limit of 3,144 tokens
    (49152, 12288, False),  # 24k of room before it compacts: it would compact every few turns
    (65536, 16384, True),
    (131072, 32768, True),
])
def test_claude_is_told_the_real_window_and_sends_on_any(context: int, output: int, its_own: bool) -> None:
    """Claude Code refuses a request of window - min(reply, 20000) - 3000 tokens itself and compacts 10,000
    earlier; where that leaves too little room, its limit is lifted and its auto-compaction is off (the daemon
    fits each request), elsewhere its own checks stay."""
    target = Target(base_url="http://127.0.0.1:5555", model="m", context_length=context, max_output_tokens=output)
    env = run(get("claude"), target)[1]
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == str(context)
    assert ("CLAUDE_CODE_BLOCKING_LIMIT_OVERRIDE" not in env) is its_own
    assert ("DISABLE_AUTO_COMPACT" not in env) is its_own
    if not its_own:
        assert int(env["CLAUDE_CODE_BLOCKING_LIMIT_OVERRIDE"]) > 10**8 and env["DISABLE_AUTO_COMPACT"] == "1"


def test_codex_uses_overrides_and_a_generated_catalog(user_home: Path) -> None:
    argv, env = run(get("codex"), extra=("exec", "hi"))
    assert argv[0] == "codex" and argv[-2:] == ["exec", "hi"]
    settings = overrides(argv)
    assert settings["model"] == "smollm2" and settings["model_provider"] == "localai"
    assert settings["model_providers.localai.base_url"] == "http://127.0.0.1:5555/v1"
    assert settings["model_providers.localai.wire_api"] == "responses"
    assert settings["model_context_window"] == 8192
    assert settings["check_for_update_on_startup"] is False and settings["analytics.enabled"] is False
    assert "model_providers.localai.env_key" not in settings and "LOCALAI_API_KEY" not in env
    catalog = json.loads(Path(settings["model_catalog_json"]).read_text())
    (model,) = catalog["models"]
    assert model["slug"] == "smollm2" and model["context_window"] == 8192
    assert Path(settings["model_catalog_json"]).is_relative_to(paths.launch_dir("codex"))
    assert not (user_home / ".codex").exists()

    keyed_argv, keyed_env = run(get("codex"), KEYED)
    assert overrides(keyed_argv)["model_providers.localai.env_key"] == "LOCALAI_API_KEY"
    assert keyed_env["LOCALAI_API_KEY"] == "s3cret"


def test_opencode_gets_its_config_inline(user_home: Path) -> None:
    argv, env = run(get("opencode"), extra=("run", "hi"))
    assert argv == ["opencode", "run", "hi"]
    config = json.loads(env["OPENCODE_CONFIG_CONTENT"])
    provider = config["provider"]["localai"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"] == {"baseURL": "http://127.0.0.1:5555/v1", "apiKey": "localai"}
    assert provider["models"]["smollm2"]["limit"] == {"context": 8192, "output": 256}
    assert config["model"] == config["small_model"] == "localai/smollm2"
    assert config["autoupdate"] is False and config["share"] == "disabled"
    assert env["OPENCODE_DISABLE_AUTOUPDATE"] == env["OPENCODE_DISABLE_MODELS_FETCH"] == "1"
    assert files_under(user_home) == set()


def test_aider_gets_flags_and_generated_model_files(user_home: Path) -> None:
    argv, env = run(get("aider"), extra=("--message", "hi"))
    assert argv[:3] == ["aider", "--model", "openai/smollm2"] and argv[-2:] == ["--message", "hi"]
    assert {"--no-check-update", "--no-analytics"} <= set(argv)
    assert env["OPENAI_API_BASE"] == "http://127.0.0.1:5555/v1" and env["OPENAI_API_KEY"] == "localai"
    metadata = json.loads(Path(argv[argv.index("--model-metadata-file") + 1]).read_text())
    assert metadata["openai/smollm2"]["max_input_tokens"] == 8192
    assert metadata["openai/smollm2"]["max_output_tokens"] == 256
    settings = yaml.safe_load(Path(argv[argv.index("--model-settings-file") + 1]).read_text())
    assert settings == [{"name": "openai/smollm2", "extra_params": {
        "max_tokens": 256, "extra_headers": {"X-Session-Id": "launch-1"}}}]
    assert files_under(user_home) == set()


def test_qwen_reads_a_defaults_file_localai_owns(user_home: Path) -> None:
    argv, env = run(get("qwen"), extra=("-p", "hi"))
    assert argv == ["qwen", "--auth-type", "openai", "--model", "smollm2", "-p", "hi"]
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:5555/v1" and env["OPENAI_MODEL"] == "smollm2"
    assert env["QWEN_CODE_MAX_OUTPUT_TOKENS"] == "256"
    defaults = json.loads(Path(env["QWEN_CODE_SYSTEM_DEFAULTS_PATH"]).read_text())
    generation = defaults["model"]["generationConfig"]
    assert generation["contextWindowSize"] == 8192
    assert generation["customHeaders"] == {"X-Session-Id": "${session_id}"}
    assert defaults["outboundCorrelation"]["allowDynamicHeaderValues"] is True
    assert defaults["privacy"]["usageStatisticsEnabled"] is False
    assert not (user_home / ".qwen").exists()


def test_pi_adds_only_its_provider_to_the_users_models_file(user_home: Path) -> None:
    models = user_home / ".pi" / "agent" / "models.json"
    models.parent.mkdir(parents=True)
    models.write_text('{"providers": {"mine": {"baseUrl": "http://example.invalid/v1", "models": []}}}')
    argv, env = run(get("pi"), extra=("-p", "hi"))
    assert argv == ["pi", "--provider", "localai", "--model", "smollm2", "-p", "hi"]
    assert env["LOCALAI_SESSION_ID"] == "launch-1" and env["PI_OFFLINE"] == "1"
    data = json.loads(models.read_text())
    assert data["providers"]["mine"] == {"baseUrl": "http://example.invalid/v1", "models": []}
    provider = data["providers"]["localai"]
    assert provider["baseUrl"] == "http://127.0.0.1:5555/v1" and provider["api"] == "openai-completions"
    assert provider["models"][0]["contextWindow"] == 8192 and provider["models"][0]["maxTokens"] == 256
    assert "LOCALAI_SESSION_ID" in provider["headers"]["X-Session-Id"]


def test_pi_honours_its_agent_dir_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PI_CODING_AGENT_DIR", str(tmp_path / "pi-elsewhere"))
    run(get("pi"))
    assert "localai" in json.loads((tmp_path / "pi-elsewhere" / "models.json").read_text())["providers"]


def test_droid_gets_a_settings_file_per_process(user_home: Path) -> None:
    argv, env = run(get("droid"), extra=("exec", "hi"))
    assert argv[:2] == ["droid", "--settings"] and argv[-2:] == ["exec", "hi"]
    settings = json.loads(Path(argv[2]).read_text())
    (model,) = settings["customModels"]
    assert model["provider"] == "generic-chat-completion-api" and model["baseUrl"] == "http://127.0.0.1:5555/v1"
    assert model["maxOutputTokens"] == 256 and model["extraHeaders"] == {"X-Session-Id": "launch-1"}
    assert settings["sessionDefaultSettings"]["model"] == model["id"] == "custom:localai-smollm2"
    assert env["FACTORY_DROID_AUTO_UPDATE_ENABLED"] == "false"
    assert not (user_home / ".factory").exists()


def test_cline_runs_on_a_data_dir_localai_owns(user_home: Path) -> None:
    argv, _ = run(get("cline"), extra=("--json", "hi"))
    assert argv[:2] == ["cline", "--data-dir"] and argv[-2:] == ["--json", "hi"]
    providers = json.loads((Path(argv[2]) / "settings" / "providers.json").read_text())
    entry = providers["providers"]["openai-compatible"]
    assert entry["settings"] == {"provider": "openai-compatible", "apiKey": "localai", "model": "smollm2",
                                 "baseUrl": "http://127.0.0.1:5555/v1"}
    assert providers["lastUsedProvider"] == "openai-compatible" and "modes" in providers and entry["updatedAt"]
    assert not (user_home / ".cline").exists()


def test_continue_gets_a_config_file(user_home: Path) -> None:
    argv, env = run(get("cn"), extra=("-p", "hi"))
    assert argv[:2] == ["cn", "--config"] and argv[-2:] == ["-p", "hi"]
    (model,) = yaml.safe_load(Path(argv[2]).read_text())["models"]
    assert model["provider"] == "openai" and model["apiBase"] == "http://127.0.0.1:5555/v1"
    assert model["defaultCompletionOptions"] == {"contextLength": 8192, "maxTokens": 256}
    assert model["requestOptions"]["headers"] == {"X-Session-Id": "launch-1"}
    assert env["CONTINUE_CLI_ENABLE_TELEMETRY"] == "0"
    assert not (user_home / ".continue").exists()


def test_hermes_config_and_its_context_warning(user_home: Path) -> None:
    argv, _ = run(get("hermes"), extra=("chat", "-q", "hi"))
    assert argv == ["hermes", "chat", "-q", "hi"]
    config = yaml.safe_load((user_home / ".hermes" / "config.yaml").read_text())
    assert config["model"] == {"provider": "localai", "default": "smollm2", "base_url": "http://127.0.0.1:5555/v1",
                               "api_key": "localai", "context_length": 8192}
    assert config["providers"]["localai"]["models"] == ["smollm2"]
    (note,) = get("hermes").notes(TARGET)
    assert "64000" in note and "8192" in note


def test_goose_is_configured_by_environment_only(user_home: Path) -> None:
    argv, env = run(get("goose"), extra=("run", "-t", "hi"))
    assert argv == ["goose", "run", "-t", "hi"]
    assert env["GOOSE_PROVIDER"] == "openai" and env["OPENAI_HOST"] == "http://127.0.0.1:5555"
    assert env["OPENAI_BASE_PATH"] == "v1/chat/completions" and env["GOOSE_CONTEXT_LIMIT"] == "8192"
    assert env["GOOSE_TELEMETRY_ENABLED"] == "false"
    assert files_under(user_home) == set()


def test_crush_and_openclaw_configs(user_home: Path) -> None:
    run(get("crush"))
    crush = json.loads((user_home / ".config" / "crush" / "crush.json").read_text())
    assert crush["providers"]["localai"]["type"] == "openai-compat"
    assert crush["providers"]["localai"]["models"][0]["context_window"] == 8192
    assert crush["models"]["large"] == {"model": "smollm2", "provider": "localai"}
    run(get("openclaw"))
    claw = json.loads((user_home / ".openclaw" / "openclaw.json").read_text())
    assert claw["models"]["providers"]["localai"]["api"] == "openai-completions"
    assert claw["agents"]["defaults"]["model"]["primary"] == "localai/smollm2"


@pytest.mark.parametrize("name", list(INTEGRATIONS))
def test_every_integration_points_at_the_daemon_and_restore_removes_its_files(name: str, user_home: Path) -> None:
    integration = get(name)
    written = integration.configure(TARGET)
    launch = integration.command(TARGET, integration.binary, ["--extra"])
    assert launch.argv[-1] == "--extra", "the user's arguments come last"
    text = json.dumps(launch.env) + " ".join(launch.argv) + "".join(p.read_text() for p in written)
    assert "127.0.0.1:5555" in text
    assert integration.restore() is not None
    assert not paths.launch_dir(name).exists()
    assert files_under(user_home) == set(), "restore removes the user files localai created"


# -- restore of pre-existing user files ---------------------------------------------------------------

USER_FILES: dict[str, tuple[str, str]] = {
    "pi": (".pi/agent/models.json", '{\n    "providers": {"mine": {"baseUrl": "http://x.invalid/v1"}}  }\n\n'),
    "hermes": (".hermes/config.yaml", "# my hermes\nmodel:\n  default: big-model   # the good one\n"
                                      "providers:\n  other: {api: 'http://x.invalid'}\n"),
    "crush": (".config/crush/crush.json", '{"models": {"large": {"model": "m", "provider": "p"}},\t"options": {}}'),
    "openclaw": (".openclaw/openclaw.json", '{"agents": {"defaults": {"model": {"primary": "x/y"}}}, "a": [1,2]}'),
}


@pytest.mark.parametrize("name", list(USER_FILES))
def test_restore_puts_a_users_file_back_byte_for_byte(name: str, user_home: Path) -> None:
    relative, original = USER_FILES[name]
    path = user_home / relative
    path.parent.mkdir(parents=True)
    path.write_text(original)
    path.chmod(0o644)
    integration = get(name)
    integration.configure(TARGET)
    integration.configure(TARGET)  # launching twice keeps the first backup
    assert path.read_text() != original
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    lines = integration.restore()
    assert path.read_text() == original
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert any("restored" in line for line in lines)
    assert not paths.launch_dir(name).exists()


@pytest.mark.parametrize("name", list(USER_FILES))
def test_restore_keeps_changes_the_user_made_after_launch(name: str, user_home: Path) -> None:
    relative, original = USER_FILES[name]
    path = user_home / relative
    path.parent.mkdir(parents=True)
    path.write_text(original)
    integration = get(name)
    integration.configure(TARGET)
    fmt = "yaml" if path.suffix == ".yaml" else "json"
    edited = yaml.safe_load(path.read_text()) if fmt == "yaml" else json.loads(path.read_text())
    edited["added_by_user"] = True
    path.write_text(yaml.safe_dump(edited) if fmt == "yaml" else json.dumps(edited))
    lines = integration.restore()
    result = yaml.safe_load(path.read_text()) if fmt == "yaml" else json.loads(path.read_text())
    before = yaml.safe_load(original) if fmt == "yaml" else json.loads(original)
    assert result == {**before, "added_by_user": True}
    assert any("your other changes are kept" in line for line in lines)


def test_a_file_localai_cannot_parse_is_left_alone(user_home: Path) -> None:
    path = user_home / ".openclaw" / "openclaw.json"
    path.parent.mkdir(parents=True)
    path.write_text("{ // JSON5 with a comment\n}")
    with pytest.raises(AgentError, match="not valid JSON"):
        get("openclaw").configure(TARGET)
    assert path.read_text() == "{ // JSON5 with a comment\n}"


def test_owned_files_are_private(tmp_path: Path) -> None:
    written = AgentFiles("codex").write("models.json", "{}")
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    assert written.parent == paths.launch_dir("codex") and os.fspath(tmp_path) in os.fspath(written)
