"""The Textual terminal UI (not built yet)."""
