"""`hpengine doctor`: is this installation ready to train? The MPI library, CUDA-aware MPI, NCCL, the CUDA
kernels compiling (checks.py), device buffers through MPI on every rank (ranks.py), and on a device the kernels
against their NumPy twins (parity.py) and their bandwidth against a copy (speed.py, bandwidth.py). It never
imports PyTorch, and only the command line imports it. Exports: Check, run_checks, line, summary."""
from hpengine.doctor.checks import Check
from hpengine.doctor.report import line, run_checks, summary

__all__ = ["Check", "line", "run_checks", "summary"]
