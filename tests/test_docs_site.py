"""The documentation site: `mkdocs build --strict` passes (links, anchors, the API reference), and its front page and
API reference render in a headless Chromium."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
# The names tools/install-test-servers looks for; it installs Debian's chromium-headless-shell.
BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


class _Text(HTMLParser):
    """A page's text: the H1 headings' texts, and each heading's text and section (up to the next heading) by id."""

    def __init__(self):
        super().__init__()
        self.h1: list[str] = []
        self.headings: dict[str, str] = {}
        self._sections: dict[str, list[str]] = {}
        self._heading: tuple[str, str | None, list[str]] | None = None
        self._section: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self._skip += 1
        elif re.fullmatch(r"h[1-6]", tag):
            self._heading = (tag, dict(attrs).get("id"), [])

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self._skip -= 1
        elif self._heading and tag == self._heading[0]:
            name, id_, words = self._heading
            text = " ".join("".join(words).split()).rstrip("¶").strip()
            if name == "h1":
                self.h1.append(text)
            if id_:
                self.headings[id_] = text
                self._section = self._sections.setdefault(id_, [])
            self._heading = None

    def handle_data(self, data):
        if self._skip:
            return
        (self._heading[2] if self._heading else self._section).append(data)

    def section(self, id_: str) -> str:
        return " ".join(" ".join(self._sections.get(id_, [])).split())


def parsed(dom: str) -> _Text:
    page = _Text()
    page.feed(dom)
    return page


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once as CI builds it: strictly, so that any warning fails."""
    out = tmp_path_factory.mktemp("site")
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    # NO_MKDOCS_2_WARNING: the theme's banner about MkDocs' future, which would bury the build's own messages.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        pytest.fail(f"mkdocs build --strict failed (exit {result.returncode}):\n{result.stderr}{result.stdout}")
    return out


@pytest.fixture(scope="module")
def browser() -> str:
    found = next(filter(None, map(shutil.which, BROWSERS)), None)
    if found is None:
        pytest.skip("no headless Chromium: sh tools/install-test-servers installs it (Debian: chromium-headless-shell)")
    return found


def render(browser: str, page: Path, scratch: Path) -> tuple[str, Path]:
    """The page's DOM after its scripts ran, and a screenshot of it (a PNG file)."""
    scratch.mkdir()
    screenshot = scratch / "page.png"
    command = [
        browser,
        "--headless",
        "--no-sandbox",  # as root, in a container: Chromium's sandbox needs user namespaces it may not have
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={scratch / 'profile'}",
        "--window-size=1280,1600",
        "--virtual-time-budget=3000",  # let the theme's scripts run before the DOM and the screenshot are taken
        f"--screenshot={screenshot}",
        "--dump-dom",
        page.as_uri(),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "</html>" in result.stdout, f"{browser} on {page}: {result.stderr[-3000:]}"
    return result.stdout, screenshot


def assert_screenshot(screenshot: Path) -> None:
    assert screenshot.is_file(), "no screenshot written"
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "the screenshot is not a PNG"
    # A blank 1280x1600 page compresses to a few KB; these pages, with text and navigation, to about 290 KB.
    assert screenshot.stat().st_size > 50_000, f"the screenshot is {screenshot.stat().st_size} bytes: a blank page?"


def nav_pages(nav) -> list[str]:
    """The Markdown files of mkdocs.yml's nav, sections flattened."""
    entries = nav.values() if isinstance(nav, dict) else nav
    return [page for entry in entries for page in ([entry] if isinstance(entry, str) else nav_pages(entry))]


@pytest.mark.multiprocess
def test_the_site_builds_strictly_with_a_page_for_each_nav_entry(site):
    pages = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert "index.md" in pages and "api/index.md" in pages
    for page in pages:
        built = site / (page[: -len("index.md")] if page.endswith("index.md") else page[: -len(".md")] + "/")
        assert (built / "index.html").is_file(), f"{page} was not built"


@pytest.mark.multiprocess
def test_the_front_page_is_the_readme(site, browser, tmp_path):
    dom, screenshot = render(browser, site / "index.html", tmp_path / "front")
    assert_screenshot(screenshot)
    assert re.search(r"<title>trainaccel</title>", dom), "the front page's title"
    page = parsed(dom)
    first_heading = next(
        line[2:].strip() for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("# ")
    )
    assert first_heading in page.h1, f"the README's first heading {first_heading!r}, among {page.h1}"
    # A link of the README rewritten for the site (docs/options.md -> options/), and its plot shown.
    assert 'href="options/"' in dom
    assert re.search(r'<img [^>]*src="results/[\w.-]+\.png"', dom), "the README's plot"


@pytest.mark.multiprocess
def test_the_api_reference_renders_init_and_its_options(site, browser, tmp_path):
    dom, screenshot = render(browser, site / "api" / "index.html", tmp_path / "api")
    assert_screenshot(screenshot)
    assert re.search(r"<title>API reference - trainaccel</title>", dom), "the API page's title"
    page = parsed(dom)
    assert page.headings.get("trainaccel.init") == "init", "the heading of trainaccel.init"
    # These come from init()'s signature and its Args section, which mirror Config: every option is a keyword of
    # init(), shown in its signature and its parameter table.
    init = page.section("trainaccel.init")
    for option in ("sync_every", "compression", "on_lost_replica"):
        assert len(re.findall(rf"\b{option}\b", init)) >= 2, f"init's option {option}, in its signature and its table"
    for name in ("shutdown", "Config", "ConfigError"):
        assert f"trainaccel.{name}" in page.headings, f"the top-level name {name}"


def test_the_data_page_lists_every_name_of_trainaccel_data():
    """trainaccel.data's __all__ is computed (its names are imported lazily), so docs/api/data.md lists them one by one:
    each under the module that defines it."""
    import trainaccel.data

    page = (ROOT / "docs" / "api" / "data.md").read_text()
    listed = {name: module for module, name in re.findall(r"^::: trainaccel\.data\.(\w+)\.(\w+)$", page, re.M)}
    assert sorted(listed) == sorted(trainaccel.data.__all__)
    for name, module in listed.items():
        assert getattr(trainaccel.data, name).__module__ == f"trainaccel.data.{module}", name
