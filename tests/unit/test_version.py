"""One version everywhere: the CLI's, the agent's Join, status, and a coordinator that refuses a protocol it does
not speak, naming both sides."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tfelastic.daemon.cli import main
from tfelastic.daemon.rendezvous.api import NodeInfo, ProtocolVersionError
from tfelastic.daemon.rendezvous.state import Rendezvous
from tfelastic.daemon.version import PROTOCOL, VERSION, describe, speaks

from tests.fakes import FakeClock
from tests.unit.test_rendezvous_state import SETTINGS, SPEC


def test_tfelastic_version_prints_it_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(["--version"])
    assert excinfo.value.code == 0
    assert capsys.readouterr().out.strip() == f"tfelastic {VERSION} (protocol {PROTOCOL})" == describe()


def test_the_package_metadata_has_the_same_version() -> None:
    from importlib.metadata import version

    assert version("tfelastic") == VERSION


def test_the_changelog_begins_with_this_version_and_its_protocol() -> None:
    """A release is not done until the CHANGELOG says what is in it, and which releases it can be mixed with."""
    changelog = Path(__file__).resolve().parents[2] / "docs" / "CHANGELOG.md"
    releases = re.findall(r"^## (\S+) \(protocol (\d+)\)", changelog.read_text(), re.MULTILINE)
    assert releases and releases[0] == (VERSION, str(PROTOCOL)), releases[:3]


def test_a_coordinator_refuses_a_protocol_it_does_not_speak_and_names_both() -> None:
    rv = Rendezvous(SETTINGS, FakeClock(), SPEC)
    newer = NodeInfo("b", "b.cluster", 2222, version="9.0.0", protocol=PROTOCOL + 1)
    with pytest.raises(ProtocolVersionError) as excinfo:
        rv.join(newer, SPEC)
    message = str(excinfo.value)
    assert f"node 'b' runs tfelastic 9.0.0 (protocol {PROTOCOL + 1})" in message
    assert f"this coordinator runs {describe()}" in message and "Upgrades" in message
    assert "b" not in {n.node_id for n in rv.status().nodes}


def test_an_agent_older_than_the_field_speaks_protocol_1() -> None:
    rv = Rendezvous(SETTINGS, FakeClock(), SPEC)
    rv.join(NodeInfo("a", "a.cluster", 2222), SPEC)  # protocol 0: said by no older agent, which spoke 1
    assert speaks(0) and speaks(PROTOCOL) and not speaks(PROTOCOL + 1)
    rv.join(NodeInfo("c", "c.cluster", 2222, version=VERSION, protocol=PROTOCOL), SPEC)
    assert {n.node_id: n.version for n in rv.status().nodes} == {"a": "", "c": VERSION}
