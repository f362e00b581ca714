"""The persisted prompt (KV) cache: chained token blocks on disk and in RAM, shared by every session."""
