"""The whole-tensor work of an optimizer that sees TENSORS (Muon's Newton-Schulz), divided: each tensor gets one
owner among the ranks that hold it, balanced by the optimizer's declared work: the tp ranks holding its slices
(gathered to the owner, the result's slices sent back) times its replicas (dp x cp, or ep-dp for the experts;
the owner's result shared with an allgatherv), so every holder applies the same values the owner computed.
"""
from __future__ import annotations

from hpengine.params.buffers import assign_owners, load_imbalance


class WholeTensors:
    """Owners and exchanges for the whole-work tensors of `owned` (the range this rank updates): `work(spec,
    whole shape)` > 0 marks them. tp: the tensor-parallel communicator; replicas: the ranks holding the same owned
    range (a sharding rank's dp peers); experts: the replicas of this rank's expert blocks (ep-dp) when ep > 1."""

    def __init__(self, layout, owned, work, tp, replicas, experts, xp):
        self.layout, self.tp, self.xp, self.work = layout, tp, xp, work
        split = set(layout.expert_tensors)
        self.info, groups = {}, {}      # name -> (group, owner replica, owner tp rank, tp axis of its view, work)
        for name, _, _ in layout.tensors_in(owned):
            spec = layout.by_name[name]
            full = spec.local_shape(0, 1, layout.ep_rank, layout.ep_size)     # tp slices joined
            w = work(spec, full)
            if w <= 0:
                continue
            axis = None if spec.tp_dim is None or tp.size == 1 else spec.tp_dim + 3 - len(full)
            comm = experts if name in split else replicas
            groups.setdefault(id(comm), (comm, []))[1].append((name, axis, w, int(layout.ranges[name].size)))
        self.groups = list(groups.values())
        self.loads = []             # per group: (work per owner, elements per owner)
        for comm, items in self.groups:
            size = _size(comm)
            owners = assign_owners([w for _, _, w, _ in items], size * tp.size)
            work_of, elems = [0] * (size * tp.size), [0] * (size * tp.size)
            for (name, axis, w, n), o in zip(items, owners):
                self.info[name] = (id(comm), o // tp.size, o % tp.size, axis, w)
                work_of[o] += w
                elems[o] += n * (tp.size if axis is not None else 1)
            self.loads.append((comm, work_of, elems))
        self.comms = {id(c): c for c, _ in self.groups}
        self.work_done = self.calls = 0      # fn's work run on this rank (what a test reads to see it divided)

    def apply(self, names, parts, fn) -> list:
        """fn of each tensor whole, this rank's part of every result (optim.base.Whole)."""
        out = [None] * len(names)
        for gid, comm in self.comms.items():
            idx = [i for i, n in enumerate(names) if self.info[n][0] == gid]
            if not idx:
                continue
            r = _rank(comm)
            mine = [i for i in idx if self.info[names[i]][1] == r]
            for i, res in zip(mine, self._tp_round(names, parts, mine, fn)):
                out[i] = res
            if _size(comm) > 1:
                self._share(comm, names, parts, idx, out)
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
        for comm, work, elems in self.loads:
            what = f"{_size(comm)} replicas x {self.tp.size} tp" if self.tp.size > 1 else f"{_size(comm)} replicas"
            out.append(f"{len(work)} owners ({what}): work imbalance {load_imbalance(work):.3f}, "
                       f"bytes imbalance {load_imbalance(elems):.3f}")
        return "whole-tensor work divided over " + "; ".join(out) if out else ""

    def range_loads(self, ranges) -> list[int]:
        """The whole-tensor work in each of `ranges` (a sharding partition's owners), for its imbalance."""
        lay = self.layout
        return [sum(self.work(lay.by_name[n], lay.by_name[n].local_shape(0, 1, lay.ep_rank, lay.ep_size))
                    for n, _, _ in lay.tensors_in(r)) for r in ranges]

    def owners(self) -> int:
        return max((len(w) for _, w, _ in self.loads), default=1)


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
