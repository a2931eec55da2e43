"""``benchmarks.run --update``: put a partial run's sections into an existing BENCHMARKS.md.

A full run takes about 18 minutes on this machine; adding or refreshing one scenario
should not need it. The new report's sections of the rerun scenarios (``## (x) ...``,
with their ``###`` parts, and ``## Profile of ... in (x) ...``) replace the old ones in
place, or, for a scenario the old report lacks, go after the last old section of their
kind; an old one the rerun did not write again (a profile it did not take) goes. Every
other section stays as it was (the Targets sections too: they are not recomputed from the
old figures); the header's command block gains the new command, and new notes are added
to the old Notes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SCENARIO = re.compile(r"^## \(([a-z])[0-9]*\)")
_PROFILE = re.compile(r"^## Profile of .* in \(([a-z])[0-9]*\)")
NOTES = "## Notes"


@dataclass
class Section:
    heading: str  # the "## ..." line; "" for the text before the first heading
    text: str  # the whole section, heading line included

    @property
    def kind(self) -> str | None:
        if _SCENARIO.match(self.heading):
            return "scenario"
        if _PROFILE.match(self.heading):
            return "profile"
        return None

    @property
    def scenario(self) -> str | None:
        m = _SCENARIO.match(self.heading) or _PROFILE.match(self.heading)
        return m.group(1) if m else None


def split(text: str) -> list[Section]:
    """The preamble, then one Section per ``## `` heading (``###`` stays inside its section)."""
    out: list[Section] = []
    lines = text.splitlines(keepends=True)
    start = 0
    for i, line in enumerate(lines):
        if line.startswith("## ") and i > 0:
            out.append(Section(_heading(lines[start]), "".join(lines[start:i])))
            start = i
    out.append(Section(_heading(lines[start]) if lines else "", "".join(lines[start:])))
    return out


def _heading(line: str) -> str:
    return line.rstrip("\n") if line.startswith("## ") else ""


def add_command(preamble: str, command: str) -> str:
    """The header's first code block with ``command`` as its last line (once)."""
    lines = preamble.splitlines(keepends=True)
    try:
        open_at = next(i for i, ln in enumerate(lines) if ln.strip() == "```")
        close_at = next(i for i in range(open_at + 1, len(lines)) if lines[i].strip() == "```")
    except StopIteration:
        return preamble
    if any(ln.strip() == command for ln in lines[open_at + 1:close_at]):
        return preamble
    return "".join(lines[:close_at] + [command + "\n"] + lines[close_at:])


def _merge_notes(old: Section, new: Section) -> Section:
    have = set(old.text.splitlines())
    extra = [ln for ln in new.text.splitlines()[1:] if ln.startswith("- ") and ln not in have]
    if not extra:
        return old
    body = old.text.rstrip("\n") + "\n" + "\n".join(extra) + "\n\n"
    return Section(old.heading, body)


def replace_sections(old: str, new: str, scenarios: str, command: str) -> str:
    """``old`` with the sections of ``scenarios`` taken from ``new`` (see the module doc)."""
    olds, news = split(old), split(new)
    fresh = [s for s in news if s.scenario is not None and s.scenario in scenarios]
    notes = next((s for s in news if s.heading == NOTES), None)
    out: list[Section] = []
    placed: set[int] = set()
    for sec in olds:
        if sec.scenario is not None and sec.scenario in scenarios:
            for i, s in enumerate(fresh):  # the new ones of this scenario and kind, in place of the first old one
                if i not in placed and s.scenario == sec.scenario and s.kind == sec.kind:
                    out.append(s)
                    placed.add(i)
            continue
        if sec.heading == NOTES and notes is not None:
            sec = _merge_notes(sec, notes)
        out.append(sec)
    for i, s in enumerate(fresh):
        if i in placed:
            continue
        at = max((j for j, o in enumerate(out) if o.kind == s.kind), default=None)
        if at is None:
            at = max((j for j, o in enumerate(out) if o.kind is not None), default=len(out) - 1)
        out.insert(at + 1, s)
    if notes is not None and not any(s.heading == NOTES for s in out):
        out.append(notes)
    if out and not out[0].heading:
        out[0] = Section("", add_command(out[0].text, command))
    return "".join(_ended(s.text) for s in out).rstrip("\n") + "\n"


def _ended(text: str) -> str:
    """A section ending in one blank line, so that the next heading starts a paragraph."""
    return text.rstrip("\n") + "\n\n" if text.strip() else text
