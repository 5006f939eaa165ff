"""Redraw a plot from a result file: ``python -m llcomm.bench.plot results.json out.png``."""
import sys

from .common import plot_main

if __name__ == "__main__":
    sys.exit(plot_main())
