"""A warm launcher for the vLLM test engines: one process that has imported vLLM (and the
connector) once, forking a child per engine instead of a fresh interpreter importing it again.

    python -m tests.integrations.vllm_zygote SOCKET     # started by `vllm_harness.launcher`

Why: on a 2-vCPU machine, `from vllm import LLM` took 14 s of CPU in every engine process,
twice what the engine then spent starting and serving its rounds. Each child is still a
process of its own (one engine instance per process, as `vllm_driver` requires), forked from
a process with one thread and no engine built, so it starts where a fresh
`python -m tests.integrations.vllm_driver ARGS` would stand after its imports.

Lifecycle: the harness starts it with a pipe on its stdin and reads one `ready` line from its
stdout. Each launch is one connection to SOCKET (SOCK_SEQPACKET): a JSON message {"argv":
driver arguments, "cwd", "env"} carrying the child's stdin, stdout and stderr as file
descriptors; the reply is `pid N`, then `exit CODE` once the child is reaped (a negative CODE:
killed by that signal, as `subprocess` reports it). EOF on stdin (the harness gone) ends it;
children still running are left to finish.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import sys
import traceback


def _preload() -> None:
    """What every engine process imports before it builds its engine (the driver's
    environment first: vLLM reads its logging level at import)."""
    from tests.integrations import vllm_driver

    vllm_driver._env()
    import vllm
    import vllm.config  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    import hicache.integrations.vllm.connector  # noqa: F401


def _child(request: dict[str, object], fds: list[int], close: list[socket.socket]) -> None:
    """In the forked child: become `python -m tests.integrations.vllm_driver ARGV`."""
    code = 1
    try:
        for sock in close:
            sock.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = os.fdopen(0, "r", closefd=False)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        os.chdir(str(request["cwd"]))
        env = request["env"]
        assert isinstance(env, dict)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in env.items()})
        argv = [str(a) for a in request["argv"]]  # type: ignore[attr-defined]
        sys.argv = ["tests/integrations/vllm_driver.py", *argv]
        from tests.integrations import vllm_driver

        code = vllm_driver.main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(path: str) -> None:
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    os.write(1, b"ready\n")
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "launch")
    selector.register(0, selectors.EVENT_READ, "parent")
    running: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select(timeout=0.2):
            if key.data == "parent":
                if not os.read(0, 4096):
                    listener.close()
                    os.unlink(path)
                    return
                continue
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            if len(fds) != 3:
                conn.sendall(f"error: 3 file descriptors, got {len(fds)}".encode())
                conn.close()
                for fd in fds:
                    os.close(fd)
                continue
            pid = os.fork()
            if pid == 0:
                _child(json.loads(message), fds, [listener, conn, *running.values()])
            for fd in fds:
                os.close(fd)
            conn.sendall(f"pid {pid}".encode())
            running[pid] = conn
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = running.pop(pid)
            with contextlib.suppress(OSError):  # the harness stopped waiting for it
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}".encode())
            conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
