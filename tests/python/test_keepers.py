"""Who keeps a storage, and releasing one (DeepSpeed #8032)."""

import pytest
import torch

import spillway
from conftest import stat


def test_keepers_of_a_plain_tensor_are_its_external_holders():
    t = torch.randn(100)
    assert spillway.keepers(t) == [{"kind": "external", "count": 1}]
    view = t[10:]
    assert spillway.keepers(t) == [{"kind": "external", "count": 2}]
    del view


def test_keepers_list_saved_views_with_geometry():
    x = torch.randn(32, 32, requires_grad=True)
    with spillway.offload("off", min_bytes=0):
        y = x.exp()            # exp saves its output y
        z = y.t()              # a view: another holder of y's storage
        w = (y[4:] * y[4:]).sum()  # mul saves both sliced views
    kept = spillway.keepers(y)
    saved = [k for k in kept if k["kind"] == "saved"]
    assert {"kind": "saved", "shape": (32, 32), "stride": (32, 1), "offset": 0} in saved
    assert {"kind": "saved", "shape": (28, 32), "stride": (32, 1), "offset": 128} in saved
    external = [k for k in kept if k["kind"] == "external"]
    assert external == [{"kind": "external", "count": 2}]  # y and z
    w.backward()
    del z


def test_release_frees_a_padded_base_that_a_view_still_holds():
    """A padded base buffer with a true-shape view: dropping the base tensor frees nothing while
    the view holds the storage; release() frees it and says who else held it."""
    padded = torch.zeros(1024 * 1024 + 37)  # ~4 MiB, padded
    param = padded[: 1024 * 1024].view(1024, 1024)
    holder = padded[:10]
    del padded
    before = stat("allocated_bytes.all.current")
    report = spillway.release(param)
    assert report["freed_bytes"] == (1024 * 1024 + 37) * 4
    # `holder`, the view nobody cleared, and `padded` itself: deleting the name does not free a
    # base that its views keep alive (their `_base`).
    assert report["other_holders"] == 2
    assert report["keepers"] == [{"kind": "external", "count": 3}]
    assert before - stat("allocated_bytes.all.current") >= (1024 * 1024 + 37) * 4
    assert param.untyped_storage().nbytes() == 0 if hasattr(param, "untyped_storage") else True
    del holder


def test_release_refuses_memory_that_is_not_spillways():
    """User review: release(torch.from_numpy(a)) reported 4000 bytes freed, though the memory is
    numpy's and stays allocated."""
    import numpy as np
    a = np.arange(1000, dtype=np.float32)
    t = torch.from_numpy(a)
    with pytest.raises(ValueError, match="this tensor's memory is not Spillway's"):
        spillway.release(t)
    assert t.untyped_storage().nbytes() == 4000 if hasattr(t, "untyped_storage") else True
    assert torch.equal(t, torch.arange(1000, dtype=torch.float32))  # untouched


def test_release_refuses_a_tensor_on_a_device_spillway_does_not_serve():
    """Python review: a meta tensor (no memory, so the ownership check passed) was "released":
    its storage emptied to 0 bytes, with a report of success."""
    t = torch.empty(3, device="meta")
    with pytest.raises(ValueError, match="a tensor on meta is not on the device Spillway serves"):
        spillway.release(t)
    assert t.shape == (3,)
    storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    assert storage.nbytes() == 12


def test_release_refuses_a_second_storage_over_spillways_memory():
    """Review: release(torch.from_numpy(t.numpy())) reported t's bytes freed, though t still
    holds them."""
    t = torch.arange(1000, dtype=torch.float32)
    alias = torch.from_numpy(t.numpy())
    with pytest.raises(ValueError, match="a second storage over Spillway's memory"):
        spillway.release(alias)
    assert torch.equal(alias, torch.arange(1000, dtype=torch.float32))
    del alias
    assert spillway.release(t)["freed_bytes"] == 4000  # through its own storage, it does


def test_release_refuses_a_storage_saved_for_backward():
    x = torch.randn(64, 64, requires_grad=True)
    with spillway.offload("off", min_bytes=0):
        y = x.exp()
        loss = y.sum()
    with pytest.raises(ValueError, match="saved for backward"):
        spillway.release(y)
    loss.backward()  # untouched: backward still works
    assert torch.equal(x.grad, x.detach().exp())


class Tagged(torch.Tensor):
    """A Python subclass: Spillway keeps its saves as they are, in Python."""


def test_release_refuses_a_storage_a_kept_subclass_save_needs():
    """Review: a save of a tensor subclass has no engine entry, so release() saw no keeper, freed
    the storage, and backward read through a null pointer (a crash)."""
    w = torch.randn(64, requires_grad=True)
    t = torch.randn(64)
    with spillway.offload("eager", min_bytes=0):
        loss = (w * t.as_subclass(Tagged)).sum()  # mul saves its inputs, a Tagged among them
    with pytest.raises(ValueError, match=r"1 tensor\(s\) saved .* kept as they are \(tensor subcl"):
        spillway.release(t)
    loss.backward()  # untouched
    assert torch.equal(w.grad, t)
    del loss  # the graph and its saves are gone: nothing keeps t's storage for backward now
    assert spillway.release(t)["freed_bytes"] == 64 * 4


def test_keepers_and_residency_see_saves_kept_as_they_are():
    """Python review: a subclass save, which release() refuses for, was an anonymous external
    holder to keepers() and no saved tensor at all to residency()."""
    w = torch.randn(8, 8, requires_grad=True)
    t = torch.randn(8, 8)
    with spillway.offload("eager", min_bytes=0):
        loss = (w * t.t().as_subclass(Tagged)).sum()  # mul saves the transposed Tagged view
    assert spillway.keepers(t) == [
        {"kind": "saved", "shape": (8, 8), "stride": (1, 8), "offset": 0},
        {"kind": "external", "count": 1}]  # t itself
    assert spillway.residency(t) == "resident"
    loss.backward()
    del loss
    assert spillway.keepers(t) == [{"kind": "external", "count": 1}]
    assert spillway.residency(t) is None


def test_a_forced_release_of_a_kept_storage_leaves_its_next_owner_free_to_release():
    """Review: kept saves were counted by address; after a forced release the next tensor given
    that block was refused as if the kept save were its own."""
    w = torch.randn(64, requires_grad=True)
    t = torch.randn(64)
    with spillway.offload("eager", min_bytes=0):
        loss = (w * t.as_subclass(Tagged)).sum()
    spillway.release(t, force=True)
    x = torch.zeros(64)  # the caching allocator hands it the freed block
    assert spillway.release(x)["freed_bytes"] == 64 * 4
    del loss


def test_release_refuses_a_tensor_that_requires_grad():
    """User review: release(y) of an output that autograd saved outside Spillway's hooks crashed
    the process at backward; a parameter released broke the next forward."""
    w = torch.randn(256, 256, requires_grad=True)
    y = (torch.randn(256, 256) @ w).tanh()  # tanh saves y, outside any offload block
    loss = y.sum()
    for t in (y, w):
        with pytest.raises(ValueError, match="requires grad"):
            spillway.release(t)
    loss.backward()  # untouched
    assert w.grad is not None and torch.isfinite(w.grad).all()
    t = torch.randn(64, requires_grad=True)
    assert spillway.release(t, force=True)["freed_bytes"] == 64 * 4


def test_backward_after_a_forced_release_fails_clearly():
    """release(force=True) frees what backward needs: its unpack must fail, naming the release,
    not read freed (or freshly allocated) memory. (The spilled case is in the engine's tests: a
    storage the caller can pass in has a holder, so it is never spilled.)"""
    a = torch.randn(1024, 1024, requires_grad=True)
    with spillway.offload("off"):
        h = a * 2
        y = h.sin()  # saves h
    spillway.release(h, force=True)
    with pytest.raises(RuntimeError, match=r"release\(force=True\)"):
        y.sum().backward()


def test_a_released_storage_resized_and_saved_again_backs_the_new_save():
    """A storage released by force, then resized (given memory again) and saved by a new graph:
    that graph's backward reads the new bytes, bitwise as without offload. (The new save joined
    the failed one, and its backward raised "freed by spillway.release(force=True)".) The old
    graph's backward still fails: the in-place resize changed what it saved."""
    a = torch.randn(256, 256, requires_grad=True)
    h = torch.randn(256, 256)
    with spillway.offload("eager", min_bytes=0):
        old = (h * a).sum()  # mul saves h for a's gradient
    spillway.release(h, force=True)
    h.resize_(0).resize_(256, 256).copy_(torch.randn(256, 256))  # same sizes alone: no-op
    b = torch.randn(256, 256, requires_grad=True)
    expected = torch.autograd.grad((h * b).sum(), b)[0]
    spills = stat("spillway.num_spills")
    with spillway.offload("eager", min_bytes=0):
        new = (h * b).sum()
        del h  # only the save keeps it now: eager spills it as the block ends
    assert stat("spillway.num_spills") == spills + 1
    (got,) = torch.autograd.grad(new, b)
    assert torch.equal(got, expected)
    with pytest.raises(RuntimeError, match=r"release\(force=True\)|modified by an inplace"):
        old.backward()


SAVED_256 = {"kind": "saved", "shape": (256, 256), "stride": (256, 1), "offset": 0}


def test_saves_a_forced_release_lost_are_keepers_that_release_need_not_spare():
    """A storage released by force, given memory again, and saved by a new graph: keepers(),
    residency() and the snapshot name the old graph's save too, lost; release() refuses for the
    new save, and not for the lost one alone."""
    a = torch.randn(256, 256, requires_grad=True)
    h = torch.randn(256, 256)
    with spillway.offload("off", min_bytes=0):
        old = (h * a).sum()
    spillway.release(h, force=True)
    assert spillway.keepers(h) == [SAVED_256 | {"lost": True}, {"kind": "external", "count": 1}]
    h.resize_(0).resize_(256, 256).copy_(torch.randn(256, 256))
    b = torch.randn(256, 256, requires_grad=True)
    with spillway.offload("off", min_bytes=0):
        new = (h * b).sum()
    assert spillway.keepers(h) == [SAVED_256 | {"lost": True}, SAVED_256,
                                   {"kind": "external", "count": 1}]
    assert spillway.residency(h) == "resident"  # the new save's
    block = spillway.snapshot()["spillway"]["blocks"][h.data_ptr()]
    assert block["keepers"] == [SAVED_256 | {"lost": True}, SAVED_256]
    with pytest.raises(ValueError, match="1 tensor"):
        spillway.release(h)  # the new save needs it
    del new
    assert spillway.residency(h) == "failed"
    entries = [e for e in spillway.snapshot()["spillway"]["entries"]
               if e["address"] == h.data_ptr()]
    assert [e["keepers"] for e in entries] == [[SAVED_256 | {"lost": True}]]
    assert spillway.release(h)["freed_bytes"] == 256 * 256 * 4  # nothing left to corrupt
    with pytest.raises(RuntimeError, match=r"release\(force=True\)|modified by an inplace"):
        old.backward()


def test_a_released_storage_saved_again_after_its_new_saves_went_still_spills():
    """The released storage's new entry goes with its saves while the old graph keeps the failed
    one; a third save must not count the old entry's hold on the storage as the program's (it
    did, and that save was never spilled)."""
    a = torch.randn(256, 256, requires_grad=True)
    h = torch.randn(256, 256)
    with spillway.offload("eager", min_bytes=0):
        old = (h * a).sum()
    spillway.release(h, force=True)
    h.resize_(0).resize_(256, 256).copy_(torch.randn(256, 256))
    b = torch.randn(256, 256, requires_grad=True)
    with spillway.offload("eager", min_bytes=0):
        new = (h * b).sum()
    del new  # its saves go: the storage has no entry now but the failed one
    expected = torch.autograd.grad((h * b).sum(), b)[0]
    # The old graph's save still keeps the storage, its bytes lost; h is the one other holder.
    # (Unseen, it counted as a second external holder.)
    assert spillway.keepers(h) == [SAVED_256 | {"lost": True}, {"kind": "external", "count": 1}]
    spills = stat("spillway.num_spills")
    with spillway.offload("eager", min_bytes=0):
        third = (h * b).sum()
        del h
    assert stat("spillway.num_spills") == spills + 1
    assert torch.equal(torch.autograd.grad(third, b)[0], expected)
    del old


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="expects a torch.Tensor"):
        spillway.keepers([1, 2, 3])
    with pytest.raises(ValueError, match="expects a torch.Tensor"):
        spillway.release("tensor")


def test_saves_kept_over_spillways_memory_by_another_storage_are_seen():
    """Hooks review: a save of a second storage over Spillway's memory (from_numpy, DLPack) is
    kept as it is; release(t) freed t's memory under it without force, and backward computed a
    wrong gradient from whatever the memory held next (no error)."""
    w = torch.randn(256, requires_grad=True)
    t = torch.randn(256, 256)
    alias = torch.from_numpy(t.numpy())
    reference = w.detach().clone().requires_grad_()
    (alias @ reference).sum().backward()  # the gradient without offload
    with spillway.offload("eager", min_bytes=0):
        loss = (alias @ w).sum()  # mm saves the alias
    saved = {"kind": "saved", "shape": (256, 256), "stride": (256, 1), "offset": 0}
    assert saved in spillway.keepers(t)
    assert spillway.residency(t) == "resident"
    with pytest.raises(ValueError, match="kept as they are"):
        spillway.release(t)
    address = t.untyped_storage().data_ptr() if hasattr(t, "untyped_storage") else \
        t.storage().data_ptr()
    assert spillway.snapshot()["spillway"]["blocks"][address]["keepers"] == [saved]
    junk = torch.full((256, 256), 1e6)  # would take the block, had it been freed
    loss.backward()
    assert torch.equal(w.grad, reference.grad)
    del loss, junk
    assert saved not in spillway.keepers(t)
    assert spillway.residency(t) is None
    del alias
    assert spillway.release(t)["freed_bytes"] == 256 * 256 * 4


def test_nested_tensor_saves_keep_their_memory_from_release():
    """Hooks review: release(nt) of a nested tensor a Linear had saved freed its buffer; backward
    then failed with a shape error that named nothing of the cause."""
    parts = [torch.randn(4, 8), torch.randn(6, 8)]
    nt = torch.nested.nested_tensor(parts)
    lin = torch.nn.Linear(8, 3)
    sum(p.sum() for p in lin(nt).unbind()).backward()  # the gradient without offload
    expected = lin.weight.grad.clone()
    lin.weight.grad = None
    with spillway.offload("eager", min_bytes=0):
        out = lin(nt)
    with pytest.raises(ValueError, match="kept as they are"):
        spillway.release(nt)
    # Its view is the buffer it keeps, not the shape () of a scalar.
    assert [k for k in spillway.keepers(nt) if k["kind"] == "saved"] == [
        {"kind": "saved", "shape": (80,), "stride": (1,), "offset": 0, "nested": True}]
    sum(p.sum() for p in out.unbind()).backward()
    assert torch.equal(lin.weight.grad, expected)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_saves_keep_their_memory_from_release(layout):
    """Hooks review: a sparse save (kept as it is) registered nothing, since storage() refuses
    sparse tensors: release() of its values freed them, and backward then crashed the process."""
    torch.manual_seed(0)
    dense = torch.randn(64, 64) * (torch.rand(64, 64) < 0.2)
    sp = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    values = sp._values() if layout == "coo" else sp.values()
    w = torch.randn(64, 8, requires_grad=True)
    (sp @ w).sum().backward()  # the gradient without offload
    expected = w.grad.clone()
    w.grad = None
    with spillway.offload("eager", min_bytes=0):
        loss = (sp @ w).sum()
    with pytest.raises(ValueError, match="kept as they are"):
        spillway.release(values)
    assert [k for k in spillway.keepers(values) if k["kind"] == "saved"] == [
        {"kind": "saved", "shape": tuple(values.shape), "stride": (1,), "offset": 0}]
    loss.backward()
    assert torch.equal(w.grad, expected)


def test_the_release_log_is_not_the_callers_to_change():
    """Hooks review: release() returned the dict its log keeps, and snapshots handed out the log
    itself: a caller's change corrupted every later snapshot (report then refused the file)."""
    returned = spillway.release(torch.randn(1000))
    returned.clear()
    spillway.snapshot()["spillway"]["releases"].append("junk")
    spillway.snapshot()["spillway"]["releases"][-1]["keepers"].clear()
    last = spillway.snapshot()["spillway"]["releases"][-1]
    assert last == {"freed_bytes": 4000, "other_holders": 0,
                    "keepers": [{"kind": "external", "count": 1}]}


def test_a_kept_save_follows_its_storage_when_it_is_resized():
    """Diff review: kept saves were filed under the block their data was in when saved; resized,
    the storage moved to another block, release(t) went through without force (backward then read
    freed memory) and the tensor given the old block was refused."""
    w = torch.randn(64, requires_grad=True)
    t = torch.randn(64)
    with spillway.offload("eager", min_bytes=0):
        loss = (w * t.as_subclass(Tagged)).sum()  # the save shares t's storage
    t.resize_(4096)  # the storage moves to a larger block
    u = torch.randn(64)  # may be given the block t's storage left
    assert spillway.release(u)["freed_bytes"] == 64 * 4
    with pytest.raises(ValueError, match="kept as they are"):
        spillway.release(t)
    del loss


def test_snapshots_count_kept_saves_as_saves_not_as_other_holders():
    """Diff review: a storage saved both ways and held by nothing else showed one holder unknown
    to Spillway in snapshots (the kept save's own tensor), so report left it out of the storages
    that only saves keep alive."""
    w = torch.randn(64, requires_grad=True)
    t = torch.randn(64)
    with spillway.offload("off", min_bytes=0):
        loss = (w * t).sum() + (w * t.as_subclass(Tagged)).sum()
    # t's own data pointer (offset 0): a Python storage object, once made, may hold the storage
    # itself (torch 2.11 counted one holder more than 1.13 after t.untyped_storage()).
    address = t.data_ptr()
    del t
    block = spillway.snapshot()["spillway"]["blocks"][address]
    assert block["external_holders"] == 0
    assert len(block["keepers"]) == 2
    entry = [e for e in spillway.snapshot()["spillway"]["entries"] if e["address"] == address]
    assert entry[0]["external_holders"] == 0
    del loss
