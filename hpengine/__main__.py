"""`python -m hpengine ...` is the same as the `hpengine` command: it runs cli.commands.main and exits
with its status."""
import sys

from hpengine.cli.commands import main

sys.exit(main())
