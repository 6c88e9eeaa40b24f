"""`python -m hpengine ...` is the same as the `hpengine` command."""
import sys

from .cli import main

sys.exit(main())
