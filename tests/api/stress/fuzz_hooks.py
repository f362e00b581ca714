"""Schemathesis hooks for `make stress`: two generated bodies in three name the real model, so fuzzed requests
reach the worker and the engine instead of stopping at "model not found"."""

from __future__ import annotations

import zlib
from typing import Any

import schemathesis

MODEL_FIELDS = ("model", "name", "source")


@schemathesis.hook
def map_body(ctx: Any, body: Any) -> Any:
    operation = getattr(ctx, "operation", None)
    if getattr(operation, "path", "") in ("/api/delete", "/api/copy", "/api/create"):
        return body  # renaming or removing the model under test would leave the rest of the run at 404s
    if isinstance(body, dict) and zlib.crc32(repr(body).encode()) % 3:
        for key in MODEL_FIELDS:
            if key in body:
                body[key] = "smollm2"
    return body


@schemathesis.hook
def map_path_parameters(ctx: Any, path_parameters: Any) -> Any:
    if isinstance(path_parameters, dict) and "model_id" in path_parameters and zlib.crc32(
            repr(path_parameters).encode()) % 2:
        path_parameters["model_id"] = "smollm2"
    return path_parameters
