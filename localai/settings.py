"""One typed settings object, built once from ``LOCALAI_*`` environment variables and passed down."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_PORT = 11435
_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ms|s|m|h|d)?")
_UNITS = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
MAX_DURATION = 10 * 365 * 24 * 3600.0  # ten years: longer is "forever" (-1), and past it datetimes overflow


def default_cache_ram_bytes() -> int:
    """1/16 of physical memory, between 256 MiB and 4 GiB: recent blocks served without a disk read."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return max(256 << 20, min(4 << 30, total // 16))


RPC_PORT = 50052  # llama.cpp's rpc-server's default port


def rpc_endpoint(text: str) -> str:
    """A llama.cpp RPC server's address as ``host:port`` (llama.cpp's form; an IPv6 host in brackets), checked:
    llama.cpp aborts the whole process on an endpoint it cannot parse."""
    value = text.strip()
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rpc server {text!r}: expected host:port (e.g. 192.168.1.20:{RPC_PORT})")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not bare or any(c.isspace() or c in ",/@" for c in bare) or (":" in bare and bare == host):
        raise ValueError(f"rpc server {text!r}: expected host:port (an IPv6 address in brackets: [::1]:{RPC_PORT})")
    return f"{host}:{int(port)}"


def rpc_endpoint_of(host: str, port: int) -> str:
    """``host:port`` as llama.cpp writes an RPC endpoint (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_duration(value: str | int | float) -> float:
    """Seconds from ``"5m"``, ``"1h30m"``, ``"7d"``, ``"300"``, ``300`` or ``"-1"`` (negative means forever)."""
    if isinstance(value, (int, float)):
        try:
            return _bounded(float(value), value)
        except OverflowError:
            return _bounded(math.inf, value)
    text = value.strip().lower()
    if not text:
        raise ValueError("empty duration")
    sign = -1.0 if text.startswith("-") else 1.0
    text = text.lstrip("-+")
    total, pos = 0.0, 0
    for match in _DURATION.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if pos != len(text):
        raise ValueError(f"invalid duration {str(value)[:40]!r}: use seconds or a number with ms, s, m, h or d")
    return _bounded(sign * total, value)


def _bounded(seconds: float, value: object) -> float:
    if not math.isfinite(seconds) or abs(seconds) > MAX_DURATION:
        raise ValueError(f"duration {str(value)[:40]!r} is out of range: at most ten years (use -1 for forever)")
    return seconds


class Settings(BaseSettings):
    """Daemon and client configuration. Every field reads ``LOCALAI_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="LOCALAI_", extra="ignore")

    host: str = Field(
        default=f"127.0.0.1:{DEFAULT_PORT}",
        description="TCP address the daemon listens on, `host:port` or `http://host:port` (loopback by default).",
    )
    keep_alive: float = Field(
        default=300.0,
        description="How long an idle model stays loaded: seconds or `5m`/`1h`; 0 unloads at once, negative never.",
    )
    stream_keepalive: float = Field(
        default=10.0, ge=0,
        description="Seconds a stream may go without output (a long prompt being evaluated) before it sends a "
                    "keep-alive: an SSE comment, Anthropic's ping, an empty Ollama chunk; 0 sends none.",
    )
    max_loaded_models: int = Field(default=3, ge=1, description="Most models loaded at once; the idlest goes first.")
    max_queue: int = Field(
        default=512, ge=1, description="Most requests waiting for a model; beyond it requests get 503 + Retry-After."
    )
    num_parallel: int = Field(
        default=4, ge=1, le=64, description="Sequences (concurrent requests or live sessions) per loaded model."
    )
    context_length: int = Field(
        default=32768,
        ge=256,
        description="When set, the default `num_ctx`: a model gets min(its trained context, this) unless its Modelfile "
        "says; unset, the largest window that fits the free memory (models/loading.py fit_window).",
    )
    num_thread: int | None = Field(default=None, ge=1, description="CPU threads per worker (default: all cores).")
    flash_attention: bool = Field(default=False, description="Run llama.cpp with flash attention.")
    cpu_repack: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Let llama.cpp repack weights into its CPU-optimized layouts (AMX, AVX2/AVX-512, ARM): `auto` "
        "does unless llama.cpp was built with AMX kernels, which crash on some Sapphire Rapids machines "
        "(llama.cpp #20824); `on` always, `off` never (llama.cpp's --no-repack).",
    )
    gpu_overhead: int = Field(
        default=0, ge=0,
        description="Bytes to leave free on each GPU when placing a model's layers by free memory (for other "
        "programs, or a display), on top of the 512 MiB kept for llama.cpp's compute buffers.",
    )
    engine: Literal["llama.cpp", "mlx", "scripted"] | None = Field(
        default=None,
        description="The preferred engine: models whose weights it can load run on it, and a library pull with "
        "both sources takes its format (default: MLX on Apple Silicon when mlx is installed, else llama.cpp). "
        "`scripted` answers from a script without loading a model (for tests).",
    )
    rpc_servers: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated llama.cpp RPC servers (`host:port`, `localai rpc-server` on each machine) that "
        "every GGUF model spreads its layers over, beside the local devices; a Modelfile's `PARAMETER rpc` lines "
        "replace the list for that model.",
    )
    origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Comma-separated browser origins allowed by CORS (none by default)."
    )
    discover: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["ollama", "lmstudio", "hf"],
        description="Where to find models already on this disk, used in place: `ollama` (OLLAMA_MODELS or "
        "~/.ollama/models), `lmstudio` (~/.lmstudio/models), `hf` (GGUFs in the Hugging Face cache); comma-separated, "
        "empty for none.",
    )
    api_key: str | None = Field(default=None, description="When set, TCP requests need it as a bearer token.")
    api_key_file: Path | None = Field(
        default=None,
        description="A file of API keys, one per line (`#` comments; llama-server's `--api-key-file`): TCP requests "
        "need one of them, or LOCALAI_API_KEY. With more than one key, each key's requests share prompt-cache prefixes "
        "and stored responses only among themselves.",
    )
    cache_max_bytes: int = Field(
        default=8 << 30, ge=0, description="Disk quota of the persisted prompt cache in bytes; 0 turns it off."
    )
    cache_ram_bytes: int | None = Field(
        default=None, ge=0,
        description="RAM tier of the prompt cache per loaded model, in bytes of blocks (default: 1/16 of the "
                    "machine's memory, between 256 MiB and 4 GiB).",
    )
    load_timeout: float = Field(default=120.0, gt=0, description="Seconds a worker may take to load a model.")
    min_free_space: int = Field(
        default=1 << 30,
        ge=0,
        description="Bytes a pull must leave free on the Hugging Face cache's disk; a pull that would not is "
        "refused before it downloads anything.",
    )
    responses_ttl: float = Field(
        default=30 * 24 * 3600.0,
        description="How long stored `/v1/responses` results are kept for `previous_response_id` after their last "
        "use (continuing a response uses its whole chain): seconds or `720h`.",
    )
    responses_max: int = Field(default=10_000, ge=1, description="Most stored `/v1/responses` results kept.")
    responses_max_bytes: int = Field(
        default=1 << 30, ge=1 << 16,
        description="Bytes the stored `/v1/responses` results may take (their JSON); beyond it the least recently "
        "used go, a chain's last turns before its first.",
    )
    ws_idle_timeout: float = Field(
        default=3600.0, gt=0,
        description="Seconds a `/v1/responses` WebSocket may stay without a message from its client (while no "
                    "response is being made) before localai closes it (code 1000). Generous: Codex keeps one socket "
                    "for a whole session, idle while its user reads and types; a client gone without closing is "
                    "found sooner by the WebSocket pings (every 20 s). The request-body deadline "
                    "(LOCALAI_BODY_TIMEOUT) ends at the upgrade.",
    )
    body_timeout: float = Field(
        default=60.0, gt=0, le=3600,
        description="Seconds a request's body may take to arrive once its headers are in; a connection still "
                    "sending it then is closed (a client sending a byte every few seconds held it for as long as it "
                    "liked).",
    )
    max_request_bytes: int = Field(
        default=32 << 20, ge=1 << 16,
        description="Largest request body the API accepts, in bytes; larger ones get 413 before any work is done.",
    )
    remote_health_interval: float = Field(
        default=10.0, gt=0, le=3600,
        description="Seconds between health checks (`GET /models`) of a remote model's replicas once it is used; a "
        "replica taken out is checked sooner (0.5 s, doubling up to this).",
    )
    debug: bool = Field(default=False, description="Verbose logging in the daemon and workers.")

    @field_validator("keep_alive", "responses_ttl", mode="before")
    @classmethod
    def _duration(cls, value: object) -> float:
        if isinstance(value, (str, int, float)):
            return parse_duration(value)
        raise ValueError("keep_alive must be a duration")

    @field_validator("origins", mode="before")
    @classmethod
    def _split_origins(cls, value: object) -> object:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("rpc_servers", mode="before")
    @classmethod
    def _split_rpc(cls, value: object) -> object:
        if isinstance(value, str):
            value = [item for item in value.split(",") if item.strip()]
        if not isinstance(value, list):
            raise ValueError("a comma-separated list of host:port")
        return [rpc_endpoint(str(item)) for item in value]

    @field_validator("discover", mode="before")
    @classmethod
    def _split_sources(cls, value: object) -> object:
        if isinstance(value, str):
            value = [item.strip().lower() for item in value.split(",") if item.strip()]
        if not isinstance(value, list):
            raise ValueError("a comma-separated list of ollama, lmstudio, hf")
        unknown = [str(item) for item in value if item not in ("ollama", "lmstudio", "hf")]
        if unknown:
            raise ValueError(f"unknown model source(s) {', '.join(unknown)}: use ollama, lmstudio, hf")
        return value

    @property
    def bind(self) -> tuple[str, int]:
        """The TCP host and port parsed from ``host``."""
        return parse_host(self.host)

    @property
    def base_url(self) -> str:
        """The daemon's HTTP base URL on TCP, as clients should use it."""
        host, port = self.bind
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port}"

    def threads(self) -> int:
        """Worker threads: ``num_thread`` or the machine's cores."""
        return self.num_thread or max(1, os.cpu_count() or 1)


def parse_host(value: str) -> tuple[str, int]:
    """``127.0.0.1:11435``, ``http://localhost:8080``, ``[::1]:9``, ``0.0.0.0`` → (host, port)."""
    text = value.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    host = parts.hostname or "127.0.0.1"
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError as exc:
        raise ValueError(f"invalid LOCALAI_HOST {value!r}: {exc}") from exc
    return host, port
