"""Failing together: a check whose outcome can differ between ranks (files, environment, devices) runs on
every rank and, when it fails anywhere, every rank raises the same one-line message, so no rank waits
alone in a collective while another has given up."""
from __future__ import annotations

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
