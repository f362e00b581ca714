"""Where a request is served: local workers (``localai.runner``, ``localai.scheduler``) or a remote engine."""
