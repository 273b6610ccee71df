"""The files of the repository's systemd/ and monitoring/ folders that the package must carry, named as
tfelastic.daemon.assets.packaged names them (tests/unit/test_assets.py, tests/test_packaging.py)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def shipped_files() -> list[str]:
    """Every file under systemd/ and monitoring/ but the Python that makes them packages."""
    names = []
    for folder in ("systemd", "monitoring"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.name != "__init__.py" and "__pycache__" not in path.parts:
                names.append(path.relative_to(ROOT).as_posix())
    return names
