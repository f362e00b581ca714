"""The TUI's screens, one module each, and the modal dialogs they share."""
