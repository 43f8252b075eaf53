"""FSDP's free/refill of the gathered flat parameter, done by hand on Spillway memory in this
process (two FSDP units, world size 1): the gathered buffer is freed (resized to 0) after forward
while views of it are saved for backward, and gathered again before backward reads them. Offload
spills the activations around it, never the gathered parameters, and the gradients are bitwise
those of a run without offload."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import spillway
from conftest import assert_bitwise_equal, stat

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="this torch has no torch.distributed with gloo")

SHAPES = [(256, 256), (256,), (256, 256)]
SIZES = [torch.Size(s).numel() for s in SHAPES]
NUMEL = sum(SIZES)


def resize_storage(t, numel):
    """FSDP's _free_storage / _alloc_storage."""
    if hasattr(t, "untyped_storage"):
        t.untyped_storage().resize_(numel * t.element_size())
    else:
        t.storage().resize_(numel)


class FlatUnit:
    """One FSDP unit (world size 1): a flat parameter that holds its shard between uses; forward
    all-gathers into a padded buffer, points the flat parameter at it and uses views of it as
    the layer's weights; after forward the buffer's storage is freed (resized to 0); a hook on the
    output regathers it before backward reads the saved views."""

    def __init__(self, seed, probe):
        g = torch.Generator().manual_seed(seed)
        self.shard = torch.randn(NUMEL, generator=g) * 0.05
        self.flat = torch.nn.Parameter(self.shard.clone())
        self.flat.data = self.shard
        self.padded = torch.empty(NUMEL)
        resize_storage(self.padded, 0)
        self.probe = probe
        self.junk = []

    def unshard(self):
        resize_storage(self.padded, NUMEL)
        with torch.no_grad():
            self.padded.copy_(self.shard)  # the all-gather
        self.flat.data = self.padded

    def reshard(self):
        self.flat.data = self.shard
        resize_storage(self.padded, 0)
        # Whatever now takes the freed block is garbage: a saved view that still pointed there
        # would make the gradients NaN.
        self.junk.append(torch.full((NUMEL,), float("nan")))

    def __call__(self, x, free_refill=True):
        if free_refill:
            self.unshard()
        w1, b1, w2 = (t.view(s) for t, s in zip(self.flat.split(SIZES), SHAPES))
        h = F.linear(x, w1, b1)  # saves x and a view of w1
        self.probe(self, "linear1")
        a = torch.tanh(h)        # saves a (an activation, spillable)
        self.probe(self, "tanh")
        out = F.linear(a, w2)    # saves a and a view of w2
        self.probe(self, "linear2")
        if free_refill:
            self.reshard()
            self.probe(self, "freed")

            def pre_backward(grad):
                self.unshard()
                self.probe(self, "refilled")
                return grad

            out.register_hook(pre_backward)
        return out


def fsdp_like_step(policy, free_refill=True):
    states = []

    def probe(unit, where):
        if policy is not None and free_refill:
            kinds = [k["kind"] for k in spillway.keepers(unit.padded)]
            states.append((where, spillway.residency(unit.padded), kinds))

    units = [FlatUnit(11, probe), FlatUnit(12, probe)]
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(13), requires_grad=True)
    spillway.synchronize()
    spills, to_host = stat("spillway.num_spills"), stat("spillway.bytes_to_host")
    if policy is None:
        loss = units[1](units[0](x, free_refill), free_refill).square().sum()
    else:
        budget = 1 << 20 if policy == "auto" else None
        with spillway.offload(policy, budget_bytes=budget, min_bytes=0, prefetch_bytes=1 << 16):
            loss = units[1](units[0](x, free_refill), free_refill).square().sum()
    spillway.synchronize()
    spilled = (stat("spillway.num_spills") - spills, stat("spillway.bytes_to_host") - to_host)
    loss.backward()
    grads = [u.flat.grad.clone() for u in units] + [x.grad.clone()]
    leftover = [[k for k in spillway.keepers(u.padded) if k["kind"] == "saved"] for u in units]
    for u in units:  # FSDP's post-backward reshard
        resize_storage(u.padded, 0)
    return loss.item(), grads, states, spilled, leftover


@pytest.mark.parametrize("policy", ["eager", "auto"])
def test_fsdp_free_and_refill_of_gathered_parameters(policy):
    ref_loss, reference, _, _, _ = fsdp_like_step(None, free_refill=False)
    plain_loss, plain, _, _, _ = fsdp_like_step(None)
    assert plain_loss == ref_loss
    assert_bitwise_equal(plain, reference)

    loss, grads, states, (spills, to_host), leftover = fsdp_like_step(policy)
    assert loss == ref_loss
    for g in grads:
        assert not torch.isnan(g).any()
    assert_bitwise_equal(grads, reference)
    # Offload was active: activations went to host ...
    assert spills > 0 and to_host > 0
    # ... but never the gathered parameters: each holds 513 KiB, more than all spilled bytes.
    assert to_host < NUMEL * 4, to_host
    # Spillway saw the saved parameter views and kept their storage resident throughout, also
    # while it was freed (0 bytes) between forward and backward, and after the refill.
    assert [where for where, _, _ in states] == (["linear1", "tanh", "linear2", "freed"] * 2
                                                 + ["refilled"] * 2)
    for where, residency, kinds in states:
        assert residency in ("resident", None), (where, residency)
        assert "saved" in kinds, (where, kinds)
    # Backward released every saved view.
    assert leftover == [[], []]
