"""What a model gets of the media in a conversation, decided before the prompt is rendered.

A document becomes its text (a PDF's through pypdf, in a child process bounded in time and memory; a text file as
it is). An image or audio clip the model cannot take, a document with no text in it, or a file the client only
named (a URL, an uploaded file's id: never fetched) becomes a short stand-in in its place, saying what it was (kind,
media type, size and a hash, so the same file always gives the same text and the cached prefix holds) and why it
was left out; the response then says so too (``X-LocalAI-Omitted``), and the log has a line. A request is never
refused for holding media a model cannot read: an agent's session would end on the 400.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import signal
import sys
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

from localai.errors import InvalidRequest
from localai.protocol import IMAGE_MARK_START, image_mark
from localai.schema import Block, MediaBlock, Message, TextBlock, ToolResultBlock

log = logging.getLogger("localai.runtime")
TEXT_ONLY = "this model reads text only"
UNREADABLE = "not shown: this model's image reader takes PNG, JPEG, GIF and BMP"
NOT_FETCHED = "not fetched: localai does not download files a request names"
PDF = "application/pdf"
PDF_TIMEOUT = 30.0  # CPU seconds a PDF may take to read (a page tree that never ends, a decompression bomb)
# The reader runs below the engines' priority: at the same priority, a 20,000-page PDF's 7.6 s of pypdf on this
# 2-core machine took the cores from the engine's threads, and a parallel chat's 8 tokens took 5 s instead of 0.3 s
# (at nice 10: 0.64 s at most over 67 chats; the PDF's answer 19 s instead of 12 s). Its limit is CPU time, so a
# busy machine slows a PDF without failing it; the wall-clock bound (PDF_WALL_FACTOR times the limit) still holds.
PDF_NICE = 10
PDF_WALL_FACTOR = 4
PDF_CONCURRENCY = 2  # PDFs read at once (each in a process of its own)
HEADER_ITEMS = 8  # omissions named in the response header; the rest are counted


def document_text(name: str | None, text: str, pages: int | None = None) -> str:
    """A document's text as it is put in the prompt, its name (and pages) first when it has them."""
    head = [f"[document: {name}" if name else "[document", f", {pages} pages]" if pages else "]"]
    return "".join(head) + "\n" + text


def stand_in(block: MediaBlock, reason: str, pages: int | None = None) -> str:
    """The text that takes a medium's place: what it was and why it is not there."""
    if block.reference is not None and not block.data:
        return f"[{block.kind}{' ' + block.name if block.name else ''} at {block.reference}: {reason}]"
    facts = [block.media_type, *([f"{pages} pages"] if pages else []), f"{len(block.data):,} bytes",
             f"sha256 {block.digest()[:16]}"]
    name = f" {block.name}" if block.name else ""
    return f"[{block.kind}{name} ({', '.join(facts)}): {reason}]"


@dataclass(frozen=True)
class Omission:
    """A medium the model did not get, and why."""

    block: MediaBlock
    reason: str

    def item(self) -> str:
        """One entry of the ``X-LocalAI-Omitted`` header (ASCII: a client's file name never goes there)."""
        block = self.block
        if block.reference is not None and not block.data:
            facts = "reference"
        else:
            facts = f"{len(block.data)} bytes; sha256={block.digest()[:16]}"
        where = f"; at={block.where}" if block.where else ""
        return f"{block.kind} {block.media_type}; {facts}{where}"


def header(omitted: list[Omission]) -> str:
    """The ``X-LocalAI-Omitted`` value: what was left out of the prompt, and why (the first reason)."""
    items = [o.item() for o in omitted[:HEADER_ITEMS]]
    if len(omitted) > HEADER_ITEMS:
        items.append(f"and {len(omitted) - HEADER_ITEMS} more")
    reason = omitted[0].reason.encode("ascii", "replace").decode()
    return f"{len(omitted)} left out ({reason}): " + ", ".join(items)


@dataclass
class Prepared:
    """A conversation with its media resolved to text, what was left out, and the images a model with a vision
    projector sees (bytes by sha256; the prompt marks where each stands)."""

    messages: list[Message] | None
    omitted: list[Omission] = field(default_factory=list)
    images: dict[str, bytes] = field(default_factory=dict)


@dataclass
class PdfText:
    pages: int
    text: str


class DocumentReader:
    """Reads PDFs' text, each in a child process (``runtime/pdf_text.py``) stopped after ``timeout`` seconds of CPU
    time (or ``PDF_WALL_FACTOR`` times that of wall time); the texts of recent PDFs are kept, since an agent resends
    the same document every turn."""

    def __init__(self, timeout: float = PDF_TIMEOUT, keep: int = 32) -> None:
        self.timeout = timeout
        self.keep = keep
        self._texts: OrderedDict[str, PdfText] = OrderedDict()
        self._reading: dict[str, asyncio.Task[dict[str, Any]]] = {}  # extractions in flight, by the PDF's digest
        self._slots = asyncio.Semaphore(PDF_CONCURRENCY)

    async def read(self, block: MediaBlock) -> PdfText:
        """The PDF's text; an ``InvalidRequest`` naming the block when it is encrypted, damaged or too costly. Two
        requests with the same PDF at once share one extraction: the second waits for the first's result."""
        key = block.digest()
        if key in self._texts:
            self._texts.move_to_end(key)
            return self._texts[key]
        reading = self._reading.get(key)
        if reading is None:
            reading = self._reading[key] = asyncio.ensure_future(self._extract_in_slot(block))
            reading.add_done_callback(lambda _: self._reading.pop(key, None))
        result = await asyncio.shield(reading)  # one requester cancelled (its client gone) leaves it to the others
        error = result.get("error")
        if error is not None:
            where = f"{block.where}: " if block.where else ""
            if error == "encrypted":
                message = "the PDF is encrypted with a password; send it decrypted, or its text"
            elif error == "malformed":
                message = (f"the PDF cannot be read: it is damaged, cut short or not a PDF ({result.get('message')});"
                           " send the whole file, or its text")
            else:
                message = f"{result.get('message')}; send the document's text instead"
            raise InvalidRequest(where + message, param=block.where or None)
        found = PdfText(int(result.get("pages", 0)), str(result.get("text", "")))
        self._texts[key] = found
        while len(self._texts) > self.keep:
            self._texts.popitem(last=False)
        return found

    async def _extract_in_slot(self, block: MediaBlock) -> dict[str, Any]:
        async with self._slots:
            return await self._extract(block)

    async def _extract(self, block: MediaBlock) -> dict[str, Any]:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "localai.runtime.pdf_text", "--cpu", str(math.ceil(self.timeout)),
            "--nice", str(PDF_NICE), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        too_long = {"error": "timeout", "message": f"reading the PDF took longer than {self.timeout:g} s"}
        try:
            out, err = await asyncio.wait_for(process.communicate(block.data), self.timeout * PDF_WALL_FACTOR)
        except TimeoutError:
            return too_long
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        if process.returncode == -signal.SIGXCPU:
            return too_long
        try:
            result = json.loads(out)
        except ValueError:
            log.warning("the PDF reader exited with %s: %s", process.returncode, err.decode(errors="replace")[-500:])
            memory = b"MemoryError" in err or process.returncode in (-9, 137)
            return {"error": "too_large" if memory else "malformed",
                    "message": "reading the PDF took more memory than allowed (1 GiB)" if memory
                    else "the PDF reader failed on it"}
        return result if isinstance(result, dict) else {"error": "malformed", "message": "no result"}


async def prepare(messages: list[Message] | None, documents: DocumentReader, *, model: str,
                  sees_images: bool = False, passes_images: bool = False,
                  image_reason: str | None = None) -> Prepared:
    """``messages`` with every medium resolved to text: documents to their text; images, for a model that sees
    them, to marks of where they stand (``protocol.image_mark``), or, for a remote model (``passes_images``), kept
    as they are for the upstream's dialect (its bytes or its URL); the rest to stand-ins (``image_reason``, when
    given, says why an image was left out). What was left out is logged. For a model that sees images, text that
    spells a mark is broken up first: only images a client sent become marks."""
    if messages is None or not (sees_images or any(_has_media(message) for message in messages)):
        return Prepared(messages)
    prepared = Prepared([])
    for message in messages:
        content: list[Block] = []
        for index, block in enumerate(message.content):
            if sees_images:
                block = _unmarked(block)
            if isinstance(block, MediaBlock) and passes_images and _passable(block):
                content.append(block)
            elif isinstance(block, MediaBlock) and image_reason and block.kind == "image":
                prepared.omitted.append(Omission(block, image_reason))
                before = content[-1] if content else None
                after = message.content[index + 1] if index + 1 < len(message.content) else None
                content.append(TextBlock(_spaced(stand_in(block, image_reason), before, after)))
            elif isinstance(block, MediaBlock) and sees_images and _viewable(block):
                prepared.images[block.digest()] = block.data
                before = content[-1] if content else None
                after = message.content[index + 1] if index + 1 < len(message.content) else None
                content.append(TextBlock(_spaced(image_mark(block.digest()), before, after)))
            elif isinstance(block, MediaBlock):
                text = await _text_of(block, documents, prepared.omitted, sees_images)
                before = content[-1] if content else None
                after = message.content[index + 1] if index + 1 < len(message.content) else None
                content.append(TextBlock(_spaced(text, before, after)))
            elif isinstance(block, ToolResultBlock) and block.media:
                content.append(await _result_with_text(block, documents, prepared, sees_images))
            else:
                content.append(block)
        assert prepared.messages is not None
        prepared.messages.append(Message(message.role, content, message.name))
    if prepared.omitted:
        log.info("left out of %s's prompt: %s", model, "; ".join(
            f"{o.item()} ({o.reason})" for o in prepared.omitted))
    return prepared


def _has_media(message: Message) -> bool:
    return any(isinstance(block, MediaBlock) or (isinstance(block, ToolResultBlock) and block.media)
               for block in message.content)


async def _text_of(block: MediaBlock, documents: DocumentReader, omitted: list[Omission],
                   sees_images: bool = False) -> str:
    if block.reference is not None and not block.data:
        omitted.append(Omission(block, NOT_FETCHED))
        return stand_in(block, NOT_FETCHED)
    if block.kind == "document" or block.media_type == PDF:
        if block.media_type != PDF:
            reason = "not read: localai reads PDF and text documents"
            omitted.append(Omission(block, reason))
            return stand_in(block, reason)
        found = await documents.read(block)
        if found.text.strip():
            return document_text(block.name, found.text, found.pages)
        reason = "no text could be extracted from it (scanned pages or images only)"
        omitted.append(Omission(block, reason))
        return stand_in(block, reason, found.pages)
    reason = UNREADABLE if sees_images and block.kind == "image" else TEXT_ONLY
    omitted.append(Omission(block, reason))
    return stand_in(block, reason)


async def _result_with_text(block: ToolResultBlock, documents: DocumentReader, prepared: Prepared,
                            sees_images: bool) -> ToolResultBlock:
    """A tool result with each medium's text (or image mark) put where the medium stood."""
    pieces: list[str] = []
    last = 0
    for offset, medium in sorted(block.media, key=lambda pair: pair[0]):
        offset = max(last, min(offset, len(block.content)))
        pieces.append(block.content[last:offset])
        if sees_images and _viewable(medium):
            prepared.images[medium.digest()] = medium.data
            text = image_mark(medium.digest())
        else:
            text = await _text_of(medium, documents, prepared.omitted, sees_images)
        before = "".join(pieces)
        pieces.append(("\n" if before and not before[-1].isspace() else "") + text
                      + ("\n" if offset < len(block.content) and not block.content[offset].isspace() else ""))
        last = offset
    pieces.append(block.content[last:])
    return ToolResultBlock(block.tool_call_id, "".join(pieces), block.name, block.is_error)


VIEWABLE = frozenset({"image/png", "image/jpeg", "image/gif", "image/bmp"})  # what mtmd's image reader decodes
# What an upstream's refusal of images says (llama-server without its mmproj, vLLM and others on a text model), or
# an upstream failing on them (llama-cpp-python's server without a vision chat handler answers HTTP 500)
_REFUSED_IMAGES = re.compile(r"image|vision|multi-?modal|mmproj|HTTP 500", re.I)


def _passable(block: MediaBlock) -> bool:
    """An image an upstream can be given: its bytes, or an http(s) URL it fetches itself."""
    if block.kind != "image":
        return False
    return bool(block.data) or bool(block.reference and block.reference.startswith(("http://", "https://")))


def carries_images(messages: list[Message] | None) -> bool:
    """Whether prepared messages still hold images as they came (for a remote model)."""
    return any(isinstance(block, MediaBlock) for message in messages or [] for block in message.content)


def refused_images(message: str) -> bool:
    """Whether an upstream's error may be about the images it was sent (a request that carried some)."""
    return bool(_REFUSED_IMAGES.search(message))


def _viewable(block: MediaBlock) -> bool:
    """An image whose bytes a vision projector can read (others get the stand-in)."""
    return block.kind == "image" and bool(block.data) and block.media_type in VIEWABLE


def _unmarked(block: Block) -> Block:
    """Text that spells an image mark, broken up so it stays text (only images a client sent become marks)."""
    broken = IMAGE_MARK_START[:-1] + "\u200b_"
    if isinstance(block, TextBlock) and IMAGE_MARK_START in block.text:
        return TextBlock(block.text.replace(IMAGE_MARK_START, broken))
    if isinstance(block, ToolResultBlock) and IMAGE_MARK_START in block.content:
        return replace(block, content=block.content.replace(IMAGE_MARK_START, broken))
    return block


def _spaced(text: str, before: Block | None, after: Block | None) -> str:
    """A medium's text set apart from the text around it in the same message."""
    if isinstance(before, TextBlock) and before.text and not before.text[-1].isspace():
        text = "\n" + text
    if isinstance(after, TextBlock) and after.text and not after.text[0].isspace():
        text += "\n"
    return text
