"""`python -m pdserve.stack.guard PARENT_PID CMD...`: exec CMD so that it gets SIGTERM
when its parent dies.

`up` starts every child through this shim: PR_SET_PDEATHSIG survives exec, so even a
`kill -9` of `up` (no chance to clean up) stops the children, and they stop their own
children. Done here rather than in `preexec_fn`, which is unsafe in a process that has
threads (the load test of `demo` runs in `up`'s process).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    parent, cmd = int(argv[0]), argv[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        print(f"pdserve guard: prctl failed (errno {ctypes.get_errno()})", file=sys.stderr)
    if os.getppid() != parent:  # the parent died before the signal was armed
        sys.exit(1)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
