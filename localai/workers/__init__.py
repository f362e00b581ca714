"""Local worker processes: the scheduler (which models are loaded, for how long, who waits), the daemon's handle
on a worker (``handle.py``) and the worker process itself (``worker.py``, which loads only engines, the prompt
cache and foundations)."""
