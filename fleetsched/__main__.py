"""``python -m fleetsched``, and the ``fleetsched`` command's entry point (`main`)."""

import sys


def main() -> int:
    """The ``fleetsched`` command (`fleetsched.cli.main`), imported here under its Ctrl-C handling:
    the import takes a second and more, and Ctrl-C in it ended in the import's traceback, where
    a later one says "interrupted" and exits 130."""
    try:
        from .cli import main as command
    except KeyboardInterrupt:
        print("fleetsched: interrupted", file=sys.stderr)
        return 130
    return command()


if __name__ == "__main__":
    sys.exit(main())
