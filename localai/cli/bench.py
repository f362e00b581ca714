"""``localai bench``: measured speed through the API (filled in below)."""
