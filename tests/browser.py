"""A real headless browser for the tests (Debian's chromium-headless-shell, installed by tests/run.sh): a page's
DOM as the browser parsed it, and a screenshot with the colours it painted."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

BROWSER = shutil.which("chromium-headless-shell") or shutil.which("chromium")
# --no-sandbox: the tests run as root, where Chromium's sandbox refuses to start; the page is our own file.
FLAGS = ("--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run", "--disable-extensions")


def _run(*arguments: str, home: Path) -> str:
    assert BROWSER is not None, "chromium-headless-shell is not installed"
    result = subprocess.run([BROWSER, *FLAGS, f"--user-data-dir={home}", *arguments], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def dom(page: Path) -> str:
    """The page's DOM after the browser loaded it, serialised."""
    with tempfile.TemporaryDirectory() as home:
        return _run("--dump-dom", page.as_uri(), home=Path(home))


def screenshot(page: Path, png: Path, width: int = 1280, height: int = 1400) -> None:
    with tempfile.TemporaryDirectory() as home:
        _run(f"--screenshot={png}", f"--window-size={width},{height}", page.as_uri(), home=Path(home))


def png_size_and_colours(png: Path) -> tuple[tuple[int, int], dict[tuple[int, int, int], int]]:
    """A screenshot's size and how many pixels have each colour."""
    from PIL import Image

    with Image.open(png) as image:
        rgb = image.convert("RGB")
        return rgb.size, {(colour[0], colour[1], colour[2]): count  # type: ignore[index]
                          for count, colour in rgb.getcolors(maxcolors=1 << 24) or []}


def colours_within(png: Path, background: tuple[int, int, int]) -> dict[tuple[int, int, int], int]:
    """How many pixels have each colour inside the box of the pixels painted ``background`` (a drawing's own
    background: the screenshot's part where that drawing is)."""
    from PIL import Image, ImageChops

    with Image.open(png) as image:
        rgb = image.convert("RGB")
        mask = ImageChops.difference(rgb, Image.new("RGB", rgb.size, background)).convert("L").point(
            lambda value: 255 if value == 0 else 0)
        box = mask.getbbox()
        assert box is not None, f"no pixel of the background {background} in {png}"
        return {(c[0], c[1], c[2]): n  # type: ignore[index]
                for n, c in rgb.crop(box).getcolors(maxcolors=1 << 24) or []}
