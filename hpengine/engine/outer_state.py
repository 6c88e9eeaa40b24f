"""DiLoCo's state in a checkpoint: "param" holds the outer parameters (what an export or evaluation reads),
"outer_momentum" the outer momentum and, under overlap, "outer_pending" the mean of the exchanges not landed yet
(written by island 0); each island's parameters, optimizer state and error-feedback residual go under
"island{i}_<kind>". All are pieces over global regions, so they load under any inner layout (same islands).
"""
from __future__ import annotations

from hpengine.engine.state import checkpoint_pieces, load_state
from hpengine.params.buffers import cut


class _Arrays:
    """An optimizer's face over outer arrays, for checkpoint_pieces: `arrays` over the owned part, seen from one
    model's segment (its offset `at` and size)."""

    def __init__(self, arrays: dict, at: int, size: int):
        self.arrays, self.at, self.size = arrays, at, size

    def state(self) -> dict:
        return {k: a[self.at:self.at + self.size] for k, a in self.arrays.items() if a is not None}

    def state_at(self, a: int) -> dict:
        return {k: a for k, v in self.arrays.items() if v is not None}


def _views(segs, arrays: dict) -> list:
    return [None if seg is None else _Arrays(arrays, at, seg.size) for _, seg, at in segs]


def arrays(outer) -> dict:
    """The outer state a checkpoint saves, by its names (this island's residual as plain "outer_residual"), over
    this rank's owned part: what a rank's next outer steps depend on besides `outer.steps` and, under overlap,
    which fragments' means `outer_pending` holds (`outer.settled`)."""
    out = {"param": outer.param, "outer_momentum": outer.momentum, "outer_pending": outer.pending,
           "outer_residual": outer.residual}
    return {k: a for k, a in out.items() if a is not None}


def kinds(opt_state: tuple, islands: int, outer) -> list[str]:
    """The manifest's state names (beside "param") of a DiLoCo checkpoint."""
    held = arrays(outer)
    out = list(opt_state) + [k for k in ("outer_momentum", "outer_pending") if k in held]
    for i in range(islands):
        out += [f"island{i}_param", *(f"island{i}_{k}" for k in opt_state)]
        out += [f"island{i}_outer_residual"] if "outer_residual" in held else []
    return out


def island_pieces(pieces: list, island: int, outer, stage, sync, segs, replica, backend, elsewhere, copy) -> list:
    """This rank's pieces (checkpoint_pieces' of its island's state) renamed to its island, with its residual
    and, on island 0, the outer parameters and momentum."""
    args, held = (replica, backend, elsewhere, copy), arrays(outer)
    out = [(n, f"island{island}_{k}", *rest) for n, k, *rest in pieces]
    if "outer_residual" in held:
        res = checkpoint_pieces(stage, sync, segs, _views(segs, {"outer_residual": held["outer_residual"]}),
                                outer.param, *args)
        out += [(n, f"island{island}_{k}", *rest) for n, k, *rest in res if k != "param"]
    if island == 0:     # the momentum and the landing exchanges' mean are the same on every island
        shared = {k: held.get(k) for k in ("outer_momentum", "outer_pending")}
        out += checkpoint_pieces(stage, sync, segs, _views(segs, shared), outer.param, *args)
    return out


class _Island:
    """A reader that reads island i's state under the plain names."""

    def __init__(self, reader, island: int):
        self.reader, self.island, self.manifest = reader, island, reader.manifest

    def read(self, kind, name, region):
        return self.reader.read(f"island{self.island}_{kind}", name, region)


def holds_island(reader, island: int) -> bool:
    state = (getattr(reader, "manifest", None) or {}).get("optimizer", {}).get("state", [])
    return f"island{island}_param" in state


def load_islands(reader, island: int, outer, stage, sync, segs, opts, master, tp, backend) -> int:
    """Island `island`'s state and the outer state from a DiLoCo checkpoint; returns the optimizer steps."""
    steps = load_state(stage, sync, segs, opts, master, tp, backend, _Island(reader, island))
    lay = stage.layout
    saved = reader.manifest.get("optimizer", {}).get("state", [])
    held = arrays(outer)
    if "outer_pending" not in saved:        # a run without overlap left none
        held.pop("outer_pending", None)
    for kind, arr in held.items():
        kind = f"island{island}_{kind}" if kind == "outer_residual" else kind
        for name in lay.names:
            hits = cut(sync.owned_parts, lay.ranges[name])
            if not hits:
                continue
            r = lay.ranges[name]
            vals = reader.read(kind, name, lay.box(name)).reshape(-1)
            for hit, at in hits:
                arr[at:at + hit.size] = backend.xp.asarray(vals[hit.start - r.start:hit.stop - r.start],
                                                           dtype=arr.dtype)
    outer.steps = int(reader.manifest["state"].get("outer_steps", 0))
    outer.resume(steps if "outer_pending" in held else None)
    return steps
