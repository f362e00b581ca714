"""Images, audio and documents as each dialect sends them, read into ``MediaBlock``s.

Nothing is refused for being media: what the model cannot read becomes a stand-in later (``runtime/media.py``).
What is refused is what cannot be read at all (base64 that is not base64, a data URL without data), with a 400
naming the field. URLs and uploaded-file ids are kept as references and never fetched: the daemon makes no
requests of its own on a client's behalf.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from localai.errors import InvalidRequest
from localai.runtime.media import document_text
from localai.schema import MediaBlock, MediaKind, TextBlock, ToolResultBlock

OCTET_STREAM = "application/octet-stream"
# The first bytes of the formats clients send (Ollama's images carry no media type)
SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"), (b"BM", "image/bmp"), (b"%PDF-", "application/pdf"), (b"ID3", "audio/mpeg"),
    (b"fLaC", "audio/flac"), (b"OggS", "audio/ogg"),
)
AUDIO_FORMATS = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "ogg": "audio/ogg",
                 "opus": "audio/opus", "m4a": "audio/mp4", "webm": "audio/webm", "pcm16": "audio/pcm"}
_DATA_URL = re.compile(r"\Adata:([^;,]*)((?:;[^;,]*)*),(.*)\Z", re.S)
_TOKEN = re.compile(r"[^A-Za-z0-9!#$&^_.+\-/]")


def sniffed(data: bytes, fallback: str = OCTET_STREAM) -> str:
    """The media type the bytes' signature shows, else ``fallback``."""
    if data[:4] == b"RIFF" and data[8:12] in (b"WEBP", b"WAVE"):
        return "image/webp" if data[8:12] == b"WEBP" else "audio/wav"
    for signature, media_type in SIGNATURES:
        if data.startswith(signature):
            return media_type
    return fallback


def clean_type(value: object, fallback: str = OCTET_STREAM) -> str:
    """A media type as a client wrote it, reduced to the characters a media type has (it reaches headers)."""
    text = _TOKEN.sub("", str(value or "").strip().lower())[:100]
    return text or fallback


def decoded(data: object, param: str, what: str = "data") -> bytes:
    """Base64 (standard or URL-safe, padding optional, whitespace ignored) as bytes; a 400 naming ``param``."""
    if not isinstance(data, str):
        raise InvalidRequest(f"the {what} must be a base64 string", param=param)
    text = "".join(data.split())
    text += "=" * (-len(text) % 4)
    try:
        return base64.b64decode(text, altchars=b"-_" if ("-" in text or "_" in text) else None, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"the {what} is not valid base64 ({exc}); send the file's bytes base64-encoded",
                             param=param) from exc


def from_url(url: object, kind: MediaKind, param: str, *, name: str | None = None) -> MediaBlock:
    """A ``data:`` URL's bytes, or any other URL kept as a reference (not fetched)."""
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"the {kind} needs a URL (a data: URL with its base64 bytes, or an http(s) URL)",
                             param=param)
    match = _DATA_URL.match(url)
    if match is None:
        if url.startswith("data:"):
            raise InvalidRequest("a data: URL needs a comma before its data (data:image/png;base64,...)",
                                 param=param)
        return MediaBlock(kind, OCTET_STREAM, reference=url[:2000], name=name, where=param)
    media_type, options, payload = match.groups()
    if ";base64" in options.lower():
        data = decoded(payload, param, f"{kind}'s data")
    else:
        from urllib.parse import unquote_to_bytes
        data = unquote_to_bytes(payload)
    return MediaBlock(kind, clean_type(media_type, sniffed(data)), data, name=name, where=param)


def from_base64(data: object, kind: MediaKind, param: str, media_type: object = None,
                name: str | None = None) -> MediaBlock:
    raw = decoded(data, param, f"{kind}'s data")
    given = clean_type(media_type, "") if media_type else ""
    return MediaBlock(kind, given or sniffed(raw), raw, name=name, where=param)


def reference(value: object, kind: MediaKind, param: str, name: str | None = None) -> MediaBlock:
    """A file the client names but does not send (a URL, an uploaded file's id): kept, not fetched."""
    return MediaBlock(kind, OCTET_STREAM, reference=str(value)[:2000], name=name, where=param)


def openai_part(part: dict[str, Any], param: str) -> TextBlock | MediaBlock | None:
    """One chat completions content part (``text``, ``image_url``, ``input_audio``, ``file``; ``refusal`` is
    None); a 400 naming the part for an unknown type."""
    kind = part.get("type")
    if kind in ("text", "input_text", "output_text"):
        text = part.get("text")
        if text is not None and not isinstance(text, str):
            raise InvalidRequest("a text part's 'text' must be a string", param=f"{param}.text")
        return TextBlock(text or "")
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        return from_url(url, "image", f"{param}.image_url")
    if kind == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, dict):
            raise InvalidRequest("an input_audio part needs 'input_audio': {\"data\": base64, \"format\": "
                                 "\"wav\"}", param=f"{param}.input_audio")
        media_type = AUDIO_FORMATS.get(str(audio.get("format", "")).lower())
        return from_base64(audio.get("data"), "audio", f"{param}.input_audio.data", media_type)
    if kind == "file":
        file = part.get("file")
        if not isinstance(file, dict):
            raise InvalidRequest("a file part needs 'file': {\"file_data\": data URL or base64, \"filename\"}",
                                 param=f"{param}.file")
        return file_data(file.get("file_data"), file.get("file_id"), file.get("filename"), f"{param}.file")
    if kind == "refusal":
        return None
    raise InvalidRequest(f"unknown content part type {kind!r} (text, image_url, input_audio and file are read)",
                         param=f"{param}.type")


def file_data(data: object, file_id: object, filename: object, param: str,
              url: object = None) -> TextBlock | MediaBlock:
    """A file as OpenAI's dialects send it: ``file_data`` (a data URL, or bare base64), else a ``file_id`` or
    ``file_url`` (kept as a reference). A plain-text file is its text."""
    name = str(filename)[:500] if isinstance(filename, str) and filename else None
    if data is not None:
        if isinstance(data, str) and data.startswith("data:"):
            block = from_url(data, "document", f"{param}.file_data", name=name)
        else:
            block = from_base64(data, "document", f"{param}.file_data", name=name)
        return plain_text(block) or block
    if file_id is not None or url is not None:
        return reference(url if url is not None else file_id, "document", param, name)
    raise InvalidRequest("a file needs 'file_data' (a data URL or base64), 'file_id' or 'file_url'", param=param)


def plain_text(block: MediaBlock) -> TextBlock | None:
    """A text document (text/*, JSON, or a name ending in .txt/.md/...) as its text; None for anything else."""
    textual = block.media_type.startswith("text/") or block.media_type in ("application/json", "application/xml")
    if not textual and block.media_type == OCTET_STREAM and block.name:
        textual = block.name.lower().rsplit(".", 1)[-1] in ("txt", "md", "csv", "json", "xml", "yaml", "yml",
                                                             "py", "js", "ts", "html", "log")
    if not textual or not block.data:
        return None
    text = block.data.decode("utf-8", errors="replace")
    return TextBlock(document_text(block.name, text))


def tool_result(call_id: str, blocks: list[TextBlock | MediaBlock], name: str | None) -> ToolResultBlock:
    """A tool's output: its text, with each image (or file) at the place it held among the parts."""
    text = ""
    media: list[tuple[int, MediaBlock]] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            text += block.text
        else:
            media.append((len(text), block))
    return ToolResultBlock(call_id, text, name=name, media=media)
