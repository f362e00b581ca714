"""The images an op carries stay known to the worker until that op's final frame (issue 60, item 2): before, the
worker kept the 32 most recent images as ops arrived, so a request with 33 or more images, or queued requests with
more than 32 between them, got "image ... is not known to this worker" although it had sent the bytes. Real
llama.cpp (smollm2 with the tiny projector of tests/mmproj.py) behind the real serving loop and the worker's inbox;
the queued case is ordered by putting both ops in the inbox before the loop runs (both are taken, and their images
remembered, before either is admitted with one slot). Images no op holds are kept while a sequence holds them."""

from __future__ import annotations

import base64
import hashlib
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localai.engines.engine import LoadOptions
from localai.engines.llama_cpp import LlamaCppEngine
from localai.engines.llama_vision import KEEP_IMAGE_BYTES
from localai.engines.serving import Serving
from localai.protocol import WorkerFrame, image_mark
from tests import media_files as files
from tests.mmproj import write_mmproj
from tests.parallel import threads


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Serving]:
    projector = write_mmproj(tmp_path_factory.mktemp("mmproj") / "mmproj-tiny.gguf")
    load = LoadOptions(n_threads=threads(), model_path=str(smollm2_path), num_ctx=2048, n_parallel=1,
                       projector_path=str(projector))
    engine = LlamaCppEngine(load)
    try:
        yield Serving(engine, load)
    finally:
        engine.close()


def images(first: int, count: int) -> dict[str, str]:
    """``count`` distinct PNGs by digest, base64 as ops carry them."""
    out = {}
    for index in range(first, first + count):
        data = files.png(8, 8, (index, 255 - index, 7))
        out[hashlib.sha256(data).hexdigest()] = base64.b64encode(data).decode()
    return out


def prompt(media: dict[str, str]) -> str:
    return "Look: " + " ".join(image_mark(digest) for digest in media) + " What colours?"


def run(loop: Serving, ops: list[dict[str, Any]]) -> dict[str, WorkerFrame]:
    """Serve ``ops`` (all in the inbox before the loop starts) until each has its final frame."""
    inbox: queue.Queue[Any] = queue.Queue()
    finals: dict[str, WorkerFrame] = {}

    def emit(frame: WorkerFrame) -> None:
        if frame["ev"] in ("done", "error", "tokens"):
            finals[str(frame.get("id"))] = frame
            if len(finals) == len(ops):
                inbox.put(None)

    for op in ops:
        inbox.put(op)  # type: ignore[arg-type]
    loop.serve(inbox, emit)
    assert not loop.holding_media
    return finals


def generate(request_id: str, media: dict[str, str]) -> dict[str, Any]:
    return {"op": "generate", "id": request_id, "prompt": prompt(media), "media": media, "max_tokens": 2,
            "sampling": {"temperature": 0}}


def test_a_request_with_forty_images_finds_them_all(loop: Serving) -> None:
    media = images(0, 40)
    finals = run(loop, [generate("many", media),
                        {"op": "tokenize", "id": "count", "text": prompt(media), "media": media, "count_only": True}])
    assert finals["many"]["ev"] == "done", finals["many"]
    assert finals["count"]["ev"] == "tokens", finals["count"]


def test_queued_requests_keep_their_images_whatever_the_bound(loop: Serving) -> None:
    vision = loop.engine.vision  # type: ignore[attr-defined]
    vision.keep_bytes = 0  # no image outlives its op: only the ops' own hold keeps them
    try:
        second = images(120, 20)
        finals = run(loop, [generate("first", images(100, 20)), generate("second", second)])
        assert finals["first"]["ev"] == "done", finals["first"]
        assert finals["second"]["ev"] == "done", finals["second"]
        assert not vision.held  # released at their final frames
        # the first's images went when the second took the slot (cut past their common text); the second's stay
        # while its slot's sequence holds them, and go with it
        assert set(vision.images) == set(second)
        for seq in range(loop.engine.n_seq):  # type: ignore[attr-defined]
            loop.engine.seq_clear(seq)
        assert not vision.images
    finally:
        vision.keep_bytes = KEEP_IMAGE_BYTES
