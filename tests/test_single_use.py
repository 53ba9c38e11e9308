"""The ledger that lets a traced backward overwrite what its forward kept at most once."""

import torch

from fused_swiglu import single_use
from fused_swiglu.single_use import Ticket


def test_an_issued_storage_is_spent_once():
    kept = torch.randn(6, 8)
    single_use.issue(kept)
    assert single_use.spend(kept) is Ticket.UNSPENT
    assert single_use.spend(kept) is Ticket.SPENT
    assert single_use.spend(kept) is Ticket.SPENT


def test_an_alias_of_the_storage_is_the_same_entry():
    """The compiler may hand the backward a view or a reinterpreted alias of what the forward made."""
    kept = torch.randn(6, 8)
    single_use.issue(kept)
    alias = torch.as_strided(kept, (8, 6), (1, 8))
    assert single_use.spend(alias) is Ticket.UNSPENT
    assert single_use.spend(kept[2:]) is Ticket.SPENT


def test_a_copy_or_a_tensor_never_issued_is_foreign():
    kept = torch.randn(6, 8)
    single_use.issue(kept)
    assert single_use.spend(kept.clone()) is Ticket.FOREIGN
    assert single_use.spend(torch.randn(6, 8)) is Ticket.FOREIGN
    assert single_use.spend(kept) is Ticket.UNSPENT


def test_reissuing_a_storage_makes_it_unspent_again():
    """A forward that runs again (activation checkpointing's recompute) issues its new kept tensor."""
    kept = torch.randn(6, 8)
    single_use.issue(kept)
    single_use.spend(kept)
    single_use.issue(kept)
    assert single_use.spend(kept) is Ticket.UNSPENT


def test_the_ledger_keeps_nothing_alive_and_drops_dead_entries():
    kept = torch.randn(6, 8)
    single_use.issue(kept)
    ref, _ = single_use._LEDGER[kept.untyped_storage()._cdata]
    del kept
    assert ref.expired()
    alive = [torch.randn(3) for _ in range(100)]  # e.g. many layers' forwards before their backwards
    for t in alive:
        single_use.issue(t)
    for _ in range(1000):
        single_use.issue(torch.randn(3))
    assert len(single_use._LEDGER) <= 2 * (len(alive) + 1) + 1
    assert all(single_use.spend(t) is Ticket.UNSPENT for t in alive)


def test_a_new_storage_never_passes_for_a_dead_issued_one():
    """While its entry is held, no new storage takes a dead issued storage's address (the key)."""
    kept = torch.randn(6, 8)
    single_use.issue(kept)
    del kept
    assert all(single_use.spend(torch.randn(6, 8)) is Ticket.FOREIGN for _ in range(500))
