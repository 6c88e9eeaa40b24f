"""The state side of the engine: what a checkpoint stores of this rank (its pieces, each naming the global
region it covers), loading any checkpoint into this rank's layout, and the whole model assembled
across ranks for comparisons. A mixin of Engine; it reads the engine's layout, sync and optimizers.
"""
from __future__ import annotations

import dataclasses

import numpy as np


class EngineState:
    def checkpoint_pieces(self) -> list:
        """What this rank alone saves: (name, kind, global_shape, tp box, flat a, b, host array) for the
        owned parameters (float32 masters under amp) and Adam moments; dp replicas, tp replicas of
        replicated tensors and the last stage's tied copy are left to the one rank that saves them."""
        if self.mesh.coords["dp"] != 0:
            return []
        own, lay = self.sync.owned, self.layout
        host = self.be.to_host
        p_own = host(self.master if self.master is not None else self.sync.owned_params())
        out = []
        for s, opt in zip(self.slots, self.opts):
            seg = own.intersect(s.range)
            if seg is None:
                continue
            m, v = host(opt.m), host(opt.v)
            for name, part, off in lay.tensors_in(seg):
                spec = lay.by_name[name]
                if (spec.tp_dim is None and self.tp.rank > 0) or name in self.tied_copies:
                    continue
                box = spec.tp_slices(self.tp.rank, self.tp.size)
                a, b = off, off + part.size
                po, so = part.start - own.start, part.start - seg.start
                for kind, arr, o in (("param", p_own, po), ("adam_m", m, so), ("adam_v", v, so)):
                    out.append((name, kind, spec.global_shape, box, a, b, arr[o:o + part.size].copy()))
        return out

    def checkpoint_meta(self) -> dict:
        return {"opt_steps": self.opt_steps, "loss_scaler": self.scaler.state() if self.scaler else None,
                "models": len(self.slots)}

    def true_shapes(self) -> dict:
        """Unpadded global shape of every tensor of every model (all stages)."""
        return {sp.name: list(sp.true_shape or sp.global_shape) for sp in self.reference_order_specs()}

    def config_toml(self) -> str:
        from .config import to_toml
        return to_toml(self.cfg)

    def load_state(self, reader, params_only: bool = False) -> None:
        """Fill this rank's parameters (and Adam moments, step counts, loss scale) from a checkpoint
        reader, reading only the tensors and regions this rank holds."""
        lay, own = self.layout, self.sync.owned
        full = self.sync.params is not None          # stages < 3 hold every parameter of the stage
        for name in lay.names:
            spec = lay.by_name[name]
            r = lay.ranges[name]
            hit = r.intersect(own)
            if not full and hit is None:
                continue
            vals = reader.read("param", name, spec.tp_slices(self.tp.rank, self.tp.size)).reshape(-1)
            if full:
                self.sync.params.data[r.slice] = self.xp.asarray(vals, dtype=self.be.dtype)
            if hit is not None:
                dst = self.master if self.master is not None else self.sync.owned_params()
                dst[hit.start - own.start:hit.stop - own.start] = self.xp.asarray(
                    vals[hit.start - r.start:hit.stop - r.start], dtype=dst.dtype)
        if self.master is not None and not full:
            self.sync.owned_params()[...] = self.master
        if not params_only:
            self._load_moments(reader)

    def _load_moments(self, reader) -> None:
        lay, meta = self.layout, reader.manifest["state"]
        for s, opt in zip(self.slots, self.opts):
            seg = self.sync.owned.intersect(s.range)
            if seg is None:
                continue
            for name, part, off in lay.tensors_in(seg):
                spec = lay.by_name[name]
                box = spec.tp_slices(self.tp.rank, self.tp.size)
                for kind, arr in (("adam_m", opt.m), ("adam_v", opt.v)):
                    vals = reader.read(kind, name, box).reshape(-1)[off:off + part.size]
                    arr[part.start - seg.start:part.stop - seg.start] = self.xp.asarray(vals, dtype=arr.dtype)
            opt.t = int(meta["opt_steps"])
        self.opt_steps = int(meta["opt_steps"])
        if self.scaler is not None and meta.get("loss_scaler"):
            self.scaler.load(meta["loss_scaler"])

    def named_params(self) -> dict:
        """Every tensor of every model as its whole global array (host), assembled across sharding,
        tp slices and pipeline stages — collective over the world; for comparing layouts."""
        flat, lay = self.full_params(), self.layout
        local = {n: flat[lay.ranges[n].slice].reshape(lay.shapes[n]) for n in lay.names
                 if n not in self.tied_copies}
        parts = self.mesh.comms["tp"].allgather_obj(local)
        whole = {}
        for n in local:
            sp = lay.by_name[n]
            a = parts[0][n] if sp.tp_dim is None else np.concatenate([p[n] for p in parts], axis=sp.tp_dim)
            whole[n] = a[tuple(slice(0, k) for k in sp.true_shape)] if sp.true_shape else a
        out = {}
        for d in self.pp.allgather_obj(whole):
            out.update(d)
        return out

    def reference_order_specs(self):
        """Every model's specs in one-process layout order (all stages)."""
        return [dataclasses.replace(x, name=s.prefix + x.name) for s in self.slots for b in s.model.block_names()
                for x in s.model.specs(b)]

