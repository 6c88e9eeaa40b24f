"""Failing together: a check whose outcome can differ between ranks (files, environment, devices) runs on
every rank and, when it fails anywhere, every rank raises the same one-line message, so no rank waits
alone in a collective while another has given up."""
from __future__ import annotations

import time

import numpy as np

from hpengine.dist.comm import Comm


def agree_or_raise(comm, fn, error=RuntimeError, catch=(Exception,)):
    """Run fn on every rank of comm (an mpi4py communicator or a Comm) and fail together: when fn raised
    one of `catch` on any rank, every rank raises the lowest such rank's message, as that exception's
    class where it is one of `catch` (else `error`). Returns fn's result. Use it for every check whose
    outcome can differ between ranks (files, environment, devices), so no rank waits alone in a
    collective while another has given up."""
    out = err = None
    try:
        out = fn()
    except catch as exc:
        err = (type(exc).__name__, str(exc))
    raw = comm.c if isinstance(comm, Comm) else comm
    errs = [e for e in (raw.allgather(err) if raw.Get_size() > 1 else [err]) if e]
    if errs:
        name, msg = errs[0]
        raise next((c for c in catch if c.__name__ == name and c is not Exception), error)(msg)
    return out


def say_once(comm, prefix: str, message: str, write, wait_s: float = 10.0) -> None:
    """Report an error that may be raised on every rank: `write(prefix + message)` on the lowest rank
    alone when every rank of comm (an mpi4py communicator or a Comm) has the same message, else each rank
    writes its own with its rank named (`prefix + "rank r of n: " + message`). Ranks that are not all here
    within wait_s (the error came up on some ranks only) each write their own too: nothing waits forever."""
    c = comm if isinstance(comm, Comm) else Comm(comm, "world")
    n, r = c.size, c.rank
    if n == 1:
        write(prefix + message)
        return
    mine = np.frombuffer(message.encode(), dtype=np.uint8)
    try:
        sizes = np.zeros(n, dtype=np.int64)
        sizes[r] = mine.size
        if _within(c.iallgatherv_(sizes, [1] * n, list(range(n))), wait_s):
            start = np.concatenate([[0], np.cumsum(sizes)])
            allb = np.zeros(int(start[-1]), dtype=np.uint8)
            allb[start[r]:start[r + 1]] = mine
            if _within(c.iallgatherv_(allb, sizes.tolist(), start[:-1].tolist()), wait_s):
                if len({allb[start[i]:start[i + 1]].tobytes() for i in range(n)}) == 1:
                    if r == 0:
                        write(prefix + message)
                    return
    except Exception:  # noqa: BLE001 - reporting an error must never raise another one
        pass
    write(f"{prefix}rank {r} of {n}: {message}")


def _within(req, wait_s: float) -> bool:
    """Whether the non-blocking request finished within wait_s seconds (polled, so no rank hangs)."""
    end = time.monotonic() + wait_s
    while not req.Test():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True
