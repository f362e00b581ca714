"""localai: a local-first desktop agent runtime with an Ollama-style UX."""

__version__ = "0.1.0"
