"""Which classes this rank holds: the process group by name, every rank's row count, and
``VocabShard`` (local targets, the real rows of a padded vocabulary, class-weight slices).

A ``ProcessGroup`` cannot be an argument of a torch custom op, so the public functions
pass its c10d name (``group_name``) and the ops' implementations resolve it (``group``).

The row counts of the ranks are exchanged once, by an all-gather of one int per rank
(a host sync), the first time a (group, local row count) pair is seen, then cached in
this process: later calls communicate nothing for the layout. One group, one
vocabulary layout: a process that used a group with two heads whose local row counts
are equal on some rank but differ on another would need separate groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, overload

import torch
from torch import Tensor

#: (group name, this rank's rows) -> every rank's rows, in the group's rank order.
_ROW_COUNTS: dict[tuple[str, int], tuple[int, ...]] = {}


def group_name(process_group) -> str:
    """The c10d name of a ``torch.distributed.ProcessGroup`` (what the custom ops take)."""
    return process_group.group_name


def group(name: str):
    """The ``ProcessGroup`` of a c10d group name (inside the ops' implementations)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _comm_device(pg, device: torch.device) -> torch.device:
    """Where a collective of this group takes its tensors: the inputs' device, except CPU
    for a group whose only backend is gloo (whose all-gather wants CPU tensors)."""
    import torch.distributed as dist

    backend = str(dist.get_backend(pg)).lower()
    if device.type != "cpu" and "nccl" not in backend and "gloo" in backend:
        return torch.device("cpu")
    return device


def row_counts(name: str, rows: int, device: torch.device) -> tuple[int, ...]:
    """Every rank's number of local rows (cached per (group, rows): see the module)."""
    key = (name, rows)
    found = _ROW_COUNTS.get(key)
    if found is None:
        import torch.distributed as dist

        pg = group(name)
        dev = _comm_device(pg, device)
        mine = torch.tensor([rows], dtype=torch.int64, device=dev)
        parts = [torch.empty_like(mine) for _ in range(pg.size())]
        dist.all_gather(parts, mine, group=pg)
        found = tuple(int(p.item()) for p in parts)
        if found[pg.rank()] != rows:
            raise RuntimeError(f"row counts {found} of group {name!r} do not hold this rank's {rows}")
        _ROW_COUNTS[key] = found
    return found


@dataclass(frozen=True)
class VocabShard:
    """This rank's part of the vocabulary.

    group: the ProcessGroup; rank rows [0, rows) of the local weight are the global
    classes [start, start + rows); classes at or beyond ``vocab_size`` are padding
    (``real`` local rows are real classes); ``max_rows``: the most rows any rank holds
    (rank-independent sizes for per-chunk collectives); ``total_rows``: the full
    weight's rows (padding included).
    """

    group: object
    start: int
    rows: int
    vocab_size: int
    max_rows: int
    total_rows: int

    @property
    def real(self) -> int:
        """Local rows that are real classes (the rest pad the vocabulary)."""
        return max(0, min(self.rows, self.vocab_size - self.start))

    def local_target(self, target: Tensor) -> Tensor:
        """Global class ids -> local column ids, and -1 (a column no kernel ever matches)
        for targets held by another rank, ignored ones and out-of-range ones."""
        local = target - self.start
        inside = (local >= 0) & (local < self.real)
        return torch.where(inside, local, torch.full_like(local, -1))

    @overload
    def real_rows(self, t: Tensor) -> Tensor: ...
    @overload
    def real_rows(self, t: None) -> None: ...
    @overload
    def real_rows(self, t: Optional[Tensor]) -> Optional[Tensor]: ...

    def real_rows(self, t: Optional[Tensor]) -> Optional[Tensor]:
        """The rows of a local weight or bias that are real classes (a view)."""
        if t is None or t.shape[0] == self.real:
            return t
        return t[: self.real]

    @overload
    def class_slice(self, class_weight: Tensor) -> Tensor: ...
    @overload
    def class_slice(self, class_weight: None) -> None: ...
    @overload
    def class_slice(self, class_weight: Optional[Tensor]) -> Optional[Tensor]: ...

    def class_slice(self, class_weight: Optional[Tensor]) -> Optional[Tensor]:
        """This rank's real classes of a full (vocab_size,) class-weight vector (a view)."""
        if class_weight is None:
            return None
        return class_weight[self.start : self.start + self.real]

    @overload
    def pad_rows(self, grad: Tensor) -> Tensor: ...
    @overload
    def pad_rows(self, grad: None) -> None: ...
    @overload
    def pad_rows(self, grad: Optional[Tensor]) -> Optional[Tensor]: ...

    def pad_rows(self, grad: Optional[Tensor]) -> Optional[Tensor]:
        """A gradient of the real rows -> one of all local rows, 0 in the padding rows."""
        if grad is None or grad.shape[0] == self.rows:
            return grad
        out = grad.new_zeros((self.rows, *grad.shape[1:]))
        out[: grad.shape[0]] = grad
        return out


def vocab_shard(name: str, rows: int, device: torch.device, vocab_size: int = -1) -> VocabShard:
    """The ``VocabShard`` of this rank for a local weight of ``rows`` rows (module
    docstring for the communication). ``vocab_size`` -1: every row of the full weight
    is a class; else the real classes, at most the full weight's rows (ValueError)."""
    pg = group(name)
    counts = row_counts(name, rows, device)
    total = sum(counts)
    if vocab_size < 0:
        vocab_size = total
    elif vocab_size > total:
        raise ValueError(
            f"vocab_size={vocab_size} exceeds the {total} rows of the full weight (the ranks hold {list(counts)})")
    if vocab_size == 0:
        raise ValueError(f"the full weight has no rows (the ranks of group {name!r} hold {list(counts)})")
    start = sum(counts[: pg.rank()])
    return VocabShard(group=pg, start=start, rows=rows, vocab_size=vocab_size, max_rows=max(counts),
                      total_rows=total)
