"""Inference engines. Each runs inside a worker process, never in the daemon."""
