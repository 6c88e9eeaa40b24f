"""Files that stay in their folder: contained names, link-free and FIFO-free reads, exclusive temporary
writes published by rename, and the run folder's lock (safe.py); the long commands' progress bars on
stderr (bars.py). Plain os calls, no MPI: every room may use it. Exports: UnsafeFile, Busy and the
functions of safe.py."""
from hpengine.files.safe import (Busy, UnsafeFile, check_regular, fsync_folder, hold_lock, holder_text, inside,
                                 open_append, open_regular, probe_writable, read_bytes, read_text,
                                 refuse_existing, release, write_file)

__all__ = ["Busy", "UnsafeFile", "check_regular", "fsync_folder", "hold_lock", "holder_text", "inside",
           "open_append", "open_regular", "probe_writable", "read_bytes", "read_text", "refuse_existing",
           "release", "write_file"]
