"""The docs site and the README's two layers: README stays short, the site builds with
``mkdocs build --strict`` (every nav page, every include, every link resolves), no
Markdown link of README or docs/ names a file that is not in the repo, and the
quickstart's loop (examples/quickstart.py) is the guide's code block as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_readme_is_at_most_10k_characters() -> None:
    """The README is the short layer: what it is, two commands, quickstart, links."""
    assert len((ROOT / "README.md").read_text()) <= 10_000


def test_every_relative_link_names_a_file_in_the_repo() -> None:
    """README, ARCHITECTURE and every docs page link only to files that exist."""
    pages = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").rglob("*.md"))]
    missing = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not missing, missing
    for page in pages:  # the design notes live outside the repository: never named
        assert "DESIGN.md" not in page.read_text(), page


def test_quickstart_script_is_the_guides_loop() -> None:
    """What the quickstart copies is exactly what the guide explains (and
    tests/test_readme_loop.py runs)."""
    guide = (ROOT / "docs" / "guides" / "training-loop.md").read_text()
    block = re.search(r"```python\n(.*?)```", guide, re.S)
    assert block is not None
    script = (ROOT / "examples" / "quickstart.py").read_text()
    assert script.endswith(block.group(1)), "examples/quickstart.py differs from the guide's block"


def test_docs_site_builds_strict(tmp_path: Path) -> None:
    """`mkdocs build --strict`: a warning (a missing page, include, link or API
    object) fails the build."""
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    quickstart = (tmp_path / "site" / "quickstart" / "index.html").read_text()
    assert "KILL_AT" in quickstart  # README's quickstart block, included
    assert "trainguard checkpoint format" in (tmp_path / "site" / "format" / "index.html").read_text()
    assert "TrainingSession" in (tmp_path / "site" / "reference" / "trainer_client" / "index.html").read_text()
