"""``localai cache`` on a real cache directory (no daemon needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from localai import paths
from localai.promptcache.store import PromptStore
from tests.cachecodec import BytesCodec, state_of

TOKENS = list(range(500, 600))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localai", "cache", *args], capture_output=True, text=True)


def fill(home: Path) -> None:
    cache = PromptStore(paths.cache_dir(), "a" * 32, BytesCodec(), max_bytes=1 << 30)
    cache.save(TOKENS, state_of(TOKENS), "alpha")
    cache.save([1, *TOKENS], state_of([1, *TOKENS]), "beta")
    cache.save([2, *TOKENS], state_of([2, *TOKENS]), None, kind="system")
    cache.close()


def test_ls_stats_pin_rm_prune(isolated_home: Path) -> None:
    fill(isolated_home)
    listed = json.loads(cli("ls", "--json").stdout)
    assert len(listed) == 3 and {e["kind"] for e in listed} == {"history", "system"}
    assert "alpha" in cli("ls").stdout
    stats = cli("stats").stdout
    assert "entries       3" in stats and "sessions      2" in stats and "blocks        6" in stats

    assert cli("pin", "--session", "beta", "--ttl", "2h").returncode == 0
    pinned = [e["session"] for e in json.loads(cli("ls", "--json").stdout) if e["pinned_until"]]
    assert pinned == ["beta"]
    removed = cli("prune", "--max-bytes", "0")
    assert removed.returncode == 0 and "removed 4 blocks" in removed.stdout
    remaining = json.loads(cli("ls", "--json").stdout)
    assert [e["session"] for e in remaining] == ["beta"]  # pinned survives

    assert cli("unpin", "--session", "beta").stdout.strip() == "unpinned"
    assert "removed 1 entry" in cli("rm", remaining[0]["id"][:8]).stdout
    assert json.loads(cli("ls", "--json").stdout) == []
    assert not list(paths.cache_dir().glob("*/blocks/*.blk"))  # and the blocks only it used


def test_bad_input(isolated_home: Path) -> None:
    assert cli("pin", "--ttl", "1h").returncode == 1  # neither session nor entry
    bad_ttl = cli("pin", "--session", "x", "--ttl", "soon")
    assert bad_ttl.returncode == 1 and "invalid duration" in bad_ttl.stderr
    assert cli("rm").returncode == 1
    (paths.cache_dir()).mkdir(parents=True, exist_ok=True)
    (paths.cache_dir() / "pins.json").write_text("{not json")
    assert cli("ls").returncode == 0  # a broken pins file is ignored, not fatal


def test_durations_in_days_unknown_entries_and_option_help(isolated_home: Path) -> None:
    fill(isolated_home)
    pinned = cli("pin", "--session", "alpha", "--ttl", "7d")
    assert pinned.returncode == 0, pinned.stderr
    pruned = cli("prune", "--older-than", "7d")  # what its help says it takes
    assert pruned.returncode == 0, pruned.stderr
    assert len(json.loads(cli("ls", "--json").stdout)) == 3  # all used just now

    for args in (("rm", "nosuch"), ("rm", "--session", "nosuch")):
        missing = cli(*args)
        assert missing.returncode == 1 and "removed" not in missing.stdout
        assert "no cache entry has the" in missing.stderr and "nosuch" in missing.stderr
        assert "localai cache ls" in missing.stderr
    assert len(json.loads(cli("ls", "--json").stdout)) == 3

    unpin_help = cli("unpin", "--help").stdout
    assert "Unpin this session id" in unpin_help and "Unpin one entry" in unpin_help
    assert "7d=168h" not in cli("prune", "--help").stdout


def test_ls_and_rm_by_partition(isolated_home: Path) -> None:
    cache = PromptStore(paths.cache_dir(), "a" * 32, BytesCodec(), max_bytes=1 << 30)
    cache.save(TOKENS, state_of(TOKENS), "s", partition="1111aaaa2222bbbb")
    cache.save([3, *TOKENS], state_of([3, *TOKENS]), "s", partition="1111aaaa2222bbbb.5a1t")
    cache.save([4, *TOKENS], state_of([4, *TOKENS]), "s", partition="3333cccc4444dddd")
    cache.save([5, *TOKENS], state_of([5, *TOKENS]), "s")
    cache.close()
    assert "PARTITION" in cli("ls").stdout and "3333cccc4444dddd" in cli("ls").stdout
    mine = json.loads(cli("ls", "--json", "--partition", "1111aaaa2222bbbb").stdout)
    assert sorted(e["partition"] for e in mine) == ["1111aaaa2222bbbb", "1111aaaa2222bbbb.5a1t"]
    assert "removed 1 entry" in cli("rm", "--session", "s", "--partition", "3333cccc4444dddd").stdout
    assert "removed 2 entries" in cli("rm", "--partition", "1111aaaa2222bbbb").stdout
    assert [e["partition"] for e in json.loads(cli("ls", "--json").stdout)] == [""]
