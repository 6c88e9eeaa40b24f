"""TensorBoard event files without TensorBoard: `runtime.tensorboard = true` makes rank 0 write the run's
scalars into <run>/tensorboard/events.out.tfevents.<time>.<host>.hpengine, which `tensorboard --logdir`
reads. Owns the TFRecord framing, the CRC-32C, the Event encoding and the writer.
"""
from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

# The format is TFRecord framing around serialized `Event` protocol buffers:
#   record = uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)   (little-endian)
#   masked_crc32c(x) = rotate-right-15(crc32c(x)) + 0xa282ead8 (mod 2^32)
#   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
#   Summary { repeated Value value = 1; }    Value { string tag = 1; float simple_value = 2; }
# The first record carries file_version "brain.Event:2"; each later one a step's scalars.
_POLY = 0x82F63B78          # CRC-32C (Castagnoli), reflected
_TABLE = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ _POLY if _c & 1 else _c >> 1
    _TABLE.append(_c)


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord."""
    n = struct.pack("<Q", len(data))
    return n + struct.pack("<I", masked_crc32c(n)) + data + struct.pack("<I", masked_crc32c(data))


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1                       # int64 two's complement, as protobuf encodes negatives
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int = 0, file_version: str | None = None, scalars: dict | None = None) -> bytes:
    """A serialized Event: a file-version header, or a step's scalars {tag: value}."""
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3) + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(_bytes_field(1, _bytes_field(1, tag.encode()) + _varint(2 << 3 | 5)
                                       + struct.pack("<f", float(v))) for tag, v in scalars.items())
        out += _bytes_field(5, values)
    return out


class EventWriter:
    """Appends scalars to one event file in `logdir` (created)."""

    def __init__(self, logdir):
        self.dir = Path(logdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.hpengine"
        self.f = open(self.path, "ab")
        self.f.write(record(event(time.time(), 0, file_version="brain.Event:2")))
        self.f.flush()

    def scalars(self, step: int, values: dict) -> None:
        vals = {k: v for k, v in values.items() if v is not None}
        if vals:
            self.f.write(record(event(time.time(), step, scalars=vals)))
            self.f.flush()

    def close(self) -> None:
        self.f.close()


# metrics.jsonl field -> TensorBoard tag
TAGS = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
        "loss_scale": "train/loss_scale", "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu",
        "moe_aux_loss": "moe/aux_loss", "moe_z_loss": "moe/z_loss", "moe_load_max": "moe/load_max_over_mean",
        "moe_dropped": "moe/dropped", "mtp_loss": "train/mtp_loss", "outer_step": "diloco/outer_step",
        "outer_drift": "diloco/drift", "outer_grad_norm": "diloco/pseudo_grad_norm",
        "replica_bytes": "diloco/replica_bytes", "recovery_s": "resilience/recovery_s"}
PER_MODEL = ("loss", "val_loss", "lr", "grad_norm")


def scalars_of(lines: list[dict]) -> dict:
    """{tag: value} of one step's metrics.jsonl lines (one per model; several models' tags get
    "model<i>/" in front of the per-model ones)."""
    out = {}
    for line in lines:
        pre = f"model{line['model']}/" if "model" in line else ""
        for k, tag in TAGS.items():
            if k in line and line[k] is not None:
                out[(pre + tag) if k in PER_MODEL else tag] = line[k]
    return out


def open_writer(cfg, out, rank: int):
    """The run's writer on rank 0 under runtime.tensorboard; None otherwise."""
    if not cfg.runtime.tensorboard or rank != 0:
        return None
    return EventWriter(Path(out) / "tensorboard")
