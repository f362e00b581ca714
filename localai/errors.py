"""The one exception tree of localai.

Each error becomes user-facing exactly once, at its boundary: an HTTP status and the dialect's
error shape in the server, a one-line message and an exit code in the CLI.
"""

from __future__ import annotations


class LocalAIError(Exception):
    """Base of every error localai raises on purpose."""

    status_code: int = 500
    error_type: str = "server_error"
    code: str | None = None
    exit_code: int = 1  # the CLI's exit status for this error
    retry_after: int | None = None  # seconds, sent as Retry-After when set

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(LocalAIError):
    """A request is malformed or names a bad value; ``param`` names the field."""

    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """The prompt (plus the requested output) does not fit the model's context."""

    code = "context_length_exceeded"


class RequestTooLarge(InvalidRequest):
    """A request body, or what it becomes for the worker, is over the size limit."""

    status_code = 413
    code = "request_too_large"


class ClientDisconnected(LocalAIError):
    """The client went away before its (non-streamed) answer was ready; the work was stopped."""

    status_code = 499
    error_type = "cancelled"
    code = "client_disconnected"


class NotFound(LocalAIError):
    """A named thing (a stored response, ...) does not exist."""

    status_code = 404
    error_type = "not_found_error"


class ModelNotFound(NotFound):
    """The named model is not installed."""

    code = "model_not_found"


class Forbidden(LocalAIError):
    """The caller's API key may not do this (another key's data, or the machine owner's operations)."""

    status_code = 403
    error_type = "permission_error"


class ServerBusy(LocalAIError):
    """The request queue is full; retry later."""

    status_code = 503
    error_type = "server_busy"
    code = "server_busy"
    retry_after = 1


class WorkerCrashed(LocalAIError):
    """The worker process serving a model died while handling the request."""

    status_code = 500
    error_type = "server_error"
    code = "worker_crashed"


class WorkerLoadFailed(LocalAIError):
    """A worker could not load its model."""

    status_code = 500
    error_type = "server_error"
    code = "model_load_failed"


class ModelfileError(LocalAIError):
    """A Modelfile could not be parsed; the message names the line."""

    status_code = 400
    error_type = "invalid_request_error"
    code = "invalid_modelfile"


class StorageFull(LocalAIError):
    """The disk holding localai's home is full (a database or file write failed for room): nothing was stored."""

    status_code = 507
    code = "insufficient_storage"


def storage_full(exc: BaseException, what: str) -> StorageFull | None:
    """``exc`` as StorageFull when it is a full disk (ENOSPC, a disk quota, SQLite's "database or disk is full"),
    naming ``what`` could not be written; None for any other error."""
    import errno
    import sqlite3

    full = (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or (
        isinstance(exc, sqlite3.OperationalError) and "full" in str(exc))
    if not full:
        return None
    return StorageFull(f"{what} could not be written: the disk is full ({exc}); free some space (`localai cache "
                       "prune`, `localai rm` a model you no longer use) and retry")


class DaemonUnavailable(LocalAIError):
    """The CLI could not reach or start the daemon."""

    status_code = 503
    error_type = "server_error"


class EngineUnavailable(LocalAIError):
    """The model's engine cannot run on this machine (an MLX model off Apple Silicon)."""

    status_code = 400
    error_type = "invalid_request_error"
    code = "engine_unavailable"


class PullFailed(LocalAIError):
    """A download from Hugging Face failed: the hub is unreachable or answered with an error."""

    status_code = 502
    error_type = "server_error"
    code = "pull_failed"


class GatedModel(PullFailed):
    """The repository needs a Hugging Face token that has accepted its terms."""

    status_code = 403
    error_type = "permission_error"
    code = "gated_model"


class DownloadCorrupt(PullFailed):
    """Downloaded bytes do not match the size or sha256 the hub advertises; they were discarded."""

    code = "download_corrupt"


class NotEnoughDiskSpace(PullFailed):
    """A pull would not fit on the disk (keeping ``LOCALAI_MIN_FREE_SPACE`` free); nothing was downloaded."""

    status_code = 507
    error_type = "insufficient_storage"
    code = "not_enough_disk_space"


class PullCancelled(PullFailed):
    """The client went away mid-pull; the partial download is kept and the next pull resumes it."""

    status_code = 499
    error_type = "cancelled"
    code = "pull_cancelled"


class HubUnreachable(PullFailed):
    """Hugging Face could not be reached (offline mode or no network) and the model is not in the cache."""

    status_code = 503
    code = "hub_unreachable"


class UpstreamUnavailable(LocalAIError):
    """No replica of a remote model could take the request (each one's failure is in the message)."""

    status_code = 503
    error_type = "server_error"
    code = "upstream_unavailable"
    retry_after = 2


class UpstreamTimeout(UpstreamUnavailable):
    """Every replica tried timed out before it answered."""

    status_code = 504
    code = "upstream_timeout"


class UpstreamFailed(LocalAIError):
    """A remote model's replica failed after it had started answering, or answered with an error of its own
    (a refused API key included): the message names the replica and what it said."""

    status_code = 502
    error_type = "server_error"
    code = "upstream_error"


class AgentError(LocalAIError):
    """``localai launch`` could not prepare, install or start a coding agent."""


class AgentNotInstalled(AgentError):
    """The agent's program is not installed; the message gives the command that installs it."""

    exit_code = 127  # what a shell answers for a command it cannot find
