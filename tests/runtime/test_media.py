"""The document reader: a PDF's text is extracted once, however many requests bring it at the same time."""

from __future__ import annotations

import asyncio
from typing import Any

from localai.runtime.media import DocumentReader, PdfText
from localai.schema import MediaBlock
from tests import media_files as files


def test_two_requests_with_the_same_pdf_share_one_extraction() -> None:
    """The first request's extraction is held (an event, not a sleep) while the second arrives: before, the second
    started an extraction of its own (two child processes reading the same file)."""

    async def scenario() -> tuple[int, list[PdfText]]:
        reader = DocumentReader()
        started, release = asyncio.Event(), asyncio.Event()
        calls = 0
        real = reader._extract

        async def held(block: MediaBlock) -> dict[str, Any]:
            nonlocal calls
            calls += 1
            started.set()
            await release.wait()
            return await real(block)

        reader._extract = held  # type: ignore[method-assign]
        pdf = MediaBlock("document", "application/pdf", files.pdf_with_text("Shared page"), name="a.pdf")
        first = asyncio.create_task(reader.read(pdf))
        await started.wait()
        second = asyncio.create_task(reader.read(MediaBlock("document", "application/pdf", pdf.data, name="b.pdf")))
        await asyncio.sleep(0)  # one turn of the loop (a yield, not a wait): the second request runs to its await
        release.set()
        return calls, list(await asyncio.gather(first, second))

    calls, texts = asyncio.run(scenario())
    assert calls == 1, f"{calls} extractions of one PDF"
    assert texts[0] == texts[1] and "Shared page" in texts[0].text


def test_a_cancelled_request_leaves_the_shared_extraction_to_the_other() -> None:
    async def scenario() -> PdfText:
        reader = DocumentReader()
        started = asyncio.Event()
        real = reader._extract

        async def signalled(block: MediaBlock) -> dict[str, Any]:
            started.set()
            return await real(block)

        reader._extract = signalled  # type: ignore[method-assign]
        pdf = MediaBlock("document", "application/pdf", files.pdf_with_text("Still read"))
        first = asyncio.create_task(reader.read(pdf))
        await started.wait()
        second = asyncio.create_task(reader.read(pdf))
        first.cancel()  # its client went away
        return await second

    assert "Still read" in asyncio.run(scenario()).text
