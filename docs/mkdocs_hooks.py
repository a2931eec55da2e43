"""mkdocs hooks: the site's pages are README.md (its index), docs/*.md, and the root's benchmark
pages; links stay written for GitHub (relative to each file in the repository) and are rewritten
here for the site's flat layout, so one set of links works in both places."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
# Repository files outside docs/ that the site carries, by their path in the repository -> in the site.
FROM_ROOT = {"README.md": "index.md", "BENCHMARKS.md": "BENCHMARKS.md", "BENCHMARKS-1GiB.md": "BENCHMARKS-1GiB.md",
             "examples/train_resume.py": "examples/train_resume.py"}
_LINK = re.compile(r"\]\((?!https?:|#|mailto:)([^)\s]+)\)")


def on_files(files: Files, config: Any) -> Files:
    """Add the root's pages (README.md as index.md) to docs/'s."""
    for src, dest in FROM_ROOT.items():
        files.append(File.generated(config, dest, abs_src_path=str(ROOT / src)))
    return files


def site_link(target: str, page_in_repo: str) -> str:
    """``target`` as written in the repository file ``page_in_repo``, as the site needs it."""
    path, sep, anchor = target.partition("#")
    repo_path = (Path(page_in_repo).parent / path).as_posix() if path else ""
    parts: list[str] = []
    for part in repo_path.split("/"):
        if part == "..":
            parts.pop() if parts else parts.append("..")
        elif part not in ("", "."):
            parts.append(part)
    normal = "/".join(parts)
    if not path:
        return target
    if normal in FROM_ROOT:
        site = FROM_ROOT[normal]
    elif normal.startswith("docs/"):
        site = normal[len("docs/"):]
    else:
        site = normal  # outside the site: mkdocs --strict reports it
    here = FROM_ROOT.get(page_in_repo, page_in_repo[len("docs/"):] if page_in_repo.startswith("docs/") else page_in_repo)
    depth = here.count("/")
    return "../" * depth + site + sep + anchor


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Rewrite the page's relative links from the repository's layout to the site's."""
    abs_src = Path(page.file.abs_src_path).resolve()
    in_repo = abs_src.relative_to(ROOT).as_posix()
    return _LINK.sub(lambda m: f"]({site_link(m.group(1), in_repo)})", markdown)
