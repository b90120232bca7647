"""Process checks shared by the tests that start servers."""


def gone(pid: int) -> bool:
    """Exited (a zombie nobody has reaped yet counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
