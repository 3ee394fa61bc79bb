"""Every relative link in the README, docs/, benchmarks/ and dev/ points to a file that exists (and a
`file.md#anchor` link to a heading of that file), and benchmarks/ holds harnesses and reports only."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(md: Path) -> set[str]:
    """GitHub-style anchors of a markdown file's headings (lower case, punctuation dropped, spaces → -)."""
    out = set()
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def broken_links(files: list[Path]) -> list[str]:
    bad = []
    for md in files:
        in_code = False
        for n, line in enumerate(md.read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_code = not in_code
            if in_code:
                continue
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (md.parent / path).resolve() if path else md
                if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
                    bad.append(f"{md.relative_to(ROOT)}:{n}: {target}")
    return bad


def test_anchor_rule():
    assert broken_links([]) == []


def test_every_relative_link_resolves():
    files = ([ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "benchmarks").rglob("*.md"))
             + sorted((ROOT / "dev").glob("*.md")))
    assert broken_links(files) == []


def test_a_missing_file_and_anchor_are_caught(tmp_path):
    (tmp_path / "b.md").write_text("# Real heading\n")
    (tmp_path / "a.md").write_text("[x](b.md#real-heading) [y](b.md#nope) [z](gone.md)\n```\n[w](skipped.md)\n```\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert broken_links([tmp_path / "a.md"]) == ["a.md:1: b.md#nope", "a.md:1: gone.md"]
    finally:
        ROOT = saved


def test_benchmarks_hold_no_lab_scripts():
    """Development tooling for remote GPU hosts lives in dev/, not beside the harnesses."""
    lab = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix == ".sh" or p.name.startswith("stage_"))
    assert lab == []
    assert (ROOT / "benchmarks" / "README.md").stat().st_size <= 15_000
