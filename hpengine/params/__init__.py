"""Parameters as data: ParamSpec, Layout (offsets), FlatBuffer (one array, named views), Range and the
element-count partition (buffers.py); layout-invariant initialisation from (seed, name) (init.py).
Exports: ParamSpec, Layout, FlatBuffer, Range, partition, init_flat, init_range."""
from hpengine.params.buffers import FlatBuffer, Layout, ParamSpec, Range, partition
from hpengine.params.init import init_flat, init_range

__all__ = ["FlatBuffer", "Layout", "ParamSpec", "Range", "partition", "init_flat", "init_range"]
