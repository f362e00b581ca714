"""Every on-disk location localai uses. Each is a function that reads ``LOCALAI_HOME`` at call time."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import platformdirs


def home() -> Path:
    """The root of localai's state: ``$LOCALAI_HOME`` or the platform's user data directory."""
    configured = os.environ.get("LOCALAI_HOME")
    if configured:
        return Path(configured).expanduser()
    return Path(platformdirs.user_data_dir("localai", appauthor=False))


def socket_path() -> Path:
    """The daemon's Unix socket (mode 0600): the CLI and TUI talk to the daemon through it."""
    return home() / "localai.sock"


def database_path() -> Path:
    """The SQLite registry of models (and, later, cache and responses metadata)."""
    return home() / "localai.db"


def cache_dir() -> Path:
    """Where persisted prompt-cache entries live."""
    return home() / "cache"


def rpc_cache_dir() -> Path:
    """Where ``localai rpc-server --cache`` keeps the tensors other machines sent it (llama.cpp's ``rpc-server -c``):
    a restarted client's next load sends each tensor's hash instead of its bytes."""
    return home() / "rpc-cache"


def logs_dir() -> Path:
    """Daemon and worker logs."""
    return home() / "logs"


def server_log_path() -> Path:
    """The log of a daemon started in the background by the CLI."""
    return logs_dir() / "server.log"


LOG_MAX_BYTES = 10 << 20  # a log over this is rotated (name.1 .. name.3) before it is opened for appending
LOG_BACKUPS = 3


def rotate_log(path: Path, max_bytes: int = LOG_MAX_BYTES, backups: int = LOG_BACKUPS) -> None:
    """Shift ``path`` to ``path.1`` (and older ones along, dropping the oldest) when it is over ``max_bytes``.
    Called before a log is opened for appending, so a log written by child processes stays bounded."""
    try:
        if path.stat().st_size <= max_bytes:
            return
    except FileNotFoundError:
        return
    for index in range(backups - 1, 0, -1):
        older = path.with_name(f"{path.name}.{index}")
        if older.exists():
            older.replace(path.with_name(f"{path.name}.{index + 1}"))
    path.replace(path.with_name(f"{path.name}.1"))


def pid_path() -> Path:
    """The running daemon's pid, written at start and removed at clean exit."""
    return home() / "localai.pid"


def process_alive(pid: int) -> bool:
    """Whether the process of a pid file or lock is still running: it exists (perhaps another user's) and, on Linux,
    is not a zombie (exited, its parent has not reaped it yet: gone for everyone reading its files)."""
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if sys.platform.startswith("linux"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                return stat.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
        except OSError:
            return False
    return True


def address_path() -> Path:
    """The running daemon's TCP base URL, written at start, so agents reach it even on a non-default port."""
    return home() / "localai.addr"


def agents_dir() -> Path:
    """Where ``localai launch --yes`` installs agents (npm prefix and Python venvs): ``$LOCALAI_AGENTS_DIR``
    or ``<home>/agents``. Agents found here are preferred to those on ``PATH``."""
    configured = os.environ.get("LOCALAI_AGENTS_DIR")
    if configured:
        return Path(configured).expanduser()
    return home() / "agents"


def launch_dir(agent: str) -> Path:
    """Files ``localai launch`` owns for one agent: generated configs, backups of edited user files."""
    return home() / "launch" / agent


def user_modelfiles_dir() -> Path:
    """User Modelfiles, watched by the daemon: ``NAME.Modelfile`` or ``NAME/TAG.Modelfile``."""
    return home() / "modelfiles"


def hf_hub_cache() -> Path:
    """Hugging Face's hub cache, where pulled weights live (shared with every huggingface_hub user).

    Read at call time from the variables huggingface_hub itself honours: ``HF_HUB_CACHE``, then
    ``HF_HOME``/hub, then ``XDG_CACHE_HOME``/huggingface/hub.
    """
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        configured = os.environ.get(variable)
        if configured:
            return Path(os.path.expandvars(configured)).expanduser()
    hf_home = os.environ.get("HF_HOME")
    if hf_home:
        return Path(os.path.expandvars(hf_home)).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def shipped_dir(name: str) -> Path:
    """A folder of data that ships with localai: ``modelfiles`` or ``packaging``. In a checkout it is the
    top-level folder; an installed wheel holds it inside the package (``localai/modelfiles``, see setup.py)."""
    package = Path(__file__).resolve().parent
    source_tree = package.parent / name
    if (package.parent / "pyproject.toml").is_file() and source_tree.is_dir():
        return source_tree
    return package / name


def library_modelfiles_dir() -> Path:
    """The library of Modelfiles that ship with localai (``NAME/TAG.Modelfile``)."""
    return shipped_dir("modelfiles")


def ensure_home() -> Path:
    """Create the home directory (private to the user) and return it."""
    root = home()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    if root.stat().st_uid == os.getuid() and root.stat().st_mode & 0o077:
        root.chmod(0o700)  # an existing home made with the default umask: close it to other users
    return root
