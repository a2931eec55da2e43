"""README.md and every guide under docs/ run as written, each page in order.

The pages: README.md and each ``docs/*.md`` that carries at least one of the marks below (a
*guide*); a page without marks is a reference page (FORMAT, API, RELIABILITY, SCALE, ...) and
is not run, its code blocks being signatures and examples of formats. Every ```python and
```bash block of a page is run in a fresh process, in page order, against the page's own fresh
local S3 server (moto, started from the page's background block; a page without one needs
none), from a scratch directory where ``examples/`` and
``.venv`` (this interpreter's environment) are what a clone has; any non-zero exit fails
with the block's line number and its output. Python blocks run as a script with
``python``, shell blocks with ``bash -e -o pipefail``, with the environment's ``bin`` on
``PATH``, the checkout on ``PYTHONPATH`` and no ``AWS_*`` variables (each block names its
own storage options). The page's port, 9000, becomes a free one.

HTML comments right above a block (invisible on the rendered page) say how it runs:

* ``<!-- background: why -->`` — started in the background before the blocks after it
  (the S3 server the page tells readers to start in another shell); its first output
  line must appear within a minute;
* ``<!-- prints: TEXT -->`` — its output must contain TEXT;
* ``<!-- pytest: why -->`` — the block is a test file: run with ``python -m pytest``;
* ``<!-- slow: why -->`` — run only by the slow test (``-m slow``), which runs the whole page;
* ``<!-- not-run: why -->`` — not run here; the set of such blocks is pinned below.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import pytest

from streamckpt.testing.s3server import free_port

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
# The guides the harness runs, pinned: a guide that loses its marks would silently stop running.
GUIDES = {"quickstart.md", "resharding.md", "manager.md", "resuming-from-peers.md", "plugins.md",
          "huggingface.md", "cli.md", "testing-your-code.md", "running-benchmarks.md"}
PAGE_PORT = "9000"
KINDS = ("background", "prints", "pytest", "slow", "not-run")
RUN_LANGS = {"python": "python", "bash": "bash", "shell": "bash", "sh": "bash", "console": "bash"}

# The blocks that genuinely cannot run here, by their first line: each needs what a test
# must not do (set up a virtualenv, run the whole suite or a long benchmark).
NOT_RUN = {
    "pip install .                        # or: make wheel, then pip install dist/streamckpt-*.whl",
    "make demo   # sets up .venv, starts an embedded S3 server, saves, reshards, verifies, prints stats",
    "python3 -m venv .venv-bench && .venv-bench/bin/pip install torch==2.13.0",
    ".venv-bench/bin/python -m benchmarks.run --scenario s --size 256MiB --reps 3 --out save.md",
    ".venv-bench/bin/python -m benchmarks.run --scenario g --size 256MiB --reps 3 --out capped.md",
}


_MARK = re.compile(r"^\s*<!--\s*(" + "|".join(KINDS) + r")\s*:", re.M)


def pages() -> list[Path]:
    """README.md, then the guides: the docs/*.md pages with at least one mark (see above)."""
    return [README] + sorted(p for p in DOCS.glob("*.md") if _MARK.search(p.read_text(encoding="utf-8")))


def name(page: Path) -> str:
    return str(page.relative_to(REPO))


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str  # python | bash
    text: str
    marks: dict[str, str]  # kind -> its text, from the comments right above the fence

    @property
    def first(self) -> str:
        return self.text.splitlines()[0] if self.text else ""


def blocks(page: Path = README) -> list[Block]:
    """The runnable (python / shell) fenced blocks of ``page``, in order, with their marks."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1).lower()
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if lang in RUN_LANGS:
            text = "\n".join(lines[i + 1:j]) + "\n"
            out.append(Block(page, start + 1, RUN_LANGS[lang], text, _marks(lines, start, page)))
        i = j + 1
    return out


_OUTPUT_LIKE = re.compile(r"^(\[|\d|s3://)")  # a comment part that shows output, not prose


def printed(block: Block) -> list[str]:
    """What the block's ``print(...)  # comment`` lines say they print: the first part of the
    comment (split at ": ") that looks like output (a list, a number, a URI), or, for a comment
    ending in ":", the comment line below it. A reader compares these with what the block
    prints, so the harness does too."""
    if block.lang != "python":
        return []
    lines = block.text.splitlines()
    out: list[str] = []
    for i, line in enumerate(lines):
        m = re.match(r"^print\(.*\)\s+#\s*(.*)$", line)
        if not m:
            continue
        comment = m.group(1).strip()
        if comment.endswith(":") and i + 1 < len(lines) and lines[i + 1].lstrip().startswith("#"):
            comment = lines[i + 1].lstrip().lstrip("#").strip()
        found = [part for part in comment.split(": ") if _OUTPUT_LIKE.match(part)]
        if found:
            out.append(found[0])
    return out


def _marks(lines: list[str], fence: int, page: Path = README) -> dict[str, str]:
    """``<!-- kind: text -->`` comments on the lines right above ``fence`` (blank lines between allowed)."""
    marks: dict[str, str] = {}
    k = fence - 1
    while k >= 0 and (not lines[k].strip() or lines[k].lstrip().startswith("<!--")):
        m = re.fullmatch(r"\s*<!--\s*([\w-]+)\s*:\s*(.*?)\s*-->\s*", lines[k])
        if m:
            assert m.group(1) in KINDS, f"{page.name}:{k + 1}: unknown mark {m.group(1)!r} (known: {KINDS})"
            marks[m.group(1)] = m.group(2)
        k -= 1
    return marks


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _command(block: Block, path: Path) -> list[str]:
    if block.lang == "bash":
        return ["bash", "-e", "-o", "pipefail", str(path)]
    if "pytest" in block.marks:
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)]  # the plugin: its entry point
    return [sys.executable, str(path)]


def _script(block: Block, port: int, workdir: Path) -> Path:
    text = re.sub(rf"\b{PAGE_PORT}\b", str(port), block.text)
    stem = block.page.stem.lower().replace("-", "_")
    name = f"test_{stem}_line{block.line}.py" if "pytest" in block.marks else f"{stem}_line{block.line}"
    path = workdir / "blocks" / (name if name.endswith(".py") else name + (".py" if block.lang == "python" else ".sh"))
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""


@dataclass
class Outcome:
    block: Block
    seconds: float
    rc: int
    output: str

    def report(self) -> str:
        return (f"{name(self.block.page)}:{self.block.line} ({self.block.lang}, {self.seconds:.1f} s) "
                f"exited {self.rc}:\n{self.block.text}\n--- output (tail) ---\n{self.output[-6000:]}")


def run_block(block: Block, port: int, workdir: Path, timeout: float = 300) -> Outcome:
    path = _script(block, port, workdir)
    t0 = time.monotonic()
    try:
        p = subprocess.run(_command(block, path), cwd=workdir, env=_env(), capture_output=True, text=True,
                           timeout=timeout)
        rc, output = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        rc, output = -999, f"timed out after {timeout} s\n{_text(exc.stdout)}{_text(exc.stderr)}"
    out = Outcome(block, time.monotonic() - t0, rc, output)
    if rc == 0 and "prints" in block.marks and block.marks["prints"] not in output:
        out.rc, out.output = -998, f"expected {block.marks['prints']!r} in the output\n{output}"
    elif rc == 0 and (absent := [p for p in printed(block) if p not in output]):
        out.rc, out.output = -997, f"its comments say it prints {absent!r}, not in the output\n{output}"
    return out


@contextmanager
def page_server(todo: list[Block], workdir: Path) -> Iterator[int]:
    """The page's own background block (the local S3 server), started on a free port; a page
    without one gets a free port that nothing listens on."""
    background = [b for b in todo if "background" in b.marks]
    assert len(background) <= 1, [b.line for b in background]
    port = free_port()
    if not background:
        yield port
        return
    block = background[0]
    path = _script(block, port, workdir)
    proc = subprocess.Popen(_command(block, path), cwd=workdir, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        seen = _wait_for_line(proc, f"endpoint_url=http://127.0.0.1:{port} ", timeout=60)
        assert seen is None, f"{name(block.page)}:{block.line}: the server did not start (exit {proc.poll()}):\n{seen}"
        yield port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_for_line(proc: subprocess.Popen, start: str, timeout: float) -> str | None:
    """None once ``proc`` prints a line starting with ``start``; else what it printed."""
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=min(left, 1.0))
        except queue.Empty:
            if proc.poll() is not None and lines.empty():
                break
            continue
        if line.startswith(start):
            return None
        seen.append(line)
    return "".join(seen) or f"(nothing within {timeout} s)"


def _run_in_order(page: Path, skip: set[str], workdir: Path) -> list[Outcome]:
    """Every block of ``page`` not marked with a kind in ``skip``, in order, on the page's server."""
    every = blocks(page)
    todo = [b for b in every if not ({"not-run", "background"} | skip) & set(b.marks)]
    done: list[Outcome] = []
    timings = ""
    with page_server(every, workdir) as port:
        for block in todo:
            out = run_block(block, port, workdir)
            done.append(out)
            timings = ", ".join(f"{o.block.line}: {o.seconds:.1f}s" for o in done)
            assert out.rc == 0, f"{out.report()}\n(blocks run, line: seconds: {timings})"
    print(f"{name(page)}: blocks run in {sum(o.seconds for o in done):.1f} s (line: seconds): {timings}")
    return done


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A scratch directory laid out like a clone where ``make`` has run: examples/ and .venv."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    return tmp_path


def test_the_guides_are_the_pages_with_marks() -> None:
    """A docs page is run when it carries a mark; the set is pinned, so a guide that loses its
    marks (or a new one) is noticed. Reference pages carry none (FORMAT, API, RELIABILITY, ...)."""
    found = {p.name for p in pages()[1:]}
    assert found == GUIDES, found
    for ref in ("API.md", "FORMAT.md", "RELIABILITY.md", "SCALE.md", "PLANNER.md"):
        assert ref not in found


def test_every_block_is_run_or_skipped_with_a_reason() -> None:
    every = [b for p in pages() for b in blocks(p)]
    assert len(every) >= 30
    skipped = {b.first: b.marks["not-run"] for b in every if "not-run" in b.marks}
    assert set(skipped) == NOT_RUN
    assert all(len(why) > 15 for why in skipped.values()), skipped
    for p in pages():
        page = blocks(p)
        for b in page:
            assert len({"not-run", "background", "slow"} & set(b.marks)) <= 1, f"{name(p)}:{b.line}: {b.marks}"
        assert sum("slow" in b.marks for b in page) <= 2, name(p)
        assert sum("background" in b.marks for b in page) <= 1, name(p)


def test_the_output_comments_are_found() -> None:
    """``printed`` reads the comments a reader checks the output against (run_block then
    requires each in the output); prose comments such as "# newest *committed* checkpoint" are not."""
    found = {name(p): sorted(x for b in blocks(p) for x in printed(b)) for p in pages()}
    assert {k: v for k, v in found.items() if v} == {
        "README.md": ["2097152 2097152 1", "[200, 300] 263168"],
        "docs/quickstart.md": ["2097152 2097152 1", "s3://bucket/async/step-00001000"],
        "docs/plugins.md": ["s3://bucket/lightning/ckpts/epoch=1-step=8.ckpt"],
        "docs/manager.md": ["[0, 500, 600, 700]", "[0, 500, 900, 1000]"],
        "docs/resharding.md": ["94976 94976"],
        "docs/huggingface.md": ["['model.bias', 'model.weight', 'optim.state.0.step', 'optim.state.1.step']"],
    }, found
    md = Block(README, 1, "python", "print(x)  # 3 4: both\nprint(y)  # prose only\nprint(z)  # see:\n# [1, 2]\n", {})
    assert printed(md) == ["3 4", "[1, 2]"]


def test_each_page_says_to_activate_the_venv_before_its_bare_commands() -> None:
    """The harness puts the environment's ``bin`` on PATH; a reader's shell has no ``streamckpt``
    or ``torchrun`` until ``.venv`` is active, so each page says so before the first block that
    calls one bare."""
    bare = re.compile(r"^\s*(streamckpt|torchrun|python)\b", re.M)
    for p in pages():
        lines = [b.line for b in blocks(p) if bare.search(b.text) and "not-run" not in b.marks]
        if lines:
            before = "\n".join(p.read_text(encoding="utf-8").splitlines()[:min(lines)])
            assert "`. .venv/bin/activate`" in before, f"{name(p)}:{min(lines)} calls a command the reader's shell lacks"


def test_the_local_server_block_makes_two_buckets_and_the_page_says_so() -> None:
    """The front page's server makes more than one bucket, and its block 5 uses the second."""
    text = README.read_text(encoding="utf-8")
    server = [b for b in blocks() if "background" in b.marks][0]
    assert "--bucket bucket --bucket models" in server.text
    assert "`--bucket a --bucket b` makes both" in text


def test_the_harness_parses_marks_and_reports_a_failing_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "from-the-caller")  # never reaches a block
    md = tmp_path / "page.md"
    md.write_text("# t\n\n<!-- prints: port 9000 -->\n```python\nimport os\n"
                  "print('port 9000', os.environ.get('AWS_ACCESS_KEY_ID'))\n```\n\n"
                  "```text\nnot code\n```\n<!-- not-run: a reason -->\n\n```bash\necho hi\n"
                  "false\necho unreachable\n```\n")
    first, second = blocks(md)
    assert (first.line, first.lang, first.marks) == (4, "python", {"prints": "port 9000"})
    assert (second.line, second.lang, second.marks, second.first) == (14, "bash", {"not-run": "a reason"}, "echo hi")
    (tmp_path / "work").mkdir()
    ok = run_block(first, 4321, tmp_path / "work")  # the page's port becomes the server's
    assert (ok.rc, ok.output) == (-998, "expected 'port 9000' in the output\nport 4321 None\n")
    bad = run_block(replace(second, page=README), 4321, tmp_path / "work")
    assert (bad.rc, bad.output) == (1, "hi\n")  # bash -e: the first failing command ends the block
    assert bad.report().startswith("README.md:14 (bash, ")


@pytest.mark.parametrize("page", pages(), ids=name)
def test_page_runs_in_order(page: Path, workdir: Path) -> None:
    done = _run_in_order(page, {"slow"}, workdir)
    assert [o.rc for o in done] == [0] * len(done)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", [p for p in pages() if any("slow" in b.marks for b in blocks(p))], ids=name)
def test_page_runs_in_order_with_its_slow_blocks(page: Path, workdir: Path) -> None:
    """The whole page in order: the blocks above and the slow ones (process groups: load-bench
    and the demo, the torchrun pair where 4 processes save and 2 resume)."""
    done = _run_in_order(page, set(), workdir)
    for o in done:
        if "torchrun" in o.block.text:
            assert "slow" in o.block.marks
            assert "resumed from s3://bucket/resume/step-000006 at step 6" in o.output
