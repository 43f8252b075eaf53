"""Views come back exactly: one storage, every view with its sizes, strides and offset."""

import pytest
import torch

import spillway
from conftest import assert_bitwise_equal, stat


class CheckView(torch.autograd.Function):
    """Saves `view` for backward and checks, there, that it came back as it was saved."""

    @staticmethod
    def forward(ctx, x, view, expected):
        ctx.save_for_backward(view)
        ctx.expected = expected
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (view,) = ctx.saved_tensors
        exp = ctx.expected
        assert view.shape == exp["shape"]
        assert view.stride() == exp["stride"]
        assert view.storage_offset() == exp["offset"]
        assert torch.equal(view, exp["values"])
        return grad * 2, None, None


def make_view(kind, base):
    if kind == "expand":
        return base[:, :1].expand(-1, 64)
    if kind == "transpose":
        return base.t()
    if kind == "slice":
        return base[3:40:3, 5:]
    if kind == "as_strided_overlap":
        return base.as_strided((60, 32), (2, 1), 7)
    if kind == "noncontiguous":
        return base[:, ::2]
    raise AssertionError(kind)


def run_spilling_one_storage(forward):
    """Runs `forward` under eager offload and returns its output once its one saved storage is
    spilled (the copy to the host done), so that backward reads it back from the host."""
    spills = stat("spillway.num_spills")
    with spillway.offload("eager", min_bytes=0, prefetch_bytes=0):
        out = forward()
    spillway.synchronize()
    assert stat("spillway.num_spills") == spills + 1
    return out


@pytest.mark.parametrize("kind", ["expand", "transpose", "slice", "as_strided_overlap",
                                  "noncontiguous"])
def test_view_comes_back_with_exact_geometry(kind):
    x = torch.randn(64, 64, requires_grad=True)

    def forward():
        # Base and view die when this returns, as a model's intermediates do: only the saved view
        # keeps the storage then.
        base = torch.randn(64, 64) * 3
        view = make_view(kind, base)
        expected = {"shape": view.shape, "stride": view.stride(),
                    "offset": view.storage_offset(), "values": view.clone()}
        return CheckView.apply(x, view, expected)

    out = run_spilling_one_storage(forward)
    out.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_saved_view_whose_base_is_dead_spills_the_whole_storage():
    """DeepSpeed #8387: the view keeps the whole allocation; spilling it is what frees it."""
    x = torch.randn(256, 256, requires_grad=True)
    to_host = stat("spillway.bytes_to_host")
    allocated = stat("allocated_bytes.all.current")

    def forward():
        base = torch.relu(torch.randn(512, 256))  # 512 KiB storage
        view = base[:16]                           # 16 KiB view of it
        expected = {"shape": view.shape, "stride": view.stride(), "offset": 0,
                    "values": view.clone()}
        return CheckView.apply(x, view, expected)

    with spillway.offload("eager", min_bytes=0, prefetch_bytes=0):
        out = forward()
    spillway.synchronize()
    assert stat("spillway.bytes_to_host") - to_host == 512 * 256 * 4
    # The 512 KiB block is gone from the device, not just the 16 KiB the view spans.
    assert stat("allocated_bytes.all.current") - allocated < 512 * 256 * 4
    out.sum().backward()


def test_base_and_view_saved_together_spill_once():
    """TRL dedup: two keepers, one entry, one device-to-host copy."""
    w = torch.randn(128, 128, requires_grad=True)

    def forward():
        a = torch.relu(w @ w)      # relu saves its output a
        b = a.t()                  # a view of a's storage
        return (a * b).sum()       # mul saves a and b

    torch.manual_seed(1)
    forward().backward()
    reference = w.grad.clone()
    w.grad = None
    spills, to_host = stat("spillway.num_spills"), stat("spillway.bytes_to_host")
    with spillway.offload("eager", min_bytes=0, prefetch_bytes=0):
        loss = forward()
    spillway.synchronize()
    # relu saved a, mul saved a and its transpose b: three keepers, one storage, one copy. (mm
    # saved only w, which the caller holds.)
    assert stat("spillway.num_spills") - spills == 1
    assert stat("spillway.bytes_to_host") - to_host == 128 * 128 * 4
    loss.backward()
    assert_bitwise_equal([w.grad], [reference])


def test_conj_and_neg_bits_come_back():
    x = torch.randn(64, 64, dtype=torch.complex64, requires_grad=True)

    def forward():
        base = torch.randn(64, 64, dtype=torch.complex64)
        view = base.conj()
        assert view.is_conj()
        expected = {"shape": view.shape, "stride": view.stride(), "offset": 0,
                    "values": view.resolve_conj()}
        return CheckView.apply(x, view, expected)

    out = run_spilling_one_storage(forward)
    out.real.sum().backward()


def test_a_storage_resized_after_its_first_save_is_not_spilled_short():
    """Review: a storage grown in place (resize_, an out= op) after its first save kept the entry
    made at that save, with the old size: the spill copied only the old bytes, and a later save
    that reached past them read garbage in backward."""
    w = torch.ones(512, requires_grad=True)
    buf = torch.zeros(256)
    skipped = spillway.memory_stats().get("spillway.skipped.resized", 0)
    with spillway.offload("eager", min_bytes=0, prefetch_bytes=0):
        first = (w[:256] * buf).sum()  # saves buf: an entry of 1 KiB (never run backward)
        buf.resize_(512).fill_(3.0)  # the same storage, 2 KiB now
        loss = (w * buf).sum()  # saves buf again, all 2 KiB of it
        del buf
    spillway.synchronize()
    junk = torch.full((512,), -7.0)  # takes whatever block was freed
    loss.backward()
    assert torch.equal(w.grad, torch.full((512,), 3.0)), w.grad
    assert stat("spillway.skipped.resized") == skipped + 1
    del junk, first


def test_a_storage_shrunk_after_the_save_raises_at_unpack_naming_the_bytes():
    """Unpack builds the saved view on its storage directly (no set_): the view must still fit.
    A storage shrunk in place after the save has no bytes for it, and backward raises, naming
    the tensor and both sizes, where reading past the storage's end would be garbage."""
    w = torch.ones(256, requires_grad=True)
    buf = torch.ones(256)
    with spillway.offload("off"):
        loss = (w * buf).sum()  # saves buf, 1 KiB, for w's gradient
    buf.untyped_storage().resize_(512)
    with pytest.raises(RuntimeError, match=r"Float\[256\] cannot be used in backward: its view "
                                           r"needs 1024 bytes of its storage, which holds 512"):
        loss.backward()
