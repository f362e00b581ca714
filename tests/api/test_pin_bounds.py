"""``/api/cache/pin`` refuses what pins.json must not hold (``promptcache/pins.py``'s bounds): a 400 naming the
field, through the real app."""

from __future__ import annotations

from fastapi.testclient import TestClient

from localai.promptcache import pins


def test_a_pin_with_a_24_mb_session_name_is_a_400(api: TestClient) -> None:
    refused = api.post("/api/cache/pin", json={"session": "x" * 24_000_000})
    assert refused.status_code == 400 and "at most 2048 characters" in refused.text, refused.text[:300]
    refused = api.post("/api/cache/pin", json={"entry": "e" * 5000})
    assert refused.status_code == 400 and "a pinned entry is at most" in refused.text, refused.text[:300]
    assert all(len(p.session or p.entry or "") <= pins.MAX_PIN_NAME for p in pins.load_pins())
    assert api.post("/api/cache/pin", json={"session": "s" * 2048}).status_code == 200
