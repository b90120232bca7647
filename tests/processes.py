"""Process checks shared by the tests that start servers or commands."""


def gone(pid: int) -> bool:
    """Exited (a zombie nobody has reaped yet counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def error_line(stderr: str, prog: str) -> str:
    """The one `PROG: error: ...` line a command that stopped printed, asserted to come without a
    traceback. Tests name this line rather than count lines: a busy machine or a cold compilation
    cache adds others (a late health check's warning, XLA's own while a program compiles)."""
    errors = [line for line in stderr.splitlines() if line.startswith(f"{prog}: error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errors[0]
