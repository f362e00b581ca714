"""``localai bench``: prefill and decode through the API, the agent trace, the remote hop, and the reference
servers they are measured against (llama-cpp-python's, mlx-lm's, a managed localai daemon)."""
