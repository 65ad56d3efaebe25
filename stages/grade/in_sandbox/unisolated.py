"""The launcher of the unisolated fallback (``allow_unisolated``: rlimits and a process group only).

Started as ``python -I -S unisolated.py channel_fd prog.py`` in the run's
scratch folder (the program's cwd, where the files it gets lie beside it):
moves the result channel to fd 3 and runs ``prog.py`` as ``__main__``.
"""

import os
import sys


def main(argv):
    chan_fd = int(argv[1])
    if chan_fd >= 0 and chan_fd != 3:
        os.dup2(chan_fd, 3)
        os.close(chan_fd)
    sys.argv = argv[2:]
    with open(sys.argv[0], "rb") as f:
        src = f.read()
    exec(compile(src, sys.argv[0], "exec"), {"__name__": "__main__"})


if __name__ == "__main__":
    main(sys.argv)
