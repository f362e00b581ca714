"""The suite runs on pytest-xdist's workers (``make test``: ``-n 2``): each worker's engines and daemons get their
share of the cores, not all of them. Two workers with two llama.cpp threads each on 2 cores spin-wait on each
other (a sample of daemon tests took 107 s where it took 70 s alone); one thread each, the same sample takes 51."""

from __future__ import annotations

import os


def threads() -> int:
    """CPU threads for one llama.cpp context in a test: 2 when the suite runs alone (as it always did), else the
    cores shared out among xdist's workers (at least 1)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if workers <= 1:
        return 2
    return max(1, (os.cpu_count() or 1) // workers)
