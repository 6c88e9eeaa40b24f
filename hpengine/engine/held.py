"""A rank's training state as host copies, for a buddy copy (run/resilience.py): what the next steps depend on
(DiLoCo's outer state included), taken out of an engine and put back into one built at the same mesh place, or
(shrink) re-partitioned over fewer owners from every old owner's copy.
"""
from __future__ import annotations

import numpy as np

from hpengine.engine import outer_state
from hpengine.params.buffers import cut, partition


def held_state(eng) -> tuple[dict, dict]:
    """Everything this rank's next steps depend on, as host copies ({name: array}) and small facts: the
    compute copy of its parameters (the whole stage's below sharding stage 3, else its shard), the amp
    masters, each optimizer's state and step count, the loss scaler and router biases; under DiLoCo the outer
    state a checkpoint saves ("outer.<name>") and its exchange count. An engine built at the same mesh place
    continues exactly from it (restore_held); a buddy copy holds it."""
    sync, host = eng.sync, eng.be.to_host
    arrays = {"params": host(sync.params.data)} if sync.params is not None else {"owned": host(sync.owned_params())}
    if eng.master is not None:
        arrays["master"] = host(eng.master)
    for i, opt in enumerate(eng.opts):
        for kind, a in ({} if opt is None else opt.state()).items():
            arrays[f"opt{i}.{kind}"] = host(a)
    facts = {"opt_steps": eng.opt_steps, "opt_t": [None if o is None else o.t for o in eng.opts],
             "scaler": eng.scaler.state() if eng.scaler else None, "router": eng.router_bias.meta()}
    if eng.outer is not None:
        # overlap: the exchanges on the wire complete into `pending` now, as before a checkpoint (their means are the
        # same bits whenever they are taken; they land at their own step): none is lost with a dead island rank
        eng.outer.settle()
        arrays.update({f"outer.{k}": host(a) for k, a in outer_state.arrays(eng.outer).items()})
        facts["outer"] = {"steps": eng.outer.steps, "settled": dict(eng.outer.settled)}
    return arrays, facts


def restore_held(eng, arrays: dict, facts: dict) -> None:
    """Take back what held_state gave (of this rank, or of the rank whose mesh place this one took)."""
    sync, xp = eng.sync, eng.xp
    if sync.params is not None:
        sync.params.data[...] = xp.asarray(arrays["params"])
    else:
        sync.owned_params()[...] = xp.asarray(arrays["owned"])
    if eng.master is not None:
        eng.master[...] = xp.asarray(arrays["master"])
    for i, opt in enumerate(eng.opts):
        if opt is not None:
            for kind, a in opt.state().items():
                a[...] = xp.asarray(arrays[f"opt{i}.{kind}"])
            opt.t = facts["opt_t"][i]
    if eng.outer is not None:
        for k, a in outer_state.arrays(eng.outer).items():
            a[...] = xp.asarray(arrays[f"outer.{k}"])
        eng.outer.steps, eng.outer.flight, eng.outer.settled = facts["outer"]["steps"], {}, dict(
            facts["outer"]["settled"])
    _restore_facts(eng, facts)


def _restore_facts(eng, facts: dict) -> None:
    eng.opt_steps = facts["opt_steps"]
    if eng.scaler is not None:
        eng.scaler.load(facts["scaler"])
    eng.router_bias.load(facts["router"])


def restore_repartitioned(eng, arrays: dict, facts: dict, owners: list) -> None:
    """Fill an engine whose sharding degree fell by one from the held copies of every rank of its old sharding
    group (`owners`, by old sharding rank; `arrays`/`facts`: this rank's own): each old owner's shard goes back
    to its place in the flat buffer and each new owner takes its new range. Element-wise optimizer state only
    (config/rules.py refuses shrink under sharding for any other)."""
    lay, sync, xp = eng.layout, eng.sync, eng.xp
    ranges = partition([lay.ranges[n].size for n in lay.names], len(owners), eng.res.partition)
    full = {}

    def put(key, r, vals):
        full.setdefault(key, np.empty(lay.total, vals.dtype))[r.slice] = vals

    for own, arr in zip(ranges, owners):
        for key in ("owned", "master"):
            if key in arr:
                put(key, own, arr[key])
        segs = [seg for s in eng.slots for seg, _ in (cut([(own, 0)], s.range) or [(None, 0)])]
        for key, vals in arr.items():
            if key.startswith("opt"):
                i, kind = key[3:].split(".", 1)
                put(kind, segs[int(i)], vals)
    mine = lambda a: np.concatenate([a[r.slice] for r, _ in sync.owned_parts])  # noqa: E731
    whole = arrays["params"] if "params" in arrays else full["owned"]
    if sync.params is not None:
        sync.params.data[...] = xp.asarray(whole)
    else:
        sync.owned_params()[...] = xp.asarray(mine(whole))
    if eng.master is not None:
        eng.master[...] = xp.asarray(mine(full["master"]))
    for (_, seg, _), opt in zip(eng.segs, eng.opts):
        if opt is not None:
            for kind, a in opt.state().items():
                a[...] = xp.asarray(full[kind][seg.slice])
            opt.t = facts["opt_steps"]
    _restore_facts(eng, facts)
