"""Local files: positional reads straight into the caller's buffer, parts written at their
offsets into a temporary file that is renamed into place on commit."""

from __future__ import annotations

import errno
import os
import posixpath
import random
import shutil
from typing import Any, Sequence

from .backend import (Backend, BackendError, Fetched, NotFound, ObjectInfo, PartSink, Permanent, TooLarge,
                      Transient, WorkerThreads)


def translate(e: OSError, path: str) -> BackendError:
    """An OS error as a failure kind: missing is NotFound, permissions and the like are
    Permanent, anything else (I/O errors on network mounts) may pass."""
    if isinstance(e, (FileNotFoundError, NotADirectoryError)):
        return NotFound(f"{path}: no such file")
    if isinstance(e, (PermissionError, IsADirectoryError)) or e.errno in (errno.EACCES, errno.EROFS, errno.ENOSPC):
        return Permanent(f"{type(e).__name__}: {e}")
    return Transient(f"{type(e).__name__}: {e}")


class LocalBackend(Backend):
    name = "local"

    def __init__(self, max_concurrency: int) -> None:
        self.threads = WorkerThreads(min(max_concurrency, 16), "streamckpt-io")

    async def _run(self, path: str, fn: Any, *args: Any) -> Any:
        try:
            return await self.threads.run(fn, *args)
        except OSError as e:
            raise translate(e, path) from None

    async def fetch(self, path: str, start: int, buf: memoryview, *, want_meta: bool = False) -> Fetched:
        return await self._run(path, _pread, path, start, [buf])

    async def fetch_parts(self, path: str, start: int, bufs: Sequence[memoryview], *,
                          want_meta: bool = False) -> Fetched:
        return await self._run(path, _pread, path, start, list(bufs))

    async def head(self, path: str) -> ObjectInfo:
        st = await self._run(path, os.stat, path)
        if not os.path.isfile(path):
            raise NotFound(f"{path}: not a file")
        return ObjectInfo(size=st.st_size, modified=st.st_mtime)

    async def exists(self, path: str) -> bool:
        return os.path.exists(path)

    async def listing(self, path: str, recursive: bool) -> list[str]:
        return await self._run(path, _listing, path, recursive)

    async def listing_info(self, path: str) -> list[tuple[str, ObjectInfo]]:
        return await self._run(path, _listing_info, path)

    async def get_whole(self, path: str, max_bytes: int | None) -> tuple[bytes, str | None]:
        return await self._run(path, _read_whole, path, max_bytes), None

    async def delete(self, path: str, recursive: bool) -> None:
        await self._run(path, _delete, path, recursive)

    async def remove_empty_dirs(self, path: str) -> None:
        await self._run(path, _remove_empty_dirs, path)

    async def makedirs(self, path: str) -> None:
        await self._run(path, os.makedirs, path, 0o777, True)

    def sink(self, path: str) -> PartSink:
        return LocalSink(self, path)

    def close(self) -> None:
        self.threads.close()


def _pread(path: str, start: int, bufs: list[memoryview]) -> Fetched:
    """Positional reads straight into consecutive ``bufs`` (one ``preadv`` fills them all)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        total = sum(len(b) for b in bufs)
        got = 0
        while got < total:
            n = os.preadv(fd, _rest(bufs, got), start + got)
            if not n:
                return Fetched(got=got, size=os.fstat(fd).st_size)
            got += n
        return Fetched(got=got)
    finally:
        os.close(fd)


def _rest(bufs: list[memoryview], done: int) -> list[memoryview]:
    """The buffers' bytes after the first ``done``."""
    if not done:
        return bufs
    out = []
    for b in bufs:
        if done >= len(b):
            done -= len(b)
            continue
        out.append(b[done:])
        done = 0
    return out


def _read_whole(path: str, max_bytes: int | None) -> bytes:
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if max_bytes is not None and size > max_bytes:
            raise TooLarge(size)
        return f.read()


def _listing(path: str, recursive: bool) -> list[str]:
    if not os.path.isdir(path):
        return [path] if os.path.isfile(path) else []
    if not recursive:
        return [posixpath.join(path, n) for n in os.listdir(path)]
    out = []
    for d, _, files in os.walk(path):
        out += [posixpath.join(d, f) for f in files]
    return out


def _listing_info(path: str) -> list[tuple[str, ObjectInfo]]:
    out = []
    for name in _listing(path, True):
        try:
            st = os.stat(name)
        except FileNotFoundError:  # removed since the listing
            continue
        out.append((name, ObjectInfo(size=st.st_size, modified=st.st_mtime)))
    return out


def _delete(path: str, recursive: bool) -> None:
    try:
        if os.path.isdir(path) and recursive:
            shutil.rmtree(path)
        else:
            os.remove(path)
    except FileNotFoundError:
        pass


def _remove_empty_dirs(path: str) -> None:
    """Bottom-up ``rmdir`` of the directories under ``path`` (and ``path``) that are empty;
    a directory that still holds anything stays (``rmdir`` refuses it)."""
    if not os.path.isdir(path):
        return
    for here, _, _ in sorted(os.walk(path), key=lambda w: -len(w[0])):
        try:
            os.rmdir(here)
        except OSError:
            pass


class LocalSink(PartSink):
    """Parts written at their offsets (concurrently) into ``<path>.tmp-…``, renamed on commit."""

    concurrent = True

    def __init__(self, backend: LocalBackend, path: str) -> None:
        self._backend = backend
        self._path = path
        self._tmp = f"{path}.tmp-{os.getpid()}-{random.getrandbits(40):010x}"
        self._fd: int | None = None

    async def put_whole(self, data: memoryview) -> None:
        await self.start()
        await self.put_part(1, 0, data)
        await self.complete([])

    async def start(self) -> None:
        def open_tmp() -> int:
            folder = os.path.dirname(self._tmp) or "."
            try:
                os.makedirs(folder, exist_ok=True)
            except (FileNotFoundError, NotADirectoryError, FileExistsError) as e:
                # not "does not exist": the directory a save writes into could not be made
                raise Permanent(f"cannot make the directory {folder}: {type(e).__name__}: {e} (a part of the "
                                f"path is a file, or a place where directories cannot be made): check the path") from None
            return os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)

        self._fd = await self._backend._run(self._path, open_tmp)

    async def put_part(self, number: int, offset: int, data: memoryview) -> Any:
        fd = self._fd
        if fd is None:
            raise Permanent(f"{self._path}: part written before start")

        def write() -> None:
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], offset + done)

        await self._backend._run(self._path, write)
        return number

    async def complete(self, tokens: list[Any]) -> None:
        fd, self._fd = self._fd, None

        def finish() -> None:
            if fd is not None:
                os.close(fd)
            os.replace(self._tmp, self._path)

        await self._backend._run(self._path, finish)

    async def abort(self) -> None:
        fd, self._fd = self._fd, None

        def drop() -> None:
            if fd is not None:
                os.close(fd)
            try:
                os.remove(self._tmp)
            except FileNotFoundError:
                pass

        try:
            await self._backend._run(self._path, drop)
        except BackendError:
            pass
