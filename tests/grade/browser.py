"""Headless Chromium (Debian's `chromium`, installed by `make test`): what a real browser makes of a
page opened from disk, as its DOM after parsing and as a screenshot."""

import pathlib
import shutil
import subprocess
import tempfile

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]


def chromium():
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "chromium is missing: `make test` installs it (make browser)"
    return found


def _run(page, *args):
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        done = subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}", *args,
                               pathlib.Path(page).resolve().as_uri()],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def dom(page):
    """The page's DOM as the browser built it (after parsing, with nothing fetched)."""
    return _run(page, "--dump-dom")


def screenshot(page, png, width=1200, height=2400):
    _run(page, f"--screenshot={png}", f"--window-size={width},{height}")
    return pathlib.Path(png)
