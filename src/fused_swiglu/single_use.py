"""What a traced training forward keeps, overwritten in place by its backward at most once.

The traced ops (training_ops.py) are functional to the compiler: the backward op declares no mutation.
Yet overwriting the kept tensor in place is what keeps the traced step's memory at the eager step's
(a gradient buffer of its own cost the kept tensor's size more: NOTES.md items 50 and 51). This
ledger makes the overwrite safe. The forward op issues its kept tensor's storage; the backward op
spends it, and only a storage issued and not yet spent is overwritten:

- a second walk of a retained graph finds its storage spent, and is refused;
- a tensor that is not the one the forward made (a copy from saved-tensor hooks such as
  ``torch.autograd.graph.save_on_cpu``) was never issued, and gets a buffer of its own instead.

Entries hold weak references: they keep no memory alive, no new storage takes the address of one
whose entry is held, and entries of storages that died are dropped as new ones come.
"""

from __future__ import annotations

import enum
import threading

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class Ticket(enum.Enum):
    """What ``spend`` found: the forward's storage, unspent until now; one already spent; another."""

    UNSPENT = "unspent"
    SPENT = "spent"
    FOREIGN = "foreign"


_LEDGER: dict[int, tuple[StorageWeakRef, bool]] = {}  # storage address -> (weak ref, spent)
_LOCK = threading.Lock()  # the backward runs on autograd's device threads
_MIN_PRUNE_AT = 64
_prune_at = _MIN_PRUNE_AT  # entries whose storage died are dropped once the ledger grows to this


def issue(kept: torch.Tensor) -> None:
    """Records ``kept``'s storage, made by a forward just now, as unspent."""
    global _prune_at
    ref = StorageWeakRef(kept.untyped_storage())
    with _LOCK:
        if len(_LEDGER) >= _prune_at:
            for key in [key for key, (old, _) in _LEDGER.items() if old.expired()]:
                del _LEDGER[key]
            # Twice what is alive: pruning stays amortized O(1) with many layers' tensors alive at once.
            _prune_at = max(_MIN_PRUNE_AT, 2 * len(_LEDGER))
        _LEDGER[ref.cdata] = (ref, False)


def spend(kept: torch.Tensor) -> Ticket:
    """Marks ``kept``'s storage spent if it was issued and unspent; says what it found."""
    key = kept.untyped_storage()._cdata
    with _LOCK:
        entry = _LEDGER.get(key)
        if entry is None:
            return Ticket.FOREIGN
        if entry[1]:
            return Ticket.SPENT
        _LEDGER[key] = (entry[0], True)
        return Ticket.UNSPENT
