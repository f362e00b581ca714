"""A PDF's text, read with pypdf in a child process of its own: ``python -m localai.runtime.pdf_text``.

The PDF's bytes come on stdin; one JSON object goes to stdout: ``{"pages": N, "text": "..."}`` or
``{"error": "encrypted" | "malformed", "message": "..."}``. A PDF is whatever a client sent, so it is read where a
parser bug, a decompression bomb or a page tree that never ends costs this process, not the daemon: its address
space and CPU time are capped here (``MEMORY_BYTES``, ``--cpu``), it runs at a lower priority than the engines
(``--nice``), and the daemon kills it after a wall-clock bound (``runtime/media.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from typing import Any

MEMORY_BYTES = 1 << 30  # the child's address space: pypdf's own decompression limits stay well under it
MAX_CHARS = 4_000_000  # more text than any model's context holds; the rest is cut (and said so)


def limit_memory(limit: int = MEMORY_BYTES) -> None:
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):  # not on every platform (macOS ignores RLIMIT_AS): the timeout holds
        pass


def extract(data: bytes) -> dict[str, Any]:
    """Each page's text, pages separated by a blank line; the error kind when the PDF cannot be read."""
    import logging

    from pypdf import PdfReader
    from pypdf.errors import FileNotDecryptedError, LimitReachedError, PyPdfError

    logging.getLogger("pypdf").setLevel(logging.ERROR)  # its warnings about sloppy files would go to stderr
    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        if reader.is_encrypted:
            try:  # an "encrypted" PDF with an empty user password opens for anyone (many are made this way)
                opened = bool(reader.decrypt(""))
            except Exception:  # the cipher needs the `cryptography` package, or the file is broken
                opened = False
            if not opened:
                return {"error": "encrypted", "message": "the PDF is encrypted with a password"}
        texts: list[str] = []
        size = 0
        pages = len(reader.pages)
        for page in reader.pages:
            text = page.extract_text() or ""
            texts.append(text.strip())
            size += len(text)
            if size > MAX_CHARS:
                break
    except FileNotDecryptedError:
        return {"error": "encrypted", "message": "the PDF is encrypted with a password"}
    except (MemoryError, LimitReachedError):  # pypdf's own caps on what one stream may inflate to
        return {"error": "too_large", "message": "the PDF inflates to more than its reader allows (a compressed "
                "stream over 75 MB, or over 1 GiB in all)"}
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError,
            AssertionError, OSError) as exc:  # pypdf's failures on broken files are not all PdfReadError
        return {"error": "malformed", "message": f"{type(exc).__name__}: {str(exc)[:300]}"}
    joined = "\n\n".join(text for text in texts if text)
    return {"pages": pages, "text": joined[:MAX_CHARS], "cut": size > MAX_CHARS}


def limit_cpu(seconds: int, nice: int) -> None:
    """Stop at ``seconds`` of CPU time (SIGXCPU), counted only while the process runs: at a lower priority (``nice``)
    it waits for the CPU the engines leave, and its wall time says nothing about its cost."""
    if nice:
        with contextlib.suppress(OSError):
            os.nice(nice)
    if seconds:
        try:
            import resource
            resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 5))
        except (ImportError, ValueError, OSError):  # the parent's wall-clock bound still holds
            pass


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m localai.runtime.pdf_text")
    parser.add_argument("--cpu", type=int, default=0, help="CPU seconds before the reader is stopped")
    parser.add_argument("--nice", type=int, default=0)
    args = parser.parse_args()
    limit_memory()
    limit_cpu(args.cpu, args.nice)
    data = sys.stdin.buffer.read()
    try:
        result = extract(data)
    except MemoryError:
        result = {"error": "too_large", "message": "reading the PDF took more memory than allowed (1 GiB)"}
    sys.stdout.write(json.dumps(result, ensure_ascii=False))


if __name__ == "__main__":
    main()
