"""Shrink mode's plan (resilience.on_failure = "shrink" with no spare left): the mesh axis that loses a replica
(dp, else sharding), each surviving mesh place's new place (-1: it left with the dead rank's replica and waits
as a spare), the config at the smaller degree, and the exchange of held copies a smaller sharding degree needs.
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpengine.checkpoint.guard import read_latest
from hpengine.config.load import ConfigError
from hpengine.dist import ulfm
from hpengine.dist.buddy import unpack
from hpengine.layout.resolve import SWITCH_OF_AXIS, resolve


class Plan:
    """What a shrink does: `axis` falls from n to n - 1 by dropping coordinate `gone`; `new[p]`: old place p's
    new place (-1: it leaves the mesh); `cfg`: the config at the new degrees."""

    def __init__(self, axis, n, gone, new, cfg):
        self.axis, self.n, self.gone, self.new, self.cfg = axis, n, gone, new, cfg


def plan(cfg, degrees: dict, axes: tuple, coords: list, dead: list) -> Plan | str:
    """The shrink of the mesh (degrees, axes innermost first, coords of each old place) that loses the places
    `dead`, or why there is none (a reason to end the job with)."""
    axis = "dp" if degrees.get("dp", 1) > 1 else "sharding" if degrees.get("sharding", 1) > 1 else None
    if axis is None:
        return "there is no data-parallel or sharding replica to drop (dp = sharding = 1)"
    gone = {coords[p][axis] for p in dead}
    if len(gone) > 1:
        return f"the dead ranks sit in {len(gone)} different {axis} replicas; one can be dropped at a time"
    gone, n = gone.pop(), degrees[axis]
    new_deg = {**degrees, axis: n - 1}
    strides, s = {}, 1
    for a in axes:
        strides[a], s = s, s * new_deg[a]
    new = []
    for c in coords:
        if c[axis] == gone:
            new.append(-1)
            continue
        c = {**c, axis: c[axis] - (c[axis] > gone)}
        new.append(sum(c[a] * strides[a] for a in axes))
    small = copy.deepcopy(cfg)
    for a, name in SWITCH_OF_AXIS.items():
        sec = getattr(small.strategy, name)
        if a == axis or sec.enable:
            sec.enable, sec.degree = True, new_deg[a]
    try:
        resolve(small, s)
    except (ConfigError, ValueError) as exc:
        return f"{axis} {n} -> {n - 1} is not a layout this job can run: {exc}"
    return Plan(axis, n, gone, new, small)


def last_checkpoint(cfg) -> str:
    """The checkpoint a job that ends now resumes from, named for its last line."""
    root = Path(cfg.checkpoint.dir or Path(cfg.train.out_dir) / "checkpoints")
    try:
        return f"resume it from its last checkpoint, {root / read_latest(root)}"
    except Exception:  # noqa: BLE001 - no checkpoint, or an unreadable pointer: the job starts over
        return f"no checkpoint was saved under {root}: it starts over"


def owners_of(small, members: list, coords: list, dead: list, place: int, step: int, shift: int, buddies):
    """Sharding shrink, collective on `small` (the shrunk world; members: every survivor's (old rank, (place,
    ...))): every old owner's held copy at `step` of this rank's sharding group, by old sharding rank (the dead
    rank's from its buddy, handed first to the lowest survivor of its group). [] on a rank outside the mesh."""
    places = len(coords)
    key = lambda p: tuple(sorted((a, v) for a, v in coords[p].items() if a != "sharding"))  # noqa: E731
    rank_of = {p: i for i, (_, (p, *_)) in enumerate(members) if p >= 0}
    extra = []
    for d in dead:
        holder = (d + shift) % places
        to = min(p for p in rank_of if key(p) == key(d))
        if place not in (holder, to):
            continue
        if holder == to:
            meta, data, _ = buddies.partner(step)
            extra.append((coords[d]["sharding"], unpack(meta, data)))
        elif place == holder:
            meta, data, _ = buddies.partner(step)
            small.send((meta, data.size), dest=rank_of[to], tag=45)
            small.Send([data, MPI.BYTE], dest=rank_of[to], tag=46)
        else:
            meta, size = small.recv(source=rank_of[holder], tag=45)
            buf = np.empty(size, np.uint8)
            small.Recv([buf, MPI.BYTE], source=rank_of[holder], tag=46)
            extra.append((coords[d]["sharding"], unpack(meta, buf)))
    groups = sorted({key(p) for p in rank_of})
    mine = [(coords[place]["sharding"], buddies.own(step)[0]), *extra] if place >= 0 else None
    parts = ulfm.gather_in_group(small, groups.index(key(place)) if place >= 0 else -1, max(place, 0), mine)
    got = dict(item for part in parts for item in part)
    return [got[i] for i in sorted(got)]
