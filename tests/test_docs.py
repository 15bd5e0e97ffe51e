"""The docs stay true: the CLI reference matches --help, every relative link resolves, the README stays short."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_cli_reference_is_the_commands_own_help():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "cli_docs.py"), "--check"], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


def test_every_relative_link_in_the_readme_and_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_no_doc_or_comment_cites_a_file_the_repository_lacks():
    """The shared notes beside a checkout (FACTS.md, STYLE.md) are not in it: a reader of the code can't open them.
    Upstream files are named by repository and path instead (pipeline.trtllm.upstream)."""
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "pipeline").rglob("*.py"),
             *(ROOT / "scripts").rglob("*.py")]
    cited = re.compile(r"\b(FACTS|STYLE)\.md\b|\.\./shared/")
    citing = [str(f.relative_to(ROOT)) for f in files if cited.search(f.read_text())]
    assert not citing, citing


def test_the_readme_is_what_a_newcomer_needs_and_no_more():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 8 * 1024, len(text.encode())
    assert "pip install --no-compile -e '.[test]'" in text and "pytest" in text  # the test command CI runs
