"""`make test`'s driver: runs each part (a make target) even when an earlier one failed, streams its output,
and ends with a table of parts (passed / failed / skipped, with pytest's counts or the reason a part gave),
exiting non-zero when any part failed. A part says why it skipped by appending a line to $PART_NOTES.
Standard library only: it runs before anything is installed. Usage: parts.py [--make CMD] PART...
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)\b")
SUMMARY = re.compile(r"^=*\s*(?:\d+ (?:passed|failed|errors?|skipped|xfailed|xpassed|deselected)[, ]*)+"
                     r"(?:warnings?[, ]*)?.*\bin [\d.]+s")
SKIP_REASON = re.compile(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$")
MAKE_ERROR = re.compile(r"^\S*make(\[\d+\])?: \*\*\*")
ORDER = ("failed", "error", "passed", "skipped", "xfailed", "xpassed", "deselected")


def counts(lines) -> dict[str, int]:
    """pytest's outcome counts summed over every summary line of a part's output (one per pytest run)."""
    total: dict[str, int] = {}
    for line in lines:
        if SUMMARY.match(line.strip()):
            for n, what in COUNT.findall(line):
                what = "error" if what.startswith("error") else what
                total[what] = total.get(what, 0) + int(n)
    return total


def run_part(make: list[str], part: str) -> dict:
    """Run one part with its output streamed through; its result, time, counts and notes."""
    fd, notes_path = tempfile.mkstemp(prefix=f"hpengine-{part}-", suffix=".notes")
    os.close(fd)
    env = dict(os.environ, PART_NOTES=notes_path)
    start = time.monotonic()
    lines: list[str] = []
    try:
        proc = subprocess.Popen(make + [part], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                text=True, errors="replace", bufsize=1)
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line.rstrip("\n"))
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.kill()
        raise
    except OSError as e:
        rc, lines = 127, [f"could not start {make[0]}: {e}"]
    finally:
        with open(notes_path, errors="replace") as f:
            notes = [line.strip() for line in f if line.strip()]
        os.unlink(notes_path)
    last = next((line.strip() for line in reversed(lines) if line.strip() and not MAKE_ERROR.match(line)), "")
    return {"part": part, "rc": rc, "secs": time.monotonic() - start, "counts": counts(lines), "notes": notes,
            "skip_reasons": [m.group(1) for m in map(SKIP_REASON.match, lines) if m], "last": last}


def verdict(r: dict) -> str:
    """failed when make failed; skipped when nothing ran and something said why (a note, or pytest
    skipping every test); passed otherwise."""
    c = r["counts"]
    if r["rc"] != 0:
        return "FAILED"
    ran = c.get("passed", 0) + c.get("xfailed", 0) + c.get("xpassed", 0)
    if not ran and (r["notes"] or c.get("skipped")):
        return "skipped"
    return "passed"


def detail(r: dict) -> str:
    c = r["counts"]
    parts = [", ".join(f"{c[k]:,} {k}" for k in ORDER if c.get(k))] if c else []
    if r["rc"] != 0:
        parts.append(f"make exited {r['rc']}" + ("" if c else f": {r['last'][:100]}"))
    parts += r["notes"]
    if verdict(r) == "skipped" and not r["notes"] and r["skip_reasons"]:
        parts.append(r["skip_reasons"][0])
    return "; ".join(p for p in parts if p)


def clock(secs: float) -> str:
    m, s = divmod(int(round(secs)), 60)
    return f"{m}:{s:02d}"


def table(results: list[dict], total: float) -> str:
    width = max(len(r["part"]) for r in results)
    rows = [f"== make test: {len(results)} parts in {clock(total)} (min:s)",
            f"{'part':<{width}}  {'result':<7}  {'time':>6}  detail"]
    rows += [f"{r['part']:<{width}}  {verdict(r):<7}  {clock(r['secs']):>6}  {detail(r)}" for r in results]
    failed = [r["part"] for r in results if verdict(r) == "FAILED"]
    rows.append(f"== {len(failed)} of {len(results)} parts failed: {' '.join(failed)}" if failed
                else f"== every part passed or said why it skipped")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    make = [os.environ.get("MAKE", "make"), "--no-print-directory"]
    if argv[:1] == ["--make"]:
        make, argv = shlex.split(argv[1]), argv[2:]
    if not argv:
        print("usage: parts.py [--make CMD] PART...: name at least one make target to run", file=sys.stderr)
        return 2
    start = time.monotonic()
    results = []
    for part in argv:
        print(f"\n==== {part}", flush=True)
        results.append(run_part(make, part))
    print("\n" + table(results, time.monotonic() - start), flush=True)
    return 1 if any(verdict(r) == "FAILED" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
