"""Remote engines: models served by another OpenAI-compatible server (the pool of replicas, session routing,
failover and health). A remote model's spec is a model's definition, so it lives in ``models/remote_spec.py``."""
