"""Checkpoints: a folder of per-rank HDF5 shard files and a JSON manifest. Every stored piece names its
global tensor and the global region it covers, so any layout loads any checkpoint, each rank reading
only the pieces that overlap what it holds. This file reads them (Reader; exports, info); write.py writes
and publishes them atomically.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import tomllib
from math import prod
from pathlib import Path

import h5py
import numpy as np

from hpengine.checkpoint import guard, seal
from hpengine.checkpoint.guard import CheckpointError
from hpengine.files import UnsafeFile, check_regular, inside, read_text

FORMAT = "hpengine-checkpoint-1"
MANIFEST_LIMIT = 1 << 30          # bytes: far above any manifest (a few hundred bytes a piece)


def _sha(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)).hexdigest()


# --- read ----------------------------------------------------------------------------------------
def step_folder(path) -> Path:
    """A checkpoint folder, or a checkpoints root whose `latest` names one."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint '{p}' does not exist")
    if (p / "manifest.json").exists():
        return p
    if os.path.lexists(p / "latest"):
        target = p / guard.read_latest(p)
        if (target / "manifest.json").exists():
            return target
        raise CheckpointError(f"'{p / 'latest'}' points at '{target.name}', which has no manifest.json")
    raise CheckpointError(f"'{p}' is not a checkpoint: no manifest.json and no 'latest' pointer inside")


def _flat(table: dict, prefix: str = "model.") -> dict:
    out = {}
    for k, v in table.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def model_difference(saved_toml: str | None, config_toml: str | None) -> str:
    """How the [model] of a checkpoint's saved config and of this config differ, in words: the kinds when
    they differ, else the first differing key ("" when either is unknown or they agree)."""
    try:
        saved = tomllib.loads(saved_toml).get("model", {})
        asked = tomllib.loads(config_toml).get("model", {})
    except (TypeError, AttributeError, tomllib.TOMLDecodeError):
        return ""
    kind, want = saved.get("kind"), asked.get("kind")
    if kind != want:
        return f"the checkpoint holds a {kind} model (model.kind = {kind!r}), the config asks for {want}"
    saved, asked = _flat(saved), _flat(asked)
    for key in [*asked, *(k for k in saved if k not in asked)]:
        if saved.get(key) != asked.get(key):
            return (f"the checkpoint's {kind} model has {key} = {saved.get(key)!r}, the config asks for "
                    f"{asked.get(key)!r}")
    return ""


# Every piece and the manifest itself checksummed (seal.py: the checksum and
# the optional keyed MAC). Every file a manifest or `latest` names stays inside the checkpoint's folder and is
# read only as a regular file, never through a link; no pickle anywhere, so loading can never run code.
class Reader:
    """Reads global regions of tensors from a checkpoint folder, verifying each piece it uses."""

    def __init__(self, path, key: bytes | None = None):
        """key: the signing key (seal.load_key); None takes it from the environment, where one may be set."""
        self.dir = step_folder(path)
        mpath = self.dir / "manifest.json"
        try:
            self.manifest = json.loads(read_text(mpath, "manifest", limit=MANIFEST_LIMIT))
        except UnsafeFile as exc:
            raise CheckpointError(str(exc)) from None
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"manifest '{mpath}' is unreadable or not JSON: {exc}") from None
        if isinstance(self.manifest, dict) and self.manifest.get("format") != FORMAT:
            raise CheckpointError(f"manifest '{mpath}' has format {self.manifest.get('format')!r}, "
                                  f"expected {FORMAT!r}")
        self.key = key if key is not None else seal.load_key()
        seal.check_manifest(self.manifest, mpath, self.key)
        self.optimizer, state = seal.optimizer(self.manifest)
        self.kinds = ("param", *state)           # what the pieces hold: parameters and the optimizer's state
        self.by_tensor = {}
        for p in self.manifest["pieces"]:
            self.by_tensor.setdefault((p["kind"], p["name"]), []).append(p)
        self.files = {}

    def check_shapes(self, shapes: dict, config_toml: str | None = None) -> None:
        """The checkpoint must hold the same model (tensor names and unpadded shapes). With the config's
        TOML, the message also says how the two [model] tables differ."""
        mine = self.manifest["shapes"]
        if mine != shapes:
            diff = sorted(set(mine) ^ set(shapes)) or \
                [n for n in shapes if list(shapes[n]) != list(mine[n])]
            how = model_difference(self.manifest.get("config"), config_toml)
            raise CheckpointError(f"checkpoint '{self.dir}' holds a different model than the config: "
                                  + (f"{how}; " if how else "") + f"tensors "
                                  f"{diff[:4]} differ (e.g. {diff[0]}: checkpoint {mine.get(diff[0])}, config "
                                  f"{shapes.get(diff[0])})")

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def _open(self, name: str):
        """The shard file `name` of this checkpoint: a bare name, a regular file inside the folder, not a link."""
        try:
            path = inside(self.dir, name, f"manifest '{self.dir / 'manifest.json'}': shard file", bare=True)
            check_regular(path, "shard")
        except UnsafeFile as exc:
            raise CheckpointError(str(exc)) from None
        if path not in self.files:
            self.files[path] = h5py.File(path, "r")
        return self.files[path]

    def _data(self, piece) -> np.ndarray:
        path = self.dir / piece["file"]
        try:
            data = self._open(piece["file"])[piece["dset"]][...]
        except (OSError, KeyError) as exc:
            raise CheckpointError(f"shard '{path}' is missing, truncated or corrupted "
                                  f"(reading {piece['dset']}: {exc})") from None
        if _sha(data) != piece["sha256"]:
            raise CheckpointError(f"shard '{path}': checksum mismatch in {piece['dset']} ({piece['kind']} of "
                                  f"{piece['name']}); the file is corrupted")
        return data

    def read(self, kind: str, name: str, region) -> np.ndarray:
        """float64 values of global region (a tuple of slices) of tensor `name`; padding (beyond the
        tensor's true shape) reads as 0."""
        true = self.manifest["shapes"].get(name)
        if true is None:
            raise CheckpointError(f"checkpoint '{self.dir}' has no tensor {name!r}")
        if kind not in self.kinds:
            raise CheckpointError(f"checkpoint '{self.dir}' holds the state of optimizer {self.optimizer!r} "
                                  f"({', '.join(self.kinds[1:])}), not {kind!r}: resume with optim.name = "
                                  f"{self.optimizer!r}, or start from its parameters alone (hpengine ckpt export "
                                  f"{self.dir} FILE --params-only, then checkpoint.init_from = FILE)")
        out = np.zeros(tuple(s.stop - s.start for s in region))
        need = tuple(slice(s.start, min(s.stop, t)) for s, t in zip(region, true))
        filled = 0
        for piece in self.by_tensor.get((kind, name), []):
            filled += self._place(piece, region, need, out)
        if filled != prod(max(0, s.stop - s.start) for s in need):
            raise CheckpointError(f"checkpoint '{self.dir}' does not cover {kind} of {name} {_fmt(need)} "
                                  f"(a shard file or piece is missing)")
        return out

    def _place(self, piece, region, need, out) -> int:
        box = [slice(a, b) for a, b in piece["box"]]
        shape = tuple(s.stop - s.start for s in box)
        a, b = piece["flat"]
        row = prod(shape[1:]) if len(shape) > 1 else 1
        lo0, hi0 = box[0].start + a // row, box[0].start + (b - 1) // row + 1   # rows the piece touches
        if min(hi0, need[0].stop) <= max(lo0, need[0].start) or any(
                min(bx.stop, nd.stop) <= max(bx.start, nd.start) for bx, nd in zip(box[1:], need[1:])):
            return 0
        data = self._data(piece)
        if a == 0 and b == prod(shape):                  # a whole box: copy the overlap directly
            cut = [slice(max(bx.start, nd.start), min(bx.stop, nd.stop)) for bx, nd in zip(box, need)]
            src = tuple(slice(c.start - bx.start, c.stop - bx.start) for c, bx in zip(cut, box))
            dst = tuple(slice(c.start - rg.start, c.stop - rg.start) for c, rg in zip(cut, region))
            out[dst] = data.reshape(shape)[src]
            return prod(c.stop - c.start for c in cut)
        coords = np.unravel_index(np.arange(a, b), shape)
        g = [c + bx.start for c, bx in zip(coords, box)]
        inside = np.ones(b - a, dtype=bool)
        for gi, nd in zip(g, need):
            inside &= (gi >= nd.start) & (gi < nd.stop)
        out[tuple(gi[inside] - rg.start for gi, rg in zip(g, region))] = data[inside]
        return int(inside.sum())

    def verify(self) -> list[str]:
        """Problems found by reading every piece and checking its checksum ([] = intact)."""
        problems, broken = [], set()
        for p in self.manifest["pieces"]:
            if p["file"] in broken:
                continue
            path = self.dir / p["file"]
            try:
                self._open(p["file"])
            except CheckpointError as exc:
                broken.add(p["file"])
                problems.append(str(exc))
                continue
            except OSError as exc:
                broken.add(p["file"])
                problems.append(f"shard '{path}' is missing, truncated or not HDF5: {exc}")
                continue
            try:
                self._data(p)
            except CheckpointError as exc:
                problems.append(str(exc))
        return problems

    def sealed(self) -> str:
        """What guards this manifest beyond its checksums, in words (`ckpt verify` and `ckpt info` say it)."""
        if self.key is not None:
            return "signature verified"
        return ("signed, but no key is set: signature not checked" if seal.MAC_KEY in self.manifest else
                "not signed: an edited manifest with a recomputed checksum would pass")

    def close(self):
        for f in self.files.values():
            f.close()
        self.files = {}


def _fmt(region) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in region) + "]"


def read_region(a, region) -> np.ndarray:
    """float64 values of `region` (slices) of array-like `a`; zeros beyond a's shape (padded vocabulary)."""
    out = np.zeros(tuple(s.stop - s.start for s in region))
    need = tuple(slice(s.start, min(s.stop, n)) for s, n in zip(region, a.shape))
    if all(s.stop > s.start for s in need):
        out[tuple(slice(0, s.stop - s.start) for s in need)] = a[need]
    return out


class ExportReader:
    """The same read() over a consolidated export file (`hpengine ckpt export`), for checkpoint.init_from."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            check_regular(self.path, "checkpoint.init_from")
            self.f = h5py.File(self.path, "r")
        except UnsafeFile as exc:
            raise CheckpointError(str(exc)) from None
        except OSError as exc:
            raise CheckpointError(f"checkpoint.init_from = '{path}': not a readable HDF5 file ({exc})") from None
        if self.f.attrs.get("format") != FORMAT + "-export":
            raise CheckpointError(f"'{path}' is not an hpengine export (attribute format missing)")
        step = self.f.attrs.get("step")
        if not isinstance(step, (int, np.integer)) or step < 0:
            self.f.close()
            raise CheckpointError(f"'{path}': attribute step = {step!r} is not a step count (an integer >= 0)")
        self.step = int(step)

    def check_shapes(self, shapes: dict) -> None:
        """The file must hold exactly the config's parameters at their true shapes."""
        where = f"checkpoint.init_from = '{self.path}'"
        theirs = {n: list(d.shape) for n, d in self.f["param"].items()} if "param" in self.f else {}
        for name, shape in shapes.items():
            if name not in theirs:
                raise CheckpointError(f"{where} has no tensor {name!r}, which the config's model has "
                                      f"(shape {list(shape)}); the file holds another model")
            if theirs[name] != list(shape):
                raise CheckpointError(f"{where}: tensor {name!r} has shape {theirs[name]} in the file but "
                                      f"{list(shape)} in the config's model")
        extra = sorted(set(theirs) - set(shapes))
        if extra:
            raise CheckpointError(f"{where} holds tensors the config's model lacks: {extra[:4]}; the file "
                                  "holds another model")

    def read(self, kind, name, region):
        key = f"{kind}/{name}"
        if key not in self.f:
            raise CheckpointError(f"'{self.path}' has no dataset {key!r}")
        return read_region(self.f[key], region)

    def close(self):
        self.f.close()


def export_hdf5(path, out, params_only: bool = False) -> dict:
    """Write one consolidated HDF5 file of global tensors (params and optimizer state, or params only),
    plain h5py."""
    r = Reader(path)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))   # ours, not a link
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = FORMAT + "-export"
            f.attrs["step"] = r.step
            f.attrs["config"] = r.manifest["config"]
            f.attrs["state"] = json.dumps(r.manifest["state"])
            for name, shape in r.manifest["shapes"].items():
                region = tuple(slice(0, n) for n in shape)
                for kind in (("param",) if params_only else r.kinds):
                    pieces = r.by_tensor.get((kind, name))
                    if pieces:   # stored in the dtype the checkpoint holds
                        f.create_dataset(f"{kind}/{name}", data=r.read(kind, name, region).astype(pieces[0]["dtype"]))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        r.close()
    return {"tensors": len(r.manifest["shapes"]), "step": r.step, "path": str(out)}


def info(path) -> dict:
    r = Reader(path)
    files = sorted({p["file"] for p in r.manifest["pieces"]})
    size = 0
    for f in files:
        try:
            path = inside(r.dir, f, "shard file", bare=True)
            if os.path.lexists(path):        # a missing shard is reported by the checksums' pass
                size += check_regular(path, "shard").st_size
        except UnsafeFile as exc:
            raise CheckpointError(f"manifest '{r.dir / 'manifest.json'}': {exc}") from None
    return {"dir": str(r.dir), "step": r.step, "layout": r.manifest["layout"], "world": r.manifest["world"],
            "tensors": len(r.manifest["shapes"]), "elements": sum(prod(s) for s in r.manifest["shapes"].values()),
            "files": len(files), "bytes": size, "state": r.manifest["state"]}
