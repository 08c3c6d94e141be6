"""The tests' name for the package's local-rank launcher (``mist_compiler.launch.local_ranks``), and
the processes a launched job left (``/proc``)."""
import os

from mist_compiler.launch.local_ranks import RankError, free_port, run_ranks


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


__all__ = ["RankError", "descendants", "free_port", "run_ranks"]
