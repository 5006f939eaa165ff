"""Which checkout's llcomm a tool imports: ``--llcomm DIR`` on its command line (read before the
tool's own imports, so one command can time two checkouts against each other), else this one."""
import argparse
import os
import sys


def llcomm_dir() -> str:
    if "--llcomm" in sys.argv[:-1]:
        return os.path.abspath(sys.argv[sys.argv.index("--llcomm") + 1])
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def use_llcomm_dir() -> str:
    """Put ``llcomm_dir()`` first on sys.path; returns it."""
    d = llcomm_dir()
    sys.path.insert(0, d)
    return d


def argument_parser(**kw) -> argparse.ArgumentParser:
    """An ArgumentParser that already takes ``--llcomm DIR`` (so ``--help`` lists it)."""
    ap = argparse.ArgumentParser(**kw)
    ap.add_argument("--llcomm", default=llcomm_dir(),
                    help="the checkout whose llcomm package to use (default: this one)")
    return ap
