"""The manifest's seal. `manifest_sha256` (always) catches corruption and truncation, but anyone who edits the
manifest can recompute it. With a key (HPENGINE_CHECKPOINT_KEY, or HPENGINE_CHECKPOINT_KEY_FILE naming a
file that holds it) the manifest also carries `manifest_hmac_sha256`, a keyed MAC that only key holders can
make: a checkpoint whose MAC is missing or wrong is refused. The manifest lists every shard piece's sha256,
so the seal covers the data too. Also here: the manifest's structure check (pieces inside their shapes)."""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from math import prod

from hpengine.files import UnsafeFile, read_bytes
from hpengine.optim import optimizer_kind
from hpengine.optim.base import UNDECLARED

SUM_KEY = "manifest_sha256"
MAC_KEY = "manifest_hmac_sha256"
DTYPES = ("float64", "float32", "float16", "bfloat16", "uint16")      # what shards hold
KEY_ENV, KEY_FILE_ENV = "HPENGINE_CHECKPOINT_KEY", "HPENGINE_CHECKPOINT_KEY_FILE"
log = logging.getLogger("hpengine")


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


def load_key(env=os.environ) -> bytes | None:
    """The signing key: the file HPENGINE_CHECKPOINT_KEY_FILE names, else the text of HPENGINE_CHECKPOINT_KEY;
    None when neither is set. A key file's trailing newline is not part of the key."""
    path = env.get(KEY_FILE_ENV, "")
    if path:
        try:
            key = read_bytes(path, KEY_FILE_ENV, limit=1 << 16).rstrip(b"\r\n")
        except (OSError, UnsafeFile) as exc:
            raise CheckpointError(f"{KEY_FILE_ENV} = '{path}': the key file cannot be read "
                                  f"({getattr(exc, 'strerror', None) or exc})") from None
        if not key:
            raise CheckpointError(f"{KEY_FILE_ENV} = '{path}': the key file is empty; put a secret of 32 or "
                                  "more random bytes in it (e.g. `head -c 32 /dev/urandom | base64 > FILE`)")
        return key
    text = env.get(KEY_ENV, "")
    return text.encode() if text else None


def _body(manifest: dict) -> bytes:
    return json.dumps({k: v for k, v in manifest.items() if k not in (SUM_KEY, MAC_KEY)},
                      sort_keys=True, separators=(",", ":")).encode()


def manifest_digest(manifest: dict) -> str:
    return hashlib.sha256(_body(manifest)).hexdigest()


def manifest_mac(manifest: dict, key: bytes) -> str:
    return hmac.new(key, _body(manifest), hashlib.sha256).hexdigest()


def seal(manifest: dict, key: bytes | None = None) -> dict:
    """The manifest with its checksum added, and with a key its MAC."""
    out = {**manifest, SUM_KEY: manifest_digest(manifest)}
    if key is not None:
        out[MAC_KEY] = manifest_mac(manifest, key)
    return out


def check_manifest(manifest, mpath, key: bytes | None = None) -> None:
    """Refuse a manifest that is not a JSON object, whose checksum (or, with a key, MAC) does not match, or
    whose piece index is impossible."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"manifest '{mpath}' is a JSON {type(manifest).__name__}, not an object: it is not "
                              "an hpengine manifest")
    want = manifest.get(SUM_KEY)
    if want is None:
        log.warning("manifest '%s' has no checksum (written before manifests were checksummed): its step, "
                    "state and piece index are not verified", mpath)
    elif manifest_digest(manifest) != want:
        raise CheckpointError(f"manifest '{mpath}' does not match its checksum ({SUM_KEY}): it was edited or "
                              "corrupted; use another checkpoint")
    if key is not None:
        mac = manifest.get(MAC_KEY)
        if not isinstance(mac, str):
            raise CheckpointError(f"manifest '{mpath}' is not signed ({MAC_KEY} missing) but a checkpoint key is "
                                  "set: it was written without the key or its signature was removed; refused")
        if not hmac.compare_digest(mac, manifest_mac(manifest, key)):
            raise CheckpointError(f"manifest '{mpath}' fails its signature check ({MAC_KEY}) under the checkpoint "
                                  "key that is set: it was written with another key or changed since; refused")
    elif MAC_KEY in manifest:
        log.warning("manifest '%s' is signed, but no checkpoint key is set (%s): its signature is not checked",
                    mpath, KEY_ENV)
    try:
        _check_structure(manifest)
    except (KeyError, TypeError, ValueError, AssertionError) as exc:
        raise CheckpointError(f"manifest '{mpath}' is malformed: {exc or type(exc).__name__}") from None


def optimizer(m: dict) -> tuple[str, tuple[str, ...]]:
    """(name, state tensor names) of the optimizer whose state a manifest holds (one that names none was
    written before optimizers declared their state: optim.base.UNDECLARED's)."""
    undeclared = optimizer_kind(UNDECLARED)
    o = m.get("optimizer", {"name": undeclared.name, "state": list(undeclared.state)})
    if not (isinstance(o, dict) and isinstance(o.get("name"), str) and isinstance(o.get("state"), list)
            and all(isinstance(k, str) and k.isidentifier() and k != "param" for k in o["state"])):
        raise ValueError(f"'optimizer' is {o!r}, not {{\"name\": NAME, \"state\": [STATE NAMES]}}")
    return o["name"], tuple(o["state"])


def _check_structure(m: dict) -> None:
    kinds = ("param", *optimizer(m)[1])
    int(m["step"])
    int(m["state"]["opt_steps"])
    shapes = m["shapes"]
    if not isinstance(m.get("config"), str):
        raise ValueError("'config' must be the run's config as TOML text")
    if not isinstance(shapes, dict) or not isinstance(m["pieces"], list):
        raise ValueError("'shapes' must be an object and 'pieces' a list")
    for name, shape in shapes.items():
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise ValueError(f"shape of {name!r} is {shape!r}, not a list of sizes")
    for i, p in enumerate(m["pieces"]):
        if not isinstance(p, dict):
            raise ValueError(f"piece {i} is {p!r}, not an object")
        what = f"piece {i} ({p['kind']} of {p['name']})"
        if p["kind"] not in kinds or p["name"] not in shapes:
            raise ValueError(f"{what}: unknown kind or tensor")
        if not isinstance(p["file"], str) or not isinstance(p["dset"], str):
            raise ValueError(f"{what}: 'file' and 'dset' must be strings")
        if p["dtype"] not in DTYPES:
            raise ValueError(f"{what}: dtype {p['dtype']!r} is not one a checkpoint stores ({', '.join(DTYPES)})")
        g, box, (a, b) = p["global_shape"], p["box"], p["flat"]
        if len(box) != len(g) or len(g) != len(shapes[p["name"]]) or not all(
                0 <= lo < hi <= n for (lo, hi), n in zip(box, g)):
            raise ValueError(f"{what}: box {box} does not fit global shape {g}")
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a < b <= prod(hi - lo for lo, hi in box)):
            raise ValueError(f"{what}: flat range {[a, b]} does not fit its box {box}")
