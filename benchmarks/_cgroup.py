"""Reading and writing cgroup control files, shared by the benchmarks that cap a process
(CPU quota in input_throughput.py, memory limit in tiered_tables.py)."""

from __future__ import annotations


def read_text(path: str) -> str:
    """The file's text, or "" where it does not exist or cannot be read."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def write_text(path: str, text: str) -> None:
    """Writes ``text``; a refusal raises RuntimeError naming the file and the value."""
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise RuntimeError(f"cannot write {text!r} to {path}: {e}") from e
