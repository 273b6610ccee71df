"""The files that ship inside the package besides code: the systemd unit, the example job file and the
install script (the repository's systemd/, installed as tfelastic.share.systemd), and the Prometheus rules,
scrape configurations and Grafana dashboard (monitoring/, installed as tfelastic.share.monitoring).

pyproject.toml maps those folders into the package, so a checkout's editable install and an installed wheel
answer the same names with the same bytes; the repository's folders are the only copy.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

FOLDERS = {"systemd": "tfelastic.share.systemd", "monitoring": "tfelastic.share.monitoring"}


def packaged(relative: str) -> Path:
    """The installed file for `relative`, named as in the repository: 'systemd/example.toml',
    'monitoring/alerts.yml', 'monitoring/targets/tfelastic-agents.json'."""
    folder, _, rest = relative.partition("/")
    if folder not in FOLDERS or not rest:
        raise ValueError(f"{relative!r} names no packaged file: expected systemd/NAME or monitoring/NAME")
    # pip installs packages unpacked, so the resource is a real file (never inside a zip).
    path = Path(str(files(FOLDERS[folder]).joinpath(*rest.split("/"))))
    if not path.is_file():
        raise FileNotFoundError(f"{relative} is not in this installation of tfelastic ({path}): "
                                "reinstall tfelastic, or add the file to package-data in pyproject.toml")
    return path
