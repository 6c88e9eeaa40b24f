"""`python -m hpengine ...` is the same as the `hpengine` command."""
import sys

from hpengine.cli.commands import main

sys.exit(main())
