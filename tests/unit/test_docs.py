"""The docs stand alone: no page or comment points outside the repository for a fact (docs/facts.md holds them),
and every relative link in the Markdown leads to a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEXT_FOLDERS = ("daemon", "trainer", "bench", "tests", "systemd", "monitoring", "docs", "examples", "proto", ".ci")
SUFFIXES = {".py", ".md", ".sh", ".toml", ".yml", ".yaml", ".service", ".proto", ".json", ""}
OUTSIDE = re.compile(r"\bFACTS\b|\.\./shared/")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def project_files() -> list[Path]:
    found = [ROOT / "README.md"]
    for folder in TEXT_FOLDERS:
        found += [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in SUFFIXES
                  and "__pycache__" not in p.parts and p.name != Path(__file__).name]
    return found


def test_nothing_points_outside_the_repository() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                 for path in project_files() for number, line in enumerate(_lines(path), 1) if OUTSIDE.search(line)]
    assert offenders == [], "\n".join(offenders)


@pytest.mark.parametrize("page", sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")]), ids=lambda p: p.name)
def test_every_relative_link_leads_somewhere(page: Path) -> None:
    broken = [target for target in LINK.findall(page.read_text())
              if "://" not in target and not target.startswith("mailto:") and not (page.parent / target).exists()]
    assert broken == [], f"{page.name}: {broken}"


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except UnicodeDecodeError:
        return []


def test_the_readme_lists_every_exit_code() -> None:
    from tfelastic.daemon.exit_codes import ExitCode

    table = {int(code) for code in re.findall(r"^\| (\d+) \|", (ROOT / "README.md").read_text(), re.MULTILINE)}
    assert table == {int(code) for code in ExitCode}


ISSUE_NUMBER = re.compile(r"\bissues? #?\d+", re.IGNORECASE)


def test_no_page_cites_an_internal_issue_number() -> None:
    """A user cannot look the project's internal issues up: a page says what changed and why instead."""
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    offenders = [f"{page.relative_to(ROOT)}:{number}: {line.strip()}" for page in pages
                 for number, line in enumerate(_lines(page), 1) if ISSUE_NUMBER.search(line)]
    assert offenders == [], "\n".join(offenders)


PROJECT_PATH = re.compile(r"(?<![\w./-])((?:daemon|trainer|tests|bench|systemd|monitoring|docs|examples|proto)/"
                          r"[\w/.-]*\w\.(?:py|md|sh|service|toml|yml|yaml|json|proto))\b")
# Made-up names that tests/unit/test_timings.py feeds its parser.
SYNTHETIC_PATHS = {"tests/integration/test_a.py", "tests/unit/test_b.py"}


def test_every_file_the_project_names_exists() -> None:
    """A docstring, comment or page that names a file of this repository names one that exists (a renamed or
    never-written module leaves a reader looking for it)."""
    offenders = [f"{path.relative_to(ROOT)}:{number}: {named}"
                 for path in project_files() for number, line in enumerate(_lines(path), 1)
                 for named in PROJECT_PATH.findall(line)
                 if named not in SYNTHETIC_PATHS and not (ROOT / named).exists()]
    assert offenders == [], "\n".join(offenders)
