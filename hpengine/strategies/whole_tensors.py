"""The whole-tensor work of an optimizer that sees TENSORS (Muon's Newton-Schulz), divided: each tensor gets one
owner, balanced by declared work, among its data-replica group: sharding ranks (the update sent from its storage
owner by alltoallv, and back), times replicas (dp x cp, or ep-dp for experts: the result shared by allgatherv),
times tp (slices gathered to the owner, the result's sent back); every holder applies the owner's values.
"""
from __future__ import annotations

from hpengine.params.buffers import assign_owners, load_imbalance


class WholeTensors:
    """Owners and exchanges for the whole-work tensors: `work(spec, whole shape)` > 0 marks them. owned: the range
    this rank updates; tp: the tensor-parallel communicator; replicas: the ranks holding the same owned range (a
    sharding rank's dp peers); experts: the replicas of this rank's expert blocks (ep-dp) when ep > 1; sharding
    (with `ranges`, its partition, one Range a rank): the tensors of every range are divided over sharding x
    replicas x tp (routed experts split over ep stay with their range's ep-dp replicas); slots: each model's
    Range of the layout (an exchange covers one model; every rank takes part in each model's)."""

    def __init__(self, layout, owned, work, tp, replicas, experts, xp, sharding=None, ranges=None, slots=None):
        self.layout, self.tp, self.xp, self.work = layout, tp, xp, work
        self.sh = sharding if sharding is not None and sharding.size > 1 else None
        self.ranges = list(ranges) if self.sh is not None else [owned]
        self.slots = list(slots or [owned])
        here = self.sh.rank if self.sh is not None else 0
        split = set(layout.expert_tensors)
        # name -> (group, owner replica, owner tp rank, tp axis of its view, work, owner sharding rank,
        #          storage sharding rank, local shape as (count, in, out))
        self.info, groups = {}, {}
        for s, rng in enumerate(self.ranges):
            for name, _, _ in layout.tensors_in(rng):
                spec = layout.by_name[name]
                full = spec.local_shape(0, 1, layout.ep_rank, layout.ep_size)     # tp slices joined
                w = work(spec, full)
                comm = experts if name in split else replicas
                hop = self.sh is not None and comm is replicas
                if w <= 0 or (s != here and not hop):
                    continue
                axis = None if spec.tp_dim is None or tp.size == 1 else spec.tp_dim + 3 - len(full)
                shape = tuple(layout.shapes[name])
                shape = (1, *shape) if len(shape) == 2 else shape
                groups.setdefault(id(comm), (comm, hop, []))[2].append((name, axis, w, shape, s))
        # the sharded group first: every rank walks the groups in the same order
        self.groups = sorted(groups.values(), key=lambda g: not g[1])
        self.loads = []             # per group: (communicator, sharding ranks, work per owner, elements per owner)
        for comm, hop, items in self.groups:
            S, D, T = (self.sh.size if hop else 1), _size(comm), tp.size
            owners = assign_owners([w for _, _, w, _, _ in items], S * D * T)
            work_of, elems = [0] * (S * D * T), [0] * (S * D * T)
            for (name, axis, w, shape, s), o in zip(items, owners):
                self.info[name] = (id(comm), o // T % D, o % T, axis, w, o // (D * T) if hop else s, s, shape)
                work_of[o] += w
                elems[o] += _prod(shape) * (T if axis is not None else 1)
            self.loads.append((comm, S, work_of, elems))
        self.comms = {id(c): (c, hop, [n for n, *_ in items]) for c, hop, items in self.groups}
        self.work_done = self.calls = 0      # fn's work run on this rank (what a test reads to see it divided)

    def apply(self, names, parts, fn, where=None, dtype=None) -> list:
        """fn of each tensor whole, this rank's part of every result (optim.base.Whole); `where`: the range the
        caller updates (which model's exchange this is), `dtype`: its arrays' (what this rank receives in)."""
        out = [None] * len(names)
        for gid, (comm, hop, every) in self.comms.items():
            idx = [i for i, n in enumerate(names) if self.info[n][0] == gid]
            if hop:
                slot = self._slot(where)
                self._hop(comm, names, parts, idx, [n for n in every if slot.start <= self.layout.ranges[n].start
                                                    < slot.stop], fn, dtype or parts[0].dtype, out)
            elif idx:
                r = _rank(comm)
                mine = [i for i in idx if self.info[names[i]][1] == r]
                for i, res in zip(mine, self._tp_round(names, parts, mine, fn)):
                    out[i] = res
            if idx and _size(comm) > 1:
                self._share(comm, names, parts, idx, out)
        return out

    def _slot(self, where):
        at = where.start if where is not None else self.slots[0].start
        return next(s for s in self.slots if s.start <= at < s.stop)

    def _hop(self, comm, names, parts, idx, items, fn, dtype, out) -> None:
        """The sharded group's tensors of one model: each update from its storage owner (the one of this replica,
        at the work owner's place among the replicas) to its work owner over sharding, fn there (its tp round),
        the result back; `out` gets this rank's results of its own tensors."""
        S, s, d, info = self.sh.size, self.sh.rank, _rank(comm), self.info
        pos = {names[i]: i for i in idx}
        moving = [n for n in items if info[n][1] == d and info[n][5] != info[n][6]]
        send = [[n for n in moving if info[n][6] == s and info[n][5] == k] for k in range(S)]
        take = [[n for n in moving if info[n][5] == s and info[n][6] == k] for k in range(S)]
        got = self._exchange([[parts[pos[n]] for n in b] for b in send], take, dtype) if moving else {}
        local = [i for i in idx if info[names[i]][1] == d and info[names[i]][5] == s]
        which = [names[i] for i in local] + [n for b in take for n in b]
        if not which:
            return
        whole = self._tp_round(which, [parts[i] for i in local] + [got[n] for b in take for n in b],
                               list(range(len(which))), fn)
        res = dict(zip(which, whole))
        for i in local:
            out[i] = res[names[i]]
        if moving:
            back = self._exchange([[res[n] for n in b] for b in take], send, dtype)
            for b in send:
                for n in b:
                    out[pos[n]] = back[n]

    def _exchange(self, arrays, want, dtype) -> dict:
        """arrays[k] to sharding rank k, in one alltoallv; returns what arrives, by name (want[k]: the tensors
        sharding rank k sends here, in its order)."""
        xp, info = self.xp, self.info
        flat = [a.reshape(-1) for b in arrays for a in b]
        scount = [sum(int(a.size) for a in b) for b in arrays]
        rcount = [sum(_prod(info[n][7]) for n in b) for b in want]
        recv = xp.empty(sum(rcount), dtype=dtype)
        self.sh.alltoallv_(_cat(xp, flat, dtype), scount, recv, rcount)
        out, at = {}, 0
        for b in want:
            for n in b:
                k = _prod(info[n][7])
                out[n] = recv[at:at + k].reshape(info[n][7])
                at += k
        return out

    def _tp_round(self, names, parts, mine, fn) -> list:
        """This replica's tensors: each gathered whole to its tp owner, fn there, its slices sent back."""
        xp, tp, info = self.xp, self.tp, self.info
        t, T = tp.rank, tp.size
        owner = {i: info[names[i]][2] for i in mine}
        axis = {i: info[names[i]][3] for i in mine}
        ours = [i for i in mine if owner[i] == t]
        if T == 1:
            return self._run(names, [parts[i] for i in mine], mine, fn)
        # gather: my slice of each split tensor to its owner (replicated ones are whole on the owner already)
        send = [parts[i].reshape(-1) for k in range(T) for i in mine if owner[i] == k and axis[i] is not None]
        scount = [sum(parts[i].size for i in mine if owner[i] == k and axis[i] is not None) for k in range(T)]
        took = [i for i in ours if axis[i] is not None]
        dtype = parts[0].dtype
        recv = xp.empty(sum(parts[i].size for i in took) * T, dtype=dtype)
        tp.alltoallv_(_cat(xp, send, dtype), scount, recv, [recv.size // T] * T)
        pieces, at = {i: [] for i in took}, 0
        for _ in range(T):
            for i in took:
                pieces[i].append(recv[at:at + parts[i].size].reshape(parts[i].shape))
                at += parts[i].size
        wholes = [xp.concatenate(pieces[i], axis=axis[i]) if axis[i] is not None else parts[i] for i in ours]
        done = dict(zip(ours, self._run(names, wholes, ours, fn)))
        # scatter: the owner's result, each tp rank its slice (a replicated tensor: all of it)
        send = [_slice(xp, done[i], axis[i], k, T).reshape(-1) for k in range(T) for i in ours]
        scount = [sum(parts[i].size for i in ours)] * T
        rcount = [sum(parts[i].size for i in mine if owner[i] == k) for k in range(T)]
        recv = xp.empty(sum(rcount), dtype=dtype)
        tp.alltoallv_(_cat(xp, send, dtype), scount, recv, rcount)
        res, at = {}, 0
        for k in range(T):
            for i in mine:
                if owner[i] == k:
                    res[i] = recv[at:at + parts[i].size].reshape(parts[i].shape)
                    at += parts[i].size
        return [res[i] for i in mine]

    def _run(self, names, wholes, which, fn) -> list:
        outs = []
        for i, whole in zip(which, wholes):
            outs.append(fn(whole))
            self.work_done += self.info[names[i]][4]
            self.calls += 1
        return outs

    def _share(self, comm, names, parts, idx, out) -> None:
        """Every replica gets every owner's results (this rank's tp slice of them), in one allgatherv."""
        xp, R = self.xp, comm.size
        by = [[i for i in idx if self.info[names[i]][1] == d] for d in range(R)]
        counts = [sum(parts[i].size for i in b) for b in by]
        displs = [sum(counts[:d]) for d in range(R)]
        buf = xp.empty(sum(counts), dtype=parts[idx[0]].dtype)
        at = displs[comm.rank]
        for i in by[comm.rank]:
            buf[at:at + parts[i].size] = out[i].reshape(-1)
            at += parts[i].size
        comm.allgatherv_(buf, counts, displs)
        for d in range(R):
            at = displs[d]
            for i in by[d]:
                out[i] = buf[at:at + parts[i].size].reshape(parts[i].shape)
                at += parts[i].size

    def describe(self) -> str:
        """One line: owners per group and the imbalances (largest share / mean) of work and bytes."""
        out = []
        for comm, S, work, elems in self.loads:
            what = " x ".join(f"{n} {a}" for n, a in ((S, "sharding"), (_size(comm), "replicas"), (self.tp.size, "tp"))
                              if n > 1) or "1 replica"
            out.append(f"{len(work)} owners ({what}): work imbalance {load_imbalance(work):.3f}, "
                       f"bytes imbalance {load_imbalance(elems):.3f}")
        return "whole-tensor work divided over " + "; ".join(out) if out else ""

    def owners(self) -> int:
        return max((len(w) for *_, w, _ in self.loads), default=1)


def _prod(shape) -> int:
    n = 1
    for k in shape:
        n *= int(k)
    return n


def _size(comm) -> int:
    return 1 if comm is None else comm.size


def _rank(comm) -> int:
    return 0 if comm is None else comm.rank


def _slice(xp, a, axis, k, n):
    if axis is None:
        return a
    m = a.shape[axis] // n
    sl = [slice(None)] * a.ndim
    sl[axis] = slice(k * m, (k + 1) * m)
    return xp.ascontiguousarray(a[tuple(sl)])


def _cat(xp, arrays, dtype):
    return xp.concatenate(arrays) if arrays else xp.empty(0, dtype=dtype)
