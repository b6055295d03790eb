"""The README stays a front door, and every relative link in README.md and docs/ leads somewhere that exists."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250

# [text](target) and ![alt](target); a target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~)")


def pages() -> list[Path]:
    return [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code (links there are examples, not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped (not hyphens), spaces to hyphens, -1/-2 for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.relative_to(REPO)}: {target} (no such file)")
        elif frag and dest.suffix == ".md" and frag.lower() not in anchors(dest):
            bad.append(f"{page.relative_to(REPO)}: {target} (no heading #{frag} in {dest.relative_to(REPO)})")
    return bad


def test_relative_links_resolve():
    bad = [b for page in pages() for b in broken_links(page)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_readme_is_a_front_door():
    n = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, (f"README.md has {n} lines, at most {README_MAX_LINES}: "
                                   "put the depth in a docs/ page and link to it")


def test_the_check_finds_what_it_should(tmp_path):
    """The checker itself: a missing file, a missing heading and a link in code are told apart."""
    (tmp_path / "other.md").write_text("# Other page\n\n## Some heading: here\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md) [ok](other.md#some-heading-here) [ok](#top) ![img](other.md)\n"
                    "[gone](missing.md) [no anchor](other.md#nowhere) [web](https://example.com/x.md)\n"
                    "`[code](not-a-link.md)`\n```\n[fenced](also-not.md)\n```\n# Top\n", encoding="utf-8")
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        bad = broken_links(page)
    finally:
        REPO = saved
    assert bad == ["page.md: missing.md (no such file)", "page.md: other.md#nowhere (no heading #nowhere in other.md)"]
