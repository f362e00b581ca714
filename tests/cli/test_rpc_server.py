"""`localai rpc-server`: loopback unless told otherwise, with what the protocol lacks said when told."""

from __future__ import annotations

from click.testing import CliRunner

import localai.cli.rpc  # noqa: F401 - registers the command
from localai.cli import cli


def test_a_network_address_is_refused_without_expose() -> None:
    result = CliRunner().invoke(cli, ["rpc-server", "--host", "0.0.0.0"])
    assert result.exit_code != 0
    assert "without authentication or encryption" in result.output and "--expose" in result.output
    assert "SSH tunnel" in result.output
