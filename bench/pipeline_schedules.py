"""Pipeline-parallel schedules on one stage: the model of bench/tiny_lm.py trained in microbatches,
several microbatches' graphs alive at once, with and without Spillway's `eager` offload. Prefetch
walks saves newest first, the order of one graph's backward; a pipeline runs its microbatches'
backwards oldest first (GPipe, 1F1B), so that walk runs out at the end of each microbatch's
backward. From the second step on prefetch goes on where backward went next in the step before,
unless a forward came between (1F1B's steady state). The reversed GPipe schedule (backwards newest
first) is the control: the same graphs, in the order prefetch walks.

    python3 bench/pipeline_schedules.py [--link-mb-per-s N] [--microbatches N] [--steps N]

On the simulated device, its link bounded at --link-mb-per-s in each direction (0: unbounded).
Prints a markdown table: per schedule, the median step (wall time: a stall is a wait, which CPU
time would not count; compare rows of one run only), peak memory held and allocated, bytes to the
host and back, stalls (reads that waited for a reload) and their time, per step, and whether losses
and gradients are bitwise those of the same schedule without offload.
"""

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import tiny_lm  # noqa: E402

import spillway  # noqa: E402


def gpipe(n):
    """Every microbatch's forward, then their backwards in the same order (torch's
    ScheduleGPipe)."""
    return [("F", i) for i in range(n)] + [("B", i) for i in range(n)]


def gpipe_reversed(n):
    """Every forward, then the backwards newest first: the order prefetch walks."""
    return [("F", i) for i in range(n)] + [("B", i) for i in reversed(range(n))]


def one_f_one_b(n, warmup=2):
    """`warmup` forwards, then one forward and one backward in turn, then the last backwards:
    F0 F1 F2 B0 F3 B1 B2 B3 for 4 microbatches."""
    order = [("F", i) for i in range(warmup)]
    for i in range(n):
        if warmup + i < n:
            order.append(("F", warmup + i))
        order.append(("B", i))
    return order


SCHEDULES = {"GPipe": gpipe, "1F1B": one_f_one_b, "GPipe, backwards reversed": gpipe_reversed}
STATS = ("bytes_to_host", "bytes_to_device", "num_stalls", "stall_us")


def stat(key):
    return spillway.memory_stats().get(key, 0)


def train(schedule, offload, microbatches, steps, vocab=256):
    """Trains a fresh TinyLM for `steps` steps of `microbatches` microbatches each (batch 8,
    length 128) in `schedule`'s order; returns losses, final parameters, step times and the
    per-step means of STATS after the first step."""
    torch.manual_seed(0)
    model = tiny_lm.TinyLM(vocab)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = tiny_lm.batches(steps * microbatches, 8, 128, vocab)
    losses, times, totals = [], [], dict.fromkeys(STATS, 0)
    for s in range(steps):
        spillway.synchronize()
        if s == 1:  # the first step has nothing to learn from (eager's bound, the footprint)
            spillway.reset_peak_stats()
            totals = {k: -stat("spillway." + k) for k in STATS}
        start = time.perf_counter()
        pending = {}
        for op, i in schedule(microbatches):
            if op == "F":
                tokens = data[s * microbatches + i]
                with spillway.offload("eager") if offload else contextlib.nullcontext():
                    logits = model(tokens[:, :-1])
                    pending[i] = torch.nn.functional.cross_entropy(
                        logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)) / microbatches
                    del logits
            else:
                loss = pending.pop(i)
                loss.backward()
                losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        spillway.synchronize()
        times.append(time.perf_counter() - start)
    per_step = {k: (v + stat("spillway." + k)) / max(1, steps - 1) for k, v in totals.items()}
    params = [p.detach().clone() for p in model.parameters()]
    return losses, params, times[1:] or times, per_step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-mb-per-s", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if args.microbatches < 2 or args.steps < 2:
        sys.exit("pipeline_schedules: --microbatches and --steps must be at least 2")
    if args.link_mb_per_s < 0:
        sys.exit("pipeline_schedules: --link-mb-per-s must be 0 (unbounded) or more")
    # One intra-op thread: bitwise comparisons on the CPU need it (README, limitations).
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    conf = f"sim_link_mb_per_s:{args.link_mb_per_s}" if args.link_mb_per_s else None
    spillway.install("sim", conf=conf, capacity_bytes=2 << 30)
    link = f"{args.link_mb_per_s} MiB/s" if args.link_mb_per_s else "unbounded"
    print(f"{args.microbatches} microbatches a step, {args.steps} steps (the first left out), "
          f"simulated device, link {link}\n")
    print("| schedule | configuration | median step (s) | vs no offload | peak held (MiB) | "
          "peak allocated (MiB) | to host / back (MiB a step) | stalls a step | "
          "stalled (ms a step) | bitwise |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    differs = []
    for name, schedule in SCHEDULES.items():
        base = None
        for offload in (False, True):
            losses, params, times, per = train(schedule, offload, args.microbatches, args.steps)
            step = statistics.median(times)
            if base is None:
                base = (losses, params, step)
            same = losses == base[0] and all(torch.equal(a, b) for a, b in zip(params, base[1]))
            if not same:
                differs.append(name)
            print(f"| {name} | {'Spillway eager' if offload else 'no offload'} | {step:.3f} | "
                  f"{step / base[2]:.2f}x | {stat('active_bytes.all.peak') / 2**20:.1f} | "
                  f"{stat('allocated_bytes.all.peak') / 2**20:.1f} | "
                  f"{per['bytes_to_host'] / 2**20:.1f} / {per['bytes_to_device'] / 2**20:.1f} | "
                  f"{per['num_stalls']:.1f} | {per['stall_us'] / 1000:.1f} | "
                  f"{'yes' if same else 'NO'} |", flush=True)
    if differs:
        sys.exit(f"pipeline_schedules: offload changed the results of {', '.join(differs)}")


if __name__ == "__main__":
    main()
