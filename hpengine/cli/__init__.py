"""The command line `hpengine train | config | data | plan | ckpt | eval | generate | plot | doctor`
(commands.py; the after-training commands in after.py, doctor's in doctor.py). Exports: main, the console
entry point."""
from hpengine.cli.commands import main

__all__ = ["main"]
