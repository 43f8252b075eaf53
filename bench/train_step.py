"""Runs one configuration of the training-step benchmark in this process and prints one JSON line.

    python3 bench/train_step.py --device sim --config eager --steps 3

Configurations: default (PyTorch's allocator, no offload; on the simulated device Spillway's
allocator is the device, so this equals `spillway`), spillway (Spillway's allocator, no offload),
eager, auto (--budget bytes; default 80% of the device limit), save_on_cpu
(torch.autograd.graph.save_on_cpu(pin_memory=True) on the default allocator; CUDA only),
checkpoint (activation checkpointing per layer on the default allocator). Each configuration
needs its own process: an allocator is installed once per process.
"""

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_lm  # noqa: E402

CONFIGS = ("default", "spillway", "eager", "auto", "save_on_cpu", "checkpoint")


def write_trace(events, path):
    """A replayable allocation trace: one line per event, `a ID SIZE STREAM` for an allocation and
    `f ID` for its free, with IDs in place of addresses (addresses differ from run to run)."""
    live, next_id, lines = {}, 0, []
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = next_id
            lines.append(f"a {next_id} {e['size']} {e['stream']}")
            next_id += 1
        elif e["action"] == "free_requested" and e["addr"] in live:
            lines.append(f"f {live.pop(e['addr'])}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("sim", "cuda"), required=True)
    parser.add_argument("--config", choices=CONFIGS, required=True)
    parser.add_argument("--budget", type=int, default=None, help="auto budget in bytes")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--capacity-mb", type=int, default=2048, help="simulated device size")
    parser.add_argument("--limit-mb", type=int, default=None,
                        help="device memory limit (the simulated device's capacity; on CUDA a "
                        "per-process memory fraction); out of memory is then a result, not an "
                        "error")
    parser.add_argument("--prefetch-mb", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--snapshot", default=None,
                        help="record history and dump a snapshot here (Spillway configs)")
    parser.add_argument("--trace", default=None,
                        help="write the allocation trace of the run here (Spillway configs)")
    args = parser.parse_args()
    if args.limit_mb is not None and args.limit_mb <= 0:
        parser.error("--limit-mb must be a positive number of MiB")
    if args.config == "save_on_cpu" and args.device != "cuda":
        parser.error("save_on_cpu has no meaning on the simulated device (it is host memory)")

    if args.device == "sim":
        # One intra-op thread: the rows are compared bitwise, and on a loaded machine torch's CPU
        # kernels on two threads do not always reduce in the same order (beside busy processes a
        # run without Spillway trained to a one-thread run's losses, 2026-12-07).
        torch.set_num_threads(1)
    uses_spillway = args.device == "sim" or args.config in ("spillway", "eager", "auto")
    if uses_spillway:
        import spillway

        capacity_mb = args.limit_mb if args.limit_mb is not None else args.capacity_mb
        spillway.install(args.device, capacity_bytes=capacity_mb << 20
                         if args.device == "sim" else None)
    if args.limit_mb is not None and args.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (args.limit_mb << 20) / total))
    if args.config in ("eager", "auto"):
        def offload():
            return spillway.offload(
                args.config, budget_bytes=args.budget if args.config == "auto" else None,
                min_bytes=0, prefetch_bytes=args.prefetch_mb << 20)
    elif args.config == "save_on_cpu":
        def offload():
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
    else:
        offload = None

    def stats():
        if uses_spillway:
            return spillway.memory_stats()
        return torch.cuda.memory_stats()

    model_args = dict(layers=args.layers, batch=args.batch, seq=args.seq, d_model=args.d_model,
                      device="cuda" if args.device == "cuda" else "cpu",
                      checkpoint_layers=args.config == "checkpoint")
    if (args.trace or args.snapshot) and not uses_spillway:
        parser.error("--trace and --snapshot need a Spillway configuration")
    if args.trace or args.snapshot:
        spillway.record_history(True, max_entries=1_000_000,
                                stacks="python" if args.snapshot else "none")
    try:
        losses, times = tiny_lm.train(steps=args.steps, offload=offload, **model_args)
    except torch.cuda.OutOfMemoryError as error:
        if args.limit_mb is None:
            raise
        print(json.dumps({"device": args.device, "config": args.config,
                          "oom": str(error).strip().splitlines()[0]}))
        return
    if args.trace:
        write_trace(spillway.snapshot()["device_traces"][0], args.trace)
    if args.snapshot:
        spillway.synchronize()
        spillway.dump_snapshot(args.snapshot)
    s = stats()
    print(json.dumps({
        "device": args.device,
        "config": args.config,
        "peak_allocated": s["allocated_bytes.all.peak"],
        # Held: a spill's block counts as freed when the spill is issued, but nothing may reuse it
        # before its copy has read it (PyTorch counts such blocks in active_bytes).
        "peak_held": s["active_bytes.all.peak"],
        "peak_reserved": s["reserved_bytes.all.peak"],
        "median_step_s": statistics.median(times[1:] if len(times) > 1 else times),
        "bytes_to_host": s.get("spillway.bytes_to_host", 0),
        "stall_us": s.get("spillway.stall_us", 0),
        "losses": losses,
    }))


if __name__ == "__main__":
    main()
