"""The HTTP API: one module per dialect, all over the same Runtime."""
