"""Every relative link of README.md, CONTRIBUTING.md and docs/**/*.md resolves: the file exists, and a ``#anchor``
names a heading (GitHub's slug, duplicates numbered) or an ``<a id>`` of the page it points to.

Links inside fenced code blocks and inline code are not links; ``http(s)://`` and ``mailto:`` links are not checked
(no network here). Also: README.md stays at most 150 lines with the which-algorithm table in its first 80, its
Layout names every package, and the summary pages (docs/benchmarks.md, docs/algorithms/diloco.md) stay summaries.
"""

from __future__ import annotations

import glob
import os
import re
from functools import lru_cache

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted([os.path.join(ROOT, "README.md"), os.path.join(ROOT, "CONTRIBUTING.md")]
               + glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))

_FENCE = re.compile(r"^( {0,3})(```|~~~).*?^\1\2[^\n]*$", flags=re.S | re.M)
_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", flags=re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", flags=re.M)
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def slug(heading: str) -> str:
    """Return GitHub's anchor of a heading's text (markup dropped, lower case, punctuation gone, spaces to '-').

    >>> slug("DDP + fp16, decentralized SGD (2026-11-26, 3 seeds)")
    'ddp--fp16-decentralized-sgd-2026-11-26-3-seeds'
    >>> slug("The demo (`make demo`)")
    'the-demo-make-demo'
    """
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code."""
    return _CODE.sub("", _FENCE.sub("", text))


@lru_cache(maxsize=None)
def anchors(path: str) -> frozenset[str]:
    """Return every anchor of a Markdown page: its headings' slugs (repeats get -1, -2, ...) and its <a id>s."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    found, seen = set(_HTML_ANCHOR.findall(text)), {}
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return frozenset(found)


def broken_links(page: str) -> list[str]:
    """Return ``"target: why"`` for each relative link of ``page`` that does not resolve."""
    with open(page, encoding="utf-8") as f:
        text = _prose(f.read())
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(resolved):
            broken.append(f"{target}: no file {os.path.relpath(resolved, ROOT)}")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading or <a id> '{anchor}' in {os.path.relpath(resolved, ROOT)}")
    return broken


def test_the_checker_finds_what_is_broken(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## A (`b`) + c\n\n## A (`b`) + c\n")
    page.write_text("# Page\n\n[ok](other.md#a-b--c-1) [ok](#page) [bad](other.md#nope) [bad](gone.md)\n"
                    "`[code](gone.md)`\n\n```\n[fenced](gone.md)\n```\n[web](https://example.com/x)\n")
    assert broken_links(str(page)) == ["other.md#nope: no heading or <a id> 'nope' in "
                                       + os.path.relpath(str(tmp_path / "other.md"), ROOT),
                                       "gone.md: no file " + os.path.relpath(str(tmp_path / "gone.md"), ROOT)]


@pytest.mark.parametrize("page", [os.path.relpath(p, ROOT) for p in PAGES])
def test_every_relative_link_resolves(page):
    assert broken_links(os.path.join(ROOT, page)) == []


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_readme_is_short_with_the_picks_table_early():
    lines = _readme().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail to docs/ (at most 150)"
    table = next(i for i, line in enumerate(lines) if line.startswith("| link (the GPU setting"))
    assert table < 80, f"the which-algorithm table starts at line {table + 1}; keep it in the first 80"


def test_readme_layout_names_every_package():
    layout = _readme().split("## Layout", 1)[1].split("```")[1]
    packages = [os.path.dirname(p) for p in glob.glob(os.path.join(ROOT, "bagua", "*", "__init__.py"))
                + glob.glob(os.path.join(ROOT, "bagua", "torch_api", "*", "__init__.py"))
                + glob.glob(os.path.join(ROOT, "lightning_bagua", "__init__.py"))]
    folders = [os.path.join(ROOT, name) for name in ("benchmarks", "examples", "tools", "tests")]
    missing = [os.path.relpath(p, ROOT) for p in packages + folders if os.path.basename(p) + "/" not in layout]
    assert not missing, f"README.md's Layout does not name {missing}"


@pytest.mark.parametrize("page, most", [("docs/benchmarks.md", 200), ("docs/algorithms/diloco.md", 250)])
def test_summary_pages_stay_summaries(page, most):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        n = len(f.read().splitlines())
    assert n <= most, f"{page} has {n} lines (at most {most}): dated campaigns belong in docs/log/"
