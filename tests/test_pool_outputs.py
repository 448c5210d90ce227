"""xform.transforms.cudagraphs.pool_outputs: which outputs handed out of a pool are alive, and moving them out of the way."""

from __future__ import annotations

import torch

from xform._torch import memory, versions
from xform.transforms.cudagraphs.pool_outputs import Cleared, Handouts, merge_ranges
from xform.transforms.cudagraphs.recorder import unowned_view


def _range(t: torch.Tensor) -> list[tuple[int, int]]:
    storage = t.untyped_storage()
    return [(storage.data_ptr(), storage.data_ptr() + storage.nbytes())]


def _handed_out(pool: torch.Tensor, registry: Handouts, *, owned: bool = False, on_stuck=None,
                stale=None) -> torch.Tensor:
    """A view of `pool`'s memory that does not own it, registered as a handout (as a replay's)."""
    view = unowned_view(pool)
    registry.add(view.untyped_storage(), owned=owned, on_stuck=on_stuck, stale=stale)
    return view


def test_ranges_are_sorted_and_joined_where_they_touch():
    assert merge_ranges([(30, 40), (0, 10), (10, 20), (35, 50), (60, 60)]) == [(0, 20), (30, 50)]


def test_a_live_handout_in_the_way_is_moved_with_its_views_and_others_stay():
    registry = Handouts()
    pool_a, pool_b = torch.arange(8.0), torch.arange(8.0) + 100
    a, b = _handed_out(pool_a, registry), _handed_out(pool_b, registry)
    a_view = a[2:5]
    cleared = registry.move_out(_range(pool_a))
    assert (cleared.moved, cleared.stuck, cleared.invalidated) == (32, [], 0)
    pool_a.fill_(-1)  # the replay writing there
    pool_b.fill_(-2)
    torch.testing.assert_close(a, torch.arange(8.0))  # moved: its values kept
    torch.testing.assert_close(a_view, torch.arange(2.0, 5.0))
    assert (b == -2).all()  # not in the way: still the pool's memory
    assert [start for start, _, _ in registry.alive()] == [pool_b.data_ptr()]


def test_dead_handouts_cost_nothing_and_are_forgotten():
    registry = Handouts()
    pool = torch.zeros(4)
    out = _handed_out(pool, registry)
    del out
    assert registry.move_out(_range(pool)) == Cleared() and registry.alive() == []


def test_unowned_only_leaves_what_the_allocator_protects():
    registry = Handouts()
    pool_owned, pool_unowned = torch.zeros(4), torch.zeros(4)
    kept = _handed_out(pool_owned, registry, owned=True)
    moved = _handed_out(pool_unowned, registry)
    assert registry.move_out(unowned_only=True).moved == 16
    assert registry.held([kept, moved]) == {0}


def test_without_swapping_only_storages_the_allocator_owns_move(monkeypatch):
    monkeypatch.setattr(versions, "STORAGE_SWAPS_DATA_PTR", False)
    registry = Handouts()
    owned = torch.arange(4.0)  # an allocator's storage: resize_ reallocates it
    registry.add(owned.untyped_storage(), owned=True)
    calls = []
    pool = torch.arange(4.0)
    view = _handed_out(pool, registry, on_stuck=lambda: calls.append("copy from now on"))
    before = owned.data_ptr()
    cleared = registry.move_out()
    stuck = cleared.stuck
    assert cleared.moved == 16 and owned.data_ptr() != before
    torch.testing.assert_close(owned, torch.arange(4.0))
    assert len(stuck) == 1 and view.data_ptr() == pool.data_ptr()  # stuck where it was, still tracked
    stuck[0]()
    assert calls == ["copy from now on"] and len(registry.alive()) == 1


def test_a_stale_handout_in_the_way_is_invalidated_unless_the_call_reads_it(monkeypatch):
    # stale_outputs="error": nothing copied; the storage is invalidated (CUDA builds make reads
    # raise the message; here the call is recorded), except an input of the call about to write
    invalidated = []
    monkeypatch.setattr(memory, "invalidate",
                        lambda storage, message: invalidated.append((storage.data_ptr(), message)))
    registry = Handouts()
    pool_a, pool_b, pool_c = torch.arange(4.0), torch.arange(4.0) + 10, torch.arange(4.0) + 20
    a = _handed_out(pool_a, registry, stale="a is stale")
    b = _handed_out(pool_b, registry, stale="b is stale")
    c = _handed_out(pool_c, registry, stale="c is stale")
    cleared = registry.move_out(merge_ranges(_range(pool_a) + _range(pool_b)), reading=[b])
    assert (cleared.invalidated, cleared.moved, cleared.stuck) == (1, 16, [])
    assert invalidated == [(a.data_ptr(), "a is stale")]  # a: invalidated where it lay
    torch.testing.assert_close(b, torch.arange(4.0) + 10)  # b: read by the call, moved out
    assert b.data_ptr() != pool_b.data_ptr()
    assert [start for start, _, _ in registry.alive()] == [c.data_ptr()]  # c: not in the way
