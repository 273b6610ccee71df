"""tfelastic.daemon.assets: the unit, the example job file, the install script and the monitoring assets are
found through the package, byte for byte the repository's files."""

from __future__ import annotations

import pytest
from tfelastic.daemon.assets import packaged

from tests.packaged_files import ROOT, shipped_files


def test_every_file_of_systemd_and_monitoring_is_found_through_the_package() -> None:
    names = shipped_files()
    assert {"systemd/tfelastic@.service", "systemd/example.toml", "systemd/install.sh",
            "monitoring/alerts.yml", "monitoring/grafana-dashboard.json",
            "monitoring/targets/tfelastic-agents.json"} <= set(names)
    for name in names:
        assert packaged(name).read_bytes() == (ROOT / name).read_bytes(), name


def test_a_name_outside_the_packaged_folders_is_refused_with_the_expected_form() -> None:
    for bad in ("docs/operations.md", "systemd", "systemd/", "/etc/passwd"):
        with pytest.raises(ValueError, match="expected systemd/NAME or monitoring/NAME"):
            packaged(bad)


def test_a_missing_file_names_itself_and_the_fix() -> None:
    with pytest.raises(FileNotFoundError, match=r"systemd/absent\.conf is not in this installation.*package-data"):
        packaged("systemd/absent.conf")
