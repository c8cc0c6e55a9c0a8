"""Each process's share of a split: which files (or records) it reads, so that no record is read
twice in a pass and together the processes read every record. Imports no framework."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Share:
    """What one process reads of a split: its files, and (when there are fewer files than
    processes) its records of them, every ``num_shards``-th from ``shard_index``."""

    files: list[str]
    records: int
    shard: tuple[int, int] | None = None  # (num_shards, index) at the record level


def shares(files: list[str], counts: list[int], processes: int) -> list[Share]:
    """Each process's share of a split, so that no record is read by two processes in one pass
    and together they read every record.

    Files are dealt round-robin (they are sorted, so every process computes the same deal).
    With fewer files than processes, every process reads all of them and keeps every
    ``processes``-th record: slower to read, and said in a warning by the caller.
    """
    if processes == 1:
        return [Share(list(files), sum(counts))]
    if len(files) >= processes:
        return [Share(files[i::processes], sum(counts[i::processes])) for i in range(processes)]
    total = sum(counts)
    return [
        Share(list(files), total // processes + (i < total % processes), (processes, i))
        for i in range(processes)
    ]


def share_warning(split: str, files: list[str], processes: int) -> str | None:
    if processes > 1 and len(files) < processes:
        return (
            f"data.{split}: {len(files)} file(s) for {processes} processes: each process reads "
            f"them all and keeps every {processes}th record. Write at least {processes} shards "
            "(`tpurun data write SOURCE OUT_PREFIX --shard-multiple 8`) so each reads only its own."
        )
    return None
