"""The first code a sandboxed interpreter runs (its text is passed with ``python -c``; it is
never imported by the library).

Arguments: ``CPU_S AS_BYTES FSIZE_BYTES NPROC NOFILE UID``. It sets the resource limits on
itself (inherited by every process the code starts), drops to ``UID`` when it is >= 0 (bwrap
run by root: the kernel does not enforce ``RLIMIT_NPROC`` on root), reads the code from stdin
(a line with its length in bytes, then the code: no end of file needed, which a forked copy of
the parent's pipe could hold back), points stdin at ``/dev/null`` and runs the code as
``__main__``. A warm interpreter waits in the read. An uncaught exception prints its traceback
without these frames and exits with status 1, as ``python file.py`` does.
"""

import os
import resource
import sys


def _main() -> None:
    cpu, address, fsize, nproc, nofile, uid = (int(a) for a in sys.argv[1:7])
    limit = resource.setrlimit
    limit(resource.RLIMIT_CORE, (0, 0))
    limit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    limit(resource.RLIMIT_FSIZE, (fsize, fsize))
    limit(resource.RLIMIT_NOFILE, (nofile, nofile))
    if uid >= 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # every capability goes with uid 0
    limit(resource.RLIMIT_NPROC, (nproc, nproc))
    size = int(sys.stdin.buffer.readline() or 0)
    code = sys.stdin.buffer.read(size)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    limit(resource.RLIMIT_AS, (address, address))
    del sys.argv[1:]
    sys.argv[0] = "<code>"
    program = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "<code>", "exec"), program)
    except SystemExit:
        raise
    except BaseException as err:  # noqa: BLE001 - reported as python reports it
        import traceback

        traceback.print_exception(type(err), err, err.__traceback__.tb_next)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed or broken stream
                pass
        os._exit(1)


if __name__ == "__main__":  # python -c runs it as __main__
    _main()
