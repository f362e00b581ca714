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


def test_the_pdf_reader_runs_below_the_engines_and_is_stopped_by_cpu_time(monkeypatch: Any) -> None:
    """Issue 46, item 8: pypdf at the engines' priority took the cores from their threads (a 20,000-page PDF held a
    parallel chat's 8 tokens for 5 s instead of 0.3 s). The reader now runs at PDF_NICE, and its limit is CPU time
    (SIGXCPU), so waiting for the CPU the engines leave does not fail it; a PDF that costs too much still does."""
    from localai.runtime import media

    spawned: list[int] = []
    niceness: list[int] = []
    real_exec = asyncio.create_subprocess_exec

    async def watched(*args: Any, **kwargs: Any) -> Any:
        process = await real_exec(*args, **kwargs)
        spawned.append(process.pid)
        return process

    monkeypatch.setattr(media.asyncio, "create_subprocess_exec", watched)

    async def scenario() -> tuple[PdfText | Exception, str]:
        reader = DocumentReader(timeout=1.0)
        task = asyncio.create_task(reader.read(MediaBlock("document", "application/pdf", files.pdf_bomb(70))))
        while not spawned:
            await asyncio.sleep(0.01)
        while not task.done():  # the child's priority, read while it runs
            try:
                with open(f"/proc/{spawned[0]}/stat") as stat:
                    niceness.append(int(stat.read().rsplit(")", 1)[1].split()[16]))
            except (OSError, ValueError, IndexError):
                pass
            await asyncio.sleep(0.05)
        try:
            return task.result(), ""
        except Exception as exc:
            return exc, str(exc)

    result, message = asyncio.run(scenario())
    assert isinstance(result, Exception) and "reading the PDF took longer than 1 s" in message, result
    assert niceness and max(niceness) == media.PDF_NICE, niceness
    spawned.clear()
    text = asyncio.run(DocumentReader().read(MediaBlock("document", "application/pdf", files.pdf_with_text("Fine"))))
    assert "Fine" in text.text  # an ordinary PDF is read the same way
