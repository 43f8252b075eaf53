"""Soak: random training-like workloads on the simulated device, each step compared bitwise with
the same step without Spillway's offload, under every policy, with checkpointing (reentrant or
not) on and off, the offload block closed after forward or open through backward, and with a
memory limit tight enough to force the out-of-memory rescue. Device and host memory must return to
their baseline after every step.

    scripts/soak SECONDS        (CI runs 30 seconds)
"""

import random
import sys
import time

import torch
import torch.utils.checkpoint as cp

import spillway

CAPACITY = 512 << 20


class Block(torch.nn.Module):
    """Linear layers plus view-heavy ops: transposes, strided slices, expands, as_strided."""

    def __init__(self, width, rng):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)
        self.kind = rng.randrange(4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.kind == 0:
            h = h * h.t().t()                      # base and view both saved
        elif self.kind == 1:
            half = h[:, ::2]                       # strided slice, saved by mul
            h = torch.cat([half * half, h[:, 1::2]], dim=1)
        elif self.kind == 2:
            col = h[:, :1].expand(-1, h.shape[1])  # stride-0 view
            h = h * col
        else:
            n = h.shape[0] // 2
            win = h.as_strided((n, h.shape[1]), (h.shape[1], 1), h.shape[1])  # overlapping view
            h = torch.cat([win.sigmoid() * win, h[n:]], dim=0)
        return torch.tanh(self.b(h))


def make_model(seed, depth, width):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[Block(width, rng) for _ in range(depth)])


def step(seed, depth, width, batch, checkpoint, offload, whole_step=False):
    """One training step; `checkpoint`: None, "non_reentrant" or "reentrant" (every other block);
    `whole_step`: the offload block stays open through backward (where a reentrant checkpoint's
    recomputation saves through Spillway's hooks too)."""
    model = make_model(seed, depth, width)
    torch.manual_seed(seed + 1)
    # Requiring grad: a reentrant checkpoint gives its region's parameters none otherwise.
    x = torch.randn(batch, width).requires_grad_()

    def forward():
        h = x
        for i, block in enumerate(model):
            if checkpoint and i % 2 == 0:
                h = cp.checkpoint(block, h, use_reentrant=checkpoint == "reentrant")
            else:
                h = block(h)
        return h.square().mean()

    if offload is None:
        forward().backward()
    elif whole_step:
        with offload():
            forward().backward()
    else:
        with offload():
            loss = forward()
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    spillway.install("sim", capacity_bytes=CAPACITY)
    torch.use_deterministic_algorithms(True)
    rng = random.Random(2026)
    baseline = spillway.memory_stats()["allocated_bytes.all.current"]
    counts = {"steps": 0, "mismatches": 0, "leaks": 0, "ooms": 0, "rescues": 0, "spills": 0}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seed = rng.randrange(1 << 30)
        depth, width = rng.randint(2, 6), rng.choice([64, 96, 128, 256])
        batch = rng.choice([64, 128, 256])
        checkpoint = rng.choice(["non_reentrant", "reentrant"]) if rng.random() < 0.3 else None
        whole_step = rng.random() < 0.3
        policy = rng.choice(["eager", "auto", "off"])
        spillway.reset_peak_stats()
        reference = step(seed, depth, width, batch, checkpoint, None)
        peak = spillway.memory_stats()["allocated_bytes.all.peak"] - baseline
        # A limit below what the step needs without offload: only spilling can make it fit.
        tight = rng.random() < 0.5 and policy != "off"
        if tight:
            spillway.empty_cache()
            spillway.set_per_process_memory_fraction((baseline + int(peak * 0.8)) / CAPACITY)
        budget = max(1, peak // 2)
        before = spillway.memory_stats()
        try:
            got = step(seed, depth, width, batch, checkpoint,
                       lambda: spillway.offload(policy, budget_bytes=budget, min_bytes=0,
                                                prefetch_bytes=rng.choice([0, 1 << 16, 1 << 20])),
                       whole_step)
            if any(not torch.equal(a, b) for a, b in zip(got, reference)):
                counts["mismatches"] += 1
                print(f"MISMATCH seed={seed} depth={depth} width={width} policy={policy} "
                      f"checkpoint={checkpoint} whole_step={whole_step}")
            del got
        except RuntimeError as error:  # OutOfMemoryError, or it wrapped by a checkpoint's recompute
            if "out of memory" not in str(error):
                raise
            counts["ooms"] += 1  # it could not fit even with spilling: allowed, but must not leak
        finally:
            spillway.set_per_process_memory_fraction(1.0)  # the whole device again
        del reference  # the step's tensors are gone now: memory must be back at its baseline
        spillway.synchronize()
        after = spillway.memory_stats()
        counts["steps"] += 1
        counts["spills"] += after["spillway.num_spills"] - before["spillway.num_spills"]
        if tight and after["num_alloc_retries"] + after["spillway.num_spills"] > \
                before["num_alloc_retries"] + before["spillway.num_spills"]:
            counts["rescues"] += 1
        if (after["allocated_bytes.all.current"] != baseline
                or after["spillway.host_bytes.current"] != 0
                or after["spillway.num_entries"] != 0):
            counts["leaks"] += 1
            print(f"LEAK seed={seed}: allocated {after['allocated_bytes.all.current'] - baseline}, "
                  f"host {after['spillway.host_bytes.current']}, "
                  f"entries {after['spillway.num_entries']}")
    print("soak: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    ok = counts["mismatches"] == 0 and counts["leaks"] == 0 and counts["steps"] > 0
    print(f"{counts['steps'] if ok else 0} passed, {0 if ok else 1} failed")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
