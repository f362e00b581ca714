"""What a new user met in the TUI (issue 37): the pull dialog's placeholder and cut question, a failed pull's bar
that kept animating, the Settings dialog at other terminal sizes, and cache entries named by fingerprint."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable, Input, Label, ProgressBar, TextArea

from localai.tui.app import LocalAIApp
from localai.tui.screens.chat import ChatScreen
from localai.tui.screens.dialogs import AskScreen
from localai.tui.screens.models import ModelsScreen
from localai.tui.screens.settings import SettingsScreen
from tests.tui.conftest import settle
from tests.tui.fakedaemon import FINGERPRINT, NOW, SMOLLM2_DIGEST, FakeDaemon, tag

pytestmark = pytest.mark.anyio
SIZE = (120, 36)


def pulls(fake: FakeDaemon) -> list[str]:
    return [body["model"] for _, path, body in fake.requests if path == "/api/pull"]


async def open_models(pilot: Pilot[Any]) -> ModelsScreen:
    await pilot.press("f3")
    await settle(pilot)
    screen = pilot.app.screen
    assert isinstance(screen, ModelsScreen)
    return screen


async def test_the_pull_dialog_offers_no_example_as_an_answer_and_says_what_to_type(
        build: Callable[..., LocalAIApp], fake: FakeDaemon) -> None:
    app = build(fake.client())
    async with app.run_test(size=SIZE) as pilot:
        await open_models(pilot)  # the installed table has focus: nothing to suggest
        await pilot.press("p")
        await settle(pilot)
        dialog = app.screen
        assert isinstance(dialog, AskScreen)
        answer = dialog.query_one(Input)
        assert answer.value == "" and answer.placeholder.startswith("e.g. ")  # an example, not a value
        await pilot.press("enter")
        await settle(pilot)
        assert app.screen is dialog and pulls(fake) == []  # still asking, and nothing was sent
        hint = dialog.query_one("#hint", Label)
        assert hint.has_class("dialog-error") and "Type a model's name first" in str(hint.render())
        await pilot.press(*"qwen2.5-coder:3b", "enter")
        await settle(pilot)
        assert not isinstance(app.screen, AskScreen) and pulls(fake) == ["qwen2.5-coder:3b"]

        await pilot.press("tab")  # the library table: its highlighted row is the suggestion
        library = app.screen.query_one("#library", DataTable)
        assert app.screen.focused is library
        await pilot.press("down", "p")
        await settle(pilot)
        suggested = app.screen.query_one(Input).value
        assert suggested == library.coordinate_to_cell_key(library.cursor_coordinate).row_key.value
        await pilot.press("enter")
        await settle(pilot)
        assert pulls(fake) == ["qwen2.5-coder:3b", suggested]


async def test_the_pull_question_wraps_inside_its_dialog(build: Callable[..., LocalAIApp], fake: FakeDaemon) -> None:
    app = build(fake.client())
    async with app.run_test(size=SIZE) as pilot:
        await open_models(pilot)
        await pilot.press("p")
        await settle(pilot)
        box = app.screen.query_one(".dialog-box")
        title = app.screen.query_one(".dialog-title", Label)
        assert title.region.height >= 2  # wrapped, not cut at the box's edge
        assert box.content_region.contains_region(title.region)
        lines = [strip.text for strip in title.render_lines(title.region.reset_offset)]
        said = " ".join(line.strip() for line in lines)
        assert said.endswith("hf.co/OWNER/REPO:QUANT or OWNER/REPO"), said


async def test_a_failed_pull_stops_its_progress_bar(build: Callable[..., LocalAIApp], fake: FakeDaemon) -> None:
    fake.pull_error = "hf.co/nobody/nothing-GGUF: repository not found on the hub"
    app = build(fake.client())
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_models(pilot)
        failed = screen.start_pull("hf.co/nobody/nothing-GGUF")
        await settle(pilot)
        assert failed.finished and failed.has_class("failed")
        bar = failed.query_one(ProgressBar)
        assert not bar.display  # an indeterminate bar animates forever: it goes
        assert "failed: " in str(failed.query_one(".pull-status", Label).render())
        fake.pull_error = None
        done = screen.start_pull("qwen2.5-coder:3b")
        await settle(pilot)
        shown = done.query_one(ProgressBar)
        assert shown.display and shown.percentage == 1.0  # a measured pull keeps its full bar


@pytest.mark.parametrize("size", [(160, 45), (120, 36), (80, 24)])
async def test_the_settings_dialog_keeps_both_text_areas_and_its_buttons_on_screen(
        build: Callable[..., LocalAIApp], fake: FakeDaemon, size: tuple[int, int]) -> None:
    app = build(fake.client(), model="smollm2", options={"num_predict": 64, "temperature": 0.2})
    async with app.run_test(size=size) as pilot:
        await pilot.press("f2")
        assert isinstance(app.screen, ChatScreen)
        await pilot.press("ctrl+t")
        await settle(pilot)
        dialog = app.screen
        assert isinstance(dialog, SettingsScreen)
        screen_region = dialog.region
        for name in ("#system", "#parameters", "#save", "#cancel"):
            assert screen_region.contains_region(dialog.query_one(name).region), name
        for name in ("#system", "#parameters"):
            assert dialog.query_one(name, TextArea).content_size.height >= 3, name  # never one line
        assert dialog.query_one("#parameters", TextArea).text == "num_predict 64\ntemperature 0.2"


async def test_the_cache_screen_names_entries_by_the_model_the_daemon_reports(
        build: Callable[..., LocalAIApp], fake: FakeDaemon) -> None:
    # entries of sessions no TUI conversation made (`localai run`, an agent): only the daemon knows their model
    fake.entries = [
        {"id": "f813c73813aa000000000001", "fingerprint": FINGERPRINT, "tokens": 300, "bytes": 7_000_000,
         "session": "agent-session-1", "kind": "history", "last_used": NOW.timestamp(), "pinned_until": None,
         "model": "smollm2:135m", "models": ["smollm2:135m"]},
        {"id": "f813c73813aa000000000002", "fingerprint": "9" * 32, "tokens": 128, "bytes": 3_000_000,
         "session": None, "kind": "system", "last_used": NOW.timestamp(), "pinned_until": None,
         "model": None, "models": ["critic:latest", "pirate:latest"]},  # personas sharing one worker's cache
    ]
    app = build(fake.client())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f5")
        await settle(pilot)
        table = app.screen.query_one("#cache-models", DataTable)
        rows = {str(table.get_row_at(i)[0]): table.get_row_at(i) for i in range(table.row_count)}
        assert not any(name.startswith("fingerprint") for name in rows), rows
        assert str(rows["smollm2:135m"][1]) == "1"  # its entry, under its name
        assert str(rows["critic:latest + pirate:latest"][1]) == "1"


async def test_personas_sharing_a_digest_keep_their_own_names_on_the_cache_screen(
        build: Callable[..., LocalAIApp], fake: FakeDaemon) -> None:
    """pirate FROM smollm2 has smollm2's digest: it is not an alias of smollm2, and neither is smollm2 of it."""
    fake.models.append(tag("pirate:latest", SMOLLM2_DIGEST, 98_362_432, "Q4_1", "135M", "llama", 8192))
    fake.metrics = ('localai_prompt_tokens_computed_total{model="pirate:latest"} 20.0\n'
                    'localai_prompt_tokens_computed_total{model="smollm2:135m"} 31.0\n')
    both = ["pirate:latest", "smollm2:135m"]
    fake.entries = [
        {"id": "51fafa3e7c2b000000000001", "fingerprint": FINGERPRINT, "tokens": 45, "bytes": 1_000_000,
         "session": "run-1", "kind": "history", "last_used": NOW.timestamp(), "pinned_until": None,
         "model": "smollm2:135m", "models": both},
        {"id": "7445bd489052000000000002", "fingerprint": FINGERPRINT, "tokens": 68, "bytes": 1_600_000,
         "session": None, "kind": "history", "last_used": NOW.timestamp(), "pinned_until": None,
         "model": None, "models": both},
    ]
    app = build(fake.client())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f5")
        await settle(pilot)
        table = app.screen.query_one("#cache-models", DataTable)
        rows = {str(table.get_row_at(i)[0]): str(table.get_row_at(i)[1]) for i in range(table.row_count)}
    assert rows == {"pirate:latest": "0", "pirate:latest + smollm2:135m": "1", "smollm2:135m": "1"}
