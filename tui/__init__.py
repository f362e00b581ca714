"""localai's terminal UI, a Textual app shipped as ``localai.tui`` (source: the top-level ``tui/`` folder).

Nothing is imported here, so ``localai --help`` never loads Textual; ``localai.tui.app.make_tui`` builds the app.
"""
