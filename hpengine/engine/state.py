"""A rank's training state as data, in plain functions over explicit arguments: what a checkpoint stores of
this rank (pieces, each naming the global region it covers), loading any checkpoint into this rank's
layout, and the whole model assembled across ranks for comparisons.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from hpengine.device.bf16_bits import store_values_
from hpengine.params.buffers import cut


def checkpoint_pieces(stage, sync, segs, opts, master, replica: dict, backend, elsewhere: frozenset,
                      copy: bool = True) -> list:
    """What this rank saves: (name, kind, global_shape, tp box, flat a, b, host array) for the owned
    parameters (float32 masters under amp) and each state tensor its optimizer declares (segs, opts: each
    model's owned parts, (slot, flat Range, offset in the owned arrays), and their optimizers). The ranks holding
    the same values (`replica`: coordinates and degrees of dp and cp; `experts`: this rank's place among the
    holders of its expert block and their count) split them into equal contiguous shares, so each value is
    written once and the writing is spread: dense tensors over dp x cp, an expert block over the ranks that hold it. The tensors in `elsewhere` (those
    this rank does not count: tp replicas of replicated tensors, another stage's copies; layout/reduction.py)
    are left to the one rank that counts them. copy=False on the CPU gives views of the live buffers (an
    asynchronous save copies them before the next update), on a GPU views of pinned host copies."""
    lay = stage.layout
    host = backend.to_host if copy else (lambda a: backend.to_host(a, pinned=True))
    p_own = host(master if master is not None else sync.owned_params())
    dp, ndp, cp, ncp = (replica[k] for k in ("dp", "ndp", "cp", "ncp"))
    groups = {False: [], True: []}  # expert tensor? -> (name, spec, a, size, param offset, {state: (array, offset)})
    for (s, seg, at), opt in zip(segs, opts):
        if seg is None:
            continue
        held = {kind: host(arr) for kind, arr in opt.state().items()}
        for name, part, off in lay.tensors_in(seg):
            spec = lay.by_name[name]
            if name not in elsewhere:       # the state tensors that cover it, where its values sit in each
                state = {kind: (held[kind], o) for kind, o in opt.state_at(part.start - seg.start).items()}
                groups[spec.ep_dim is not None].append((name, spec, off, part.size, at + part.start - seg.start,
                                                        state))
    out = []
    for expert, items in groups.items():
        r, n = replica["experts"] if expert else (dp * ncp + cp, ndp * ncp)
        total = sum(it[3] for it in items)
        mine_lo, mine_hi, at = r * total // n, (r + 1) * total // n, 0
        for name, spec, off, size, po, state in items:
            lo, hi = max(at, mine_lo) - at, min(at + size, mine_hi) - at
            at += size
            if hi <= lo:
                continue
            box = lay.box(name)
            for kind, arr, o in (("param", p_own, po), *((k, a, so) for k, (a, so) in state.items())):
                data = arr[o + lo:o + hi]
                out.append((name, kind, spec.global_shape, box, off + lo, off + hi, data.copy() if copy else data))
    return out


def checkpoint_meta(opt_steps: int, scaler, models: int) -> dict:
    return {"opt_steps": opt_steps, "loss_scaler": scaler.state() if scaler else None, "models": models}


def reference_order_specs(slots) -> list:
    """Every model's specs in one-process layout order (all stages)."""
    return [dataclasses.replace(x, name=s.prefix + x.name) for s in slots for b in s.model.blocks()
            for x in s.model.specs(b.name)]


def true_shapes(slots) -> dict:
    """Unpadded global shape of every tensor of every model (all stages)."""
    return {sp.name: list(sp.true_shape or sp.global_shape) for sp in reference_order_specs(slots)}


def load_state(stage, sync, segs, opts, master, tp, backend, reader, params_only: bool = False) -> int | None:
    """Fill this rank's parameters (and optimizer state) from a checkpoint reader, reading only the tensors
    and regions this rank holds. Returns the optimizer step count stored (None with params_only)."""
    lay, xp = stage.layout, backend.xp
    full = sync.params is not None          # stages < 3 hold every parameter of the stage
    for name in lay.names:
        r = lay.ranges[name]
        hits = cut(sync.owned_parts, r)
        if not full and not hits:
            continue
        vals = reader.read("param", name, lay.box(name)).reshape(-1)
        if full:            # the compute copy: the backend's dtype, or packed bfloat16 bits
            store_values_(xp, sync.params.data[r.slice], vals)
        for hit, at in hits:
            dst = master if master is not None else sync.owned_params()
            store_values_(xp, dst[at:at + hit.size], vals[hit.start - r.start:hit.stop - r.start])
    if master is not None and not full:
        store_values_(xp, sync.owned_params(), master)
    if params_only:
        return None
    return _load_optimizer_state(stage, segs, opts, xp, reader)


def _load_optimizer_state(stage, segs, opts, xp, reader) -> int:
    lay, steps = stage.layout, int(reader.manifest["state"]["opt_steps"])
    for (s, seg, _), opt in zip(segs, opts):
        if seg is None:
            continue
        held = opt.state()
        for name, part, off in lay.tensors_in(seg):
            box = lay.box(name)
            for kind, at in opt.state_at(part.start - seg.start).items():
                vals = reader.read(kind, name, box).reshape(-1)[off:off + part.size]
                held[kind][at:at + part.size] = xp.asarray(vals, dtype=held[kind].dtype)
        opt.t = steps
    return steps


def named_params(stage, sync, tp, comms) -> dict:
    """Every tensor of every model as its whole global array (host), assembled across sharding, tp slices
    and pipeline stages — collective over the world."""
    flat, lay = sync.full_params(), stage.layout
    local = {n: flat[lay.ranges[n].slice].reshape(lay.shapes[n]) for n in lay.names if n not in stage.copies}
    parts = comms["tp"].allgather_obj(local)
    whole = {}
    for n in local:         # whole over tp first ...
        sp = lay.by_name[n]
        whole[n] = parts[0][n] if sp.tp_dim is None else np.concatenate([p[n] for p in parts], axis=sp.tp_dim)
    if comms.get("ep") is not None and lay.ep_size > 1:      # ... then an expert block per ep rank
        split = [n for n in whole if lay.by_name[n].ep_dim is not None]
        blocks = comms["ep"].allgather_obj({n: whole[n] for n in split})
        whole.update({n: np.concatenate([b[n] for b in blocks], axis=lay.by_name[n].ep_dim) for n in split})
    for n in whole:
        sp = lay.by_name[n]
        whole[n] = whole[n][tuple(slice(0, k) for k in sp.true_shape)] if sp.true_shape else whole[n]
    out = {}
    for d in comms["pp"].allgather_obj(whole):
        out.update(d)
    return out
