"""The inputs of a build: which files are read, and the documents they hold.
Owns the folder walk (order, links, --include / --exclude globs), standard input, and reading plain text,
compressed files and JSON Lines into documents, counting what is skipped.
"""
from __future__ import annotations

import bz2
import fnmatch
import gzip
import json
import logging
import lzma
import os
import shutil
import sys
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from hpengine.data.format import DataError

log = logging.getLogger("hpengine.data")

STDIN = "-"
STDIN_NAME = "<stdin>"
SKIP_DIRS = frozenset({"__pycache__"})
_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
_DECOMPRESS_ERRORS = (OSError, EOFError, lzma.LZMAError, zlib.error, ValueError)


@dataclass(frozen=True)
class Source:
    """One input: a file, or standard input (path None until spooled to a file)."""
    path: Path | None
    name: str                  # as reported to the user
    jsonl: bool
    size: int = 0              # bytes on disk, for progress

    @property
    def opener(self):
        return _OPENERS.get(Path(self.name).suffix.lower(), open)


@dataclass
class Counts:
    """What a pass over the inputs read and skipped."""
    n_files: int = 0                   # inputs read as text (or JSON Lines)
    skipped_binary: int = 0            # NUL bytes: files, and JSONL records whose text holds NUL
    skipped_undecodable: int = 0       # not UTF-8, or a damaged compressed stream
    skipped_unreadable: int = 0        # the operating system refused to read it
    skipped_records: int = 0           # JSONL lines that are not an object with a string field
    skipped_empty: int = 0             # empty files or records
    first_bad_record: str | None = None    # "FILE line N" of the first skipped record
    bytes_done: int = 0                # on-disk size of the inputs finished so far (for progress)

    def attrs(self) -> dict:
        """The counts stored in the token file."""
        return {k: getattr(self, k) for k in ("n_files", "skipped_binary", "skipped_undecodable",
                                              "skipped_unreadable", "skipped_records", "skipped_empty")}


def _is_jsonl(name: str) -> bool:
    p = Path(name)
    if p.suffix.lower() in _OPENERS:
        p = p.with_suffix("")
    return p.suffix.lower() == ".jsonl"


def _globs(globs: str | Iterable[str]) -> tuple[str, ...]:
    return (globs,) if isinstance(globs, str) else tuple(globs)


# --include / --exclude globs (fnmatch, case-sensitive, `*` also crosses `/`) select files found in
# folders: a glob matches a file when it matches the path relative to the given folder or the file
# name. Files named explicitly are always read.
def _matches(globs: Iterable[str], rel: str, name: str) -> bool:
    return any(fnmatch.fnmatchcase(rel, g) or fnmatch.fnmatchcase(name, g) for g in globs)


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _source(path: Path, size: int) -> Source:
    return Source(path, str(path), _is_jsonl(path.name), size)


def _walk(folder: Path, rel: str, include, exclude, skip_dirs, seen_dirs: set, seen_files: set):
    """(path, size) of the files below `folder`, in name order, depth first."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as e:
        log.warning("skipping unreadable folder %s: %s", folder, e)
        return
    for entry in entries:
        path, sub = Path(entry.path), f"{rel}{entry.name}"
        try:
            is_dir, is_file = entry.is_dir(), entry.is_file()      # both follow symbolic links
        except OSError:
            continue
        if is_dir:
            dir_id = _file_id(path)
            if entry.name.startswith(".") or entry.name in skip_dirs or dir_id is None or dir_id in seen_dirs:
                continue
            seen_dirs.add(dir_id)
            yield from _walk(path, sub + "/", include, exclude, skip_dirs, seen_dirs, seen_files)
        elif is_file:
            if include and not _matches(include, sub, entry.name):
                continue
            if exclude and _matches(exclude, sub, entry.name):
                continue
            try:
                st = entry.stat()
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen_files:
                seen_files.add((st.st_dev, st.st_ino))
                yield path, st.st_size
        else:
            log.info("skipping %s: not a regular file or folder (a broken link?)", path)


# Files and folders are taken in the order given; a folder is walked recursively in name order, hidden
# folders and __pycache__ skipped, symbolic links followed (each real folder walked once, so a link to
# an ancestor cannot loop; each real file read once, first name wins). Every file is a candidate
# whatever its name.
def walk(folder: str | Path, include: Iterable[str] = (), exclude: Iterable[str] = (),
         skip_dirs=SKIP_DIRS) -> Iterator[Path]:
    """The files below `folder` in reading order, each real file once."""
    folder = Path(folder)
    for path, _ in _walk(folder, "", _globs(include), _globs(exclude), skip_dirs, {_file_id(folder)}, set()):
        yield path


def find_sources(paths: Iterable[str | Path], *, include: Iterable[str] = (), exclude: Iterable[str] = (),
                 jsonl_stdin: bool = False, skip_dirs=SKIP_DIRS, avoid: Iterable[str | Path] = ()) -> list[Source]:
    """The inputs in reading order; `avoid` names files never to read (the build's own outputs)."""
    include, exclude = _globs(include), _globs(exclude)
    seen_files = {i for i in map(_file_id, map(Path, avoid)) if i is not None}
    seen_dirs: set = set()
    sources: list[Source] = []
    for given in paths:
        if str(given) == STDIN:
            if any(s.path is None for s in sources):
                raise DataError("standard input '-' is given twice: expected it at most once")
            sources.append(Source(None, STDIN_NAME, jsonl_stdin))
            continue
        p = Path(given)
        if p.is_dir():
            seen_dirs.add(_file_id(p))
            sources += [_source(f, size) for f, size in _walk(p, "", include, exclude, skip_dirs, seen_dirs,
                                                              seen_files)]
        elif p.is_file():
            st = p.stat()
            if (st.st_dev, st.st_ino) not in seen_files:
                seen_files.add((st.st_dev, st.st_ino))
                sources.append(_source(p, st.st_size))
        else:
            raise DataError(f"corpus source '{p}' not found: expected an existing file, folder, "
                            "or '-' for standard input")
    return sources


def spool_stdin(sources: list[Source], folder: Path, prefix: str) -> tuple[list[Source], Path | None]:
    """Copies standard input to a temporary file in `folder` (so it can be read twice); returns the
    sources reading that file instead, and the file (the caller deletes it)."""
    if not any(s.path is None for s in sources):
        return sources, None
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=".stdin")
    try:
        with os.fdopen(fd, "wb") as f:
            shutil.copyfileobj(sys.stdin.buffer, f, 2**20)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    size = Path(tmp).stat().st_size
    return [Source(Path(tmp), s.name, s.jsonl, size) if s.path is None else s for s in sources], Path(tmp)


#   plain text     one document: the file's content when it is UTF-8 without NUL bytes; a NUL byte marks
#                  the file binary, invalid UTF-8 makes it undecodable (both skipped and counted)
#   .gz .bz2 .xz   decompressed first; the content then follows the same rules
#   .jsonl         (also .jsonl.gz etc.) JSON Lines: every line a JSON object whose `text_field` string is
#                  one document; any other line is a skipped record (the first one is remembered);
#                  blank lines are ignored
#   "-"            standard input: one document, or JSON Lines when asked for
# Empty documents are skipped and counted.
def documents(sources: Iterable[Source], counts: Counts, text_field: str = "text") -> Iterator[str]:
    """The documents of the sources, in order, one at a time; what is skipped is counted in `counts`."""
    for src in sources:
        if src.jsonl:
            yield from _records(src, counts, text_field)
        else:
            text = _whole_text(src, counts)
            if text is not None:
                yield text
        counts.bytes_done += src.size


def _open(src: Source, counts: Counts):
    try:
        return src.opener(src.path, "rb")
    except OSError as e:
        log.warning("skipping unreadable file %s: %s", src.name, e)
        counts.skipped_unreadable += 1
        return None


def _read_failed(src: Source, counts: Counts, e: Exception, what: str) -> None:
    if src.opener is open:             # an I/O error on a plain file
        counts.skipped_unreadable += 1
    else:                              # a damaged compressed stream
        counts.skipped_undecodable += 1
    log.warning("%s %s: %s", what, src.name, e)


def _whole_text(src: Source, counts: Counts) -> str | None:
    f = _open(src, counts)
    if f is None:
        return None
    try:
        with f:
            data = f.read()
    except _DECOMPRESS_ERRORS as e:
        _read_failed(src, counts, e, "skipping")
        return None
    if b"\0" in data:
        log.info("skipping binary file %s (contains NUL bytes)", src.name)
        counts.skipped_binary += 1
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        log.info("skipping %s: not UTF-8 text (%s)", src.name, e)
        counts.skipped_undecodable += 1
        return None
    counts.n_files += 1
    if not text:
        counts.skipped_empty += 1
        return None
    return text


def _bad_record(src: Source, line: int, counts: Counts) -> None:
    counts.skipped_records += 1
    if counts.first_bad_record is None:
        counts.first_bad_record = f"{src.name} line {line}"


def _records(src: Source, counts: Counts, text_field: str) -> Iterator[str]:
    f = _open(src, counts)
    if f is None:
        return
    counts.n_files += 1
    with f:
        line = 0
        try:
            for line, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw.decode("utf-8"))
                except ValueError:                     # invalid JSON or UTF-8
                    _bad_record(src, line, counts)
                    continue
                text = record.get(text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    _bad_record(src, line, counts)
                elif "\0" in text:
                    counts.skipped_binary += 1
                elif not text:
                    counts.skipped_empty += 1
                else:
                    yield text
        except _DECOMPRESS_ERRORS as e:
            _read_failed(src, counts, e, f"stopped reading after line {line} of")
