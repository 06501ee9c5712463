"""MkDocs hooks of the documentation site (mkdocs.yml's `hooks:`): the README as its front page, and links to the
repository's files outside docs/ as plain code text.

The README stays the one copy of the front page's text. It is written for the repository's root (`docs/usage.md`,
`examples/train.py`), so it is served as a generated `index.md` with its links rewritten for docs/: `docs/X` becomes
`X` and any other relative target `../X`. A snippet include (pymdownx.snippets) would copy the text without that
rewrite, and its links would break.

The guides link to source files, examples and tests (`../src/trainaccel/...`), which are not pages of the site: MkDocs
would warn about each under `--strict`, and validation settings that quiet them would quiet truly broken links too.
Such a link becomes its path in code text (after its text where that differs), and one to a file that does not exist
still fails the strict build, so links between pages and their anchors stay checked by MkDocs itself.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

log = logging.getLogger(f"mkdocs.plugins.{__name__}")

# A Markdown inline link or image: [text](target) or ![alt](target "title"); the text holds no brackets.
LINK = re.compile(r"(?P<image>!?)\[(?P<text>[^\[\]]*)\]\((?P<target>[^()\s]+)(?P<title>\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
EXTERNAL = re.compile(r"^([a-z][a-z0-9+.-]*:|#|/)", re.IGNORECASE)


def _outside_lines(markdown: str):
    """Yield (line, inside_code_fence) for each line, so that code blocks are left as they are."""
    fence = None
    for line in markdown.splitlines(keepends=True):
        match = FENCE.match(line)
        if match and fence is None:
            fence = match.group(1)
            yield line, True
        elif match and match.group(1) == fence:
            fence = None
            yield line, True
        else:
            yield line, fence is not None


def _rewrite_links(markdown: str, rewrite) -> str:
    return "".join(line if fenced else LINK.sub(rewrite, line) for line, fenced in _outside_lines(markdown))


def readme_as_index(readme: str) -> str:
    """The README's Markdown with its links made relative to docs/ (see the module's docstring)."""

    def rewrite(match: re.Match) -> str:
        target = match["target"]
        if EXTERNAL.match(target):
            return match[0]
        target = target[len("docs/") :] if target.startswith("docs/") else "../" + target
        return f"{match['image']}[{match['text']}]({target}{match['title'] or ''})"

    return _rewrite_links(readme, rewrite)


def on_files(files: Files, config) -> Files:
    readme = Path(config["config_file_path"]).parent / "README.md"
    if files.get_file_from_path("index.md") is not None:
        log.warning("docs/index.md would hide the README as the front page: remove it, the README is the index")
        return files
    files.append(File.generated(config, "index.md", content=readme_as_index(readme.read_text(encoding="utf-8"))))
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    docs = Path(config["docs_dir"]).resolve()
    root = Path(config["config_file_path"]).parent.resolve()
    folder = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match) -> str:
        target = match["target"]
        if EXTERNAL.match(target):
            return match[0]
        path = (docs / folder / target.split("#")[0]).resolve()
        if path.is_relative_to(docs):
            return match[0]  # a page or a file of the site: MkDocs checks it
        if not path.is_relative_to(root) or not path.exists():
            log.warning(f"{page.file.src_uri} links to {target}, which is not in the repository")
            return match[0]
        shown = path.relative_to(root).as_posix()
        text = match["text"]
        if match["image"] or text.strip("`") == shown:
            return f"`{shown}`"
        return f"{text} (`{shown}`)"

    return _rewrite_links(markdown, rewrite)
