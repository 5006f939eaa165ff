"""``python -m llcomm``: the command line (see ``llcomm.cli``)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
