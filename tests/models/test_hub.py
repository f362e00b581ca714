"""Hub references, file choice, the cache, and downloads against a real hub-compatible server."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from localai import paths
from localai.errors import (
    DownloadCorrupt,
    GatedModel,
    HubUnreachable,
    InvalidRequest,
    ModelNotFound,
    NotEnoughDiskSpace,
    PullCancelled,
)
from localai.models import hub
from tests.hubserver import HubServer

MiB = 1 << 20
BLOB = os.urandom(25 * MiB + 12345)


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    with HubServer() as hub_server:
        hub_server.add("org/Tiny-GGUF", {"tiny-Q4_K_M.gguf": BLOB, "config.json": b'{"a": 1}'})
        monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
        yield hub_server


@pytest.mark.parametrize(
    ("text", "repo", "quant"),
    [("hf.co/Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF:Q4_K_M", "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF", "Q4_K_M"),
     ("huggingface.co/a/b:q8_0", "a/b", "q8_0"), ("https://huggingface.co/a/b", "a/b", None),
     ("bartowski/Llama-3.2-1B-Instruct-GGUF", "bartowski/Llama-3.2-1B-Instruct-GGUF", None),
     ("hf.co/a/b:latest", "a/b", None), ("mlx-community/x.y_z-4bit", "mlx-community/x.y_z-4bit", None)],
)
def test_references(text: str, repo: str, quant: str | None) -> None:
    assert hub.parse_reference(text) == hub.HubRef(repo, quant)


@pytest.mark.parametrize("text", ["", "hf.co/", "justaname", "a/b/c", "hf.co/a", "a/b:Q4 K", "a/../b", "-a/b",
                                  "a/b:" + "q" * 80, "hf.co/a b/c", "/etc/passwd", "//a/b"])
def test_bad_references_name_the_forms(text: str) -> None:
    with pytest.raises(InvalidRequest) as error:
        hub.parse_reference(text)
    assert error.value.param == "model"


NAMES = [
    "Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Llama-3.2-1B-Instruct-Q8_0.gguf", "Llama-3.2-1B-Instruct-IQ4_XS.gguf",
    "mmproj-F16.gguf", "README.md", "Q6_K/m-Q6_K-00002-of-00002.gguf", "Q6_K/m-Q6_K-00001-of-00002.gguf",
    "big-Q5_K_M-00001-of-00003.gguf", "big-Q5_K_M-00002-of-00003.gguf",
]


def test_quantization_is_chosen_case_insensitively_with_split_parts_in_order() -> None:
    assert hub.choose_gguf(NAMES, None, "x") == ("Q4_K_M", ("Llama-3.2-1B-Instruct-Q4_K_M.gguf",))
    assert hub.choose_gguf(NAMES, "iq4_xs", "x") == ("IQ4_XS", ("Llama-3.2-1B-Instruct-IQ4_XS.gguf",))
    assert hub.choose_gguf(NAMES, "q6_k", "x") == (
        "Q6_K", ("Q6_K/m-Q6_K-00001-of-00002.gguf", "Q6_K/m-Q6_K-00002-of-00002.gguf"))
    assert "F16" not in hub.gguf_choices(NAMES)  # a vision projector is not a model
    assert "Q5_K_M" not in hub.gguf_choices(NAMES)  # an incomplete split is not offered


def test_missing_quantization_lists_what_exists() -> None:
    with pytest.raises(ModelNotFound) as error:
        hub.choose_gguf(NAMES, "Q5_K_M", "hf.co/x/y")
    message = error.value.message
    assert "no Q5_K_M" in message and "IQ4_XS, Q4_K_M, Q6_K, Q8_0" in message
    assert "localai pull hf.co/x/y:Q4_K_M" in message


@pytest.mark.parametrize(
    ("names", "expected"),
    [(["m-q8_0.gguf", "m-q4_0.gguf"], "Q4_0"),  # no Q4_K_M: the nearest in size and quality
     (["qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-1.5b-instruct-fp16.gguf"], "Q4_K_M"),
     (["deepseek-coder-1.3b-instruct.Q4_K_M.gguf"], "Q4_K_M"), (["model.gguf"], "MODEL")],
)
def test_default_quantization(names: list[str], expected: str) -> None:
    assert hub.choose_gguf(names, None, "x")[0] == expected


def test_ambiguous_or_absent_ggufs_are_errors() -> None:
    with pytest.raises(ModelNotFound, match="pick one of: A, B"):
        hub.choose_gguf(["a.gguf", "b.gguf"], None, "x")
    with pytest.raises(ModelNotFound, match="no GGUF files"):
        hub.choose_gguf(["config.json"], "Q4_K_M", "x")


def test_mlx_files() -> None:
    names = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md",
             "modeling_x.py", "sub/extra.safetensors"]
    assert hub.choose_mlx(names) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert hub.choose_mlx(["config.json", "pytorch_model.bin"]) is None


def test_list_repo_and_its_errors(server: HubServer) -> None:
    listing = hub.list_repo("ORG/tiny-gguf")  # names are case-insensitive on the hub
    assert listing.repo_id == "org/Tiny-GGUF" and len(listing.commit) == 40
    blob = listing.files["tiny-Q4_K_M.gguf"]
    assert blob.size == len(BLOB) and blob.sha256 == hashlib.sha256(BLOB).hexdigest()
    assert listing.files["config.json"].sha256 is None and listing.files["config.json"].blob_id
    with pytest.raises(ModelNotFound) as error:
        hub.list_repo("org/Tiny")
    assert "hf.co/org/Tiny was not found" in error.value.message and "org/Tiny-GGUF" in error.value.message


def test_unreachable_and_offline_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(HubUnreachable, match=r"cannot reach http://127\.0\.0\.1:9"):
        hub.list_repo("org/x")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnreachable, match="offline"):
        hub.list_repo("org/x")


def _fetch(name: str = "tiny-Q4_K_M.gguf", **kwargs: object) -> Path:
    listing = hub.list_repo("org/Tiny-GGUF")
    return hub.fetch(listing, listing.files[name], **kwargs)  # type: ignore[arg-type]


def _partial() -> Path:
    digest = hashlib.sha256(BLOB).hexdigest()
    return paths.hf_hub_cache() / "models--org--Tiny-GGUF" / "blobs" / f"{digest}.incomplete"


def test_fetch_lands_in_the_hub_cache_and_reports_progress(server: HubServer) -> None:
    seen: list[int] = []
    path = _fetch(report=seen.append)
    assert path.is_symlink() and path.read_bytes() == BLOB
    assert path.resolve().name == hashlib.sha256(BLOB).hexdigest()  # no second copy: the blob itself
    assert path.parent.parent.name == "snapshots" and seen[0] == 0 and seen[-1] == len(BLOB)
    assert seen == sorted(seen)
    assert hub.cached_weights(hub.HubRef("org/tiny-gguf")) == path  # found again without a request
    before = len(server.log)
    assert _fetch() == path and not server.downloads("tiny-Q4_K_M.gguf")[1:]
    assert all(entry.method != "GET" or "/resolve/" not in entry.path for entry in server.log[before:])


def test_git_stored_files_are_verified_by_their_object_id(server: HubServer) -> None:
    assert _fetch("config.json").read_bytes() == b'{"a": 1}'


def test_a_partial_download_resumes_with_a_range_request(server: HubServer) -> None:
    _partial().parent.mkdir(parents=True)
    _partial().write_bytes(BLOB[: 7 * MiB + 3])
    assert _fetch().read_bytes() == BLOB
    (download,) = server.downloads("tiny-Q4_K_M.gguf")
    assert download.range_start == 7 * MiB + 3 and download.sent == len(BLOB) - download.range_start


def test_a_dropped_connection_is_resumed_in_place(server: HubServer) -> None:
    server.file("org/Tiny-GGUF", "tiny-Q4_K_M.gguf").drop_after = 12 * MiB
    assert _fetch().read_bytes() == BLOB
    first, second = server.downloads("tiny-Q4_K_M.gguf")
    assert first.sent == 12 * MiB
    assert second.range_start and second.range_start >= 10 * MiB  # whole chunks written are not fetched again
    assert second.sent == len(BLOB) - second.range_start


def test_corrupt_bytes_are_rejected_and_deleted(server: HubServer) -> None:
    server.file("org/Tiny-GGUF", "tiny-Q4_K_M.gguf").served = bytes(len(BLOB))
    with pytest.raises(DownloadCorrupt, match=r"sha256 \w+ where the hub advertises"):
        _fetch()
    assert not _partial().exists() and not list(_partial().parent.iterdir())
    assert hub.cached_weights(hub.HubRef("org/Tiny-GGUF")) is None


def test_a_git_stored_file_with_a_bad_object_id_is_rejected_and_deleted(server: HubServer) -> None:
    """A file the hub stores in git (no LFS sha256) is checked by its git object id: bytes of the right size that
    are not the file fail it (only sha256 corruption was tested)."""
    server.file("org/Tiny-GGUF", "config.json").served = b'{"b": 2}'  # the same size, other bytes
    with pytest.raises(DownloadCorrupt, match=r"git object id [0-9a-f]{40} where the hub advertises"):
        _fetch("config.json")
    blobs = paths.hf_hub_cache() / "models--org--Tiny-GGUF" / "blobs"
    assert not blobs.exists() or not list(blobs.iterdir())


def test_a_partial_longer_than_the_file_starts_again(server: HubServer) -> None:
    _partial().parent.mkdir(parents=True)
    _partial().write_bytes(BLOB + b"extra")
    assert _fetch().read_bytes() == BLOB


def test_cancel_keeps_the_partial_download(server: HubServer) -> None:
    cancelled = threading.Event()

    def report(done: int) -> None:
        if done >= 10 * MiB:
            cancelled.set()

    with pytest.raises(PullCancelled):
        _fetch(report=report, cancelled=cancelled)
    assert _partial().stat().st_size == 10 * MiB
    assert _fetch().read_bytes() == BLOB
    assert server.downloads("tiny-Q4_K_M.gguf")[-1].range_start == 10 * MiB


def test_gated_repository_needs_a_token(server: HubServer) -> None:
    server.add("org/Gated", {"g-Q4_K_M.gguf": b"gated bytes"}, gated=True)
    listing = hub.list_repo("org/Gated")
    with pytest.raises(GatedModel, match="HF_TOKEN"):
        hub.fetch(listing, listing.files["g-Q4_K_M.gguf"])
    path = hub.fetch(listing, listing.files["g-Q4_K_M.gguf"], token=server.token)
    assert path.read_bytes() == b"gated bytes"


def test_disk_space_check() -> None:
    hub.check_disk_space(1, 0, "m")
    with pytest.raises(NotEnoughDiskSpace) as error:
        hub.check_disk_space(10**9, 10**18, "qwen2.5-coder:7b")
    assert "qwen2.5-coder:7b" in error.value.message and "LOCALAI_MIN_FREE_SPACE" in error.value.message


def test_removing_cached_weights_keeps_blobs_other_snapshots_use(server: HubServer) -> None:
    path = _fetch()
    config = _fetch("config.json")
    blob = path.resolve()
    twin = path.parent.parent / ("0" * 40) / path.name  # another commit linking the same blob
    twin.parent.mkdir()
    twin.symlink_to(os.path.relpath(blob, twin.parent))
    assert hub.remove_cached(path) == 0 and blob.exists() and not path.exists()
    assert hub.remove_cached(twin) == len(BLOB) and not blob.exists()
    assert config.exists()
    assert hub.remove_cached(config) > 0
    assert not (paths.hf_hub_cache() / "models--org--Tiny-GGUF").exists()
    assert hub.remove_cached(Path("/etc/hostname")) == 0  # never outside the cache
