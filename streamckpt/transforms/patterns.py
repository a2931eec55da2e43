"""Name patterns of transform rules: ``{var}`` binds a run of digits, ``*`` a run within a component."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

_TOKEN = re.compile(r"\{([^{}]*)\}|\*")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class Pattern:
    """A name pattern: ``{var}`` binds a run of digits, ``*`` a run within one component."""

    text: str
    regex: re.Pattern[str] | None   # None: a literal name
    variables: tuple[str, ...]
    stars: int

    @classmethod
    def parse(cls, text: str) -> "Pattern":
        """Compile ``text``; ValueError for a bad placeholder or an unbalanced brace."""
        if not isinstance(text, str) or not text:
            raise ValueError(f"a name pattern must be a non-empty string, got {text!r}")
        parts: list[str] = []
        seen: list[str] = []
        stars = 0
        pos = 0
        for m in _TOKEN.finditer(text):
            parts.append(re.escape(text[pos:m.start()]))
            pos = m.end()
            if m.group(0) == "*":
                parts.append(f"(?P<_s{stars}>[^.]*)")
                stars += 1
                continue
            var = m.group(1)
            if not _IDENT.match(var):
                raise ValueError(f"bad placeholder {{{var}}} in {text!r} (use {{name}})")
            if var in seen:
                parts.append(f"(?P={var})")
            else:
                parts.append(f"(?P<{var}>[0-9]+)")
                seen.append(var)
        tail = text[pos:]
        if "{" in tail or "}" in tail:
            raise ValueError(f"unbalanced brace in pattern {text!r}")
        parts.append(re.escape(tail))
        if not seen and not stars:
            return cls(text, None, (), 0)
        return cls(text, re.compile("".join(parts)), tuple(seen), stars)

    def match(self, name: str) -> tuple[dict[str, str], list[str]] | None:
        """``(bindings, stars)`` when ``name`` matches the whole pattern, else None."""
        if self.regex is None:
            return ({}, []) if name == self.text else None
        m = self.regex.fullmatch(name)
        if m is None:
            return None
        groups = m.groupdict()
        return ({v: groups[v] for v in self.variables},
                [groups[f"_s{k}"] for k in range(self.stars)])

    def substitute(self, binds: Mapping[str, str], stars: Sequence[str]) -> str:
        """Fill placeholders from ``binds`` and the k-th ``*`` with the k-th captured star."""
        count = 0

        def repl(m: re.Match[str]) -> str:
            nonlocal count
            if m.group(0) == "*":
                if count >= len(stars):
                    raise ValueError(
                        f"pattern {self.text!r} has more '*' than the first 'from' pattern"
                    )
                count += 1
                return stars[count - 1]
            var = m.group(1)
            if var not in binds:
                raise ValueError(
                    f"placeholder {{{var}}} in {self.text!r} is not bound by the first 'from' pattern"
                )
            return binds[var]

        return _TOKEN.sub(repl, self.text)
