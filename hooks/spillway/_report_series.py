"""spillway.report's reading of a snapshot: loading it without running code, the devices it has
data for, and its memory levels over time (device: allocated, reserved, spilled to host; pinned
host memory reserved)."""

import pickle

MIB = float(1 << 20)


class RefusedGlobalError(pickle.UnpicklingError):
    """A snapshot file named a global (a class or function), which load() never imports."""


class _PlainUnpickler(pickle.Unpickler):
    """Reads only what pickle writes with opcodes of its own: dict, list, tuple, str, bytes, int,
    float, bool and None (and sets), what memory snapshots are made of. A class or function comes
    in only as a global, and loading one runs code of the file's choosing (os.system through
    __reduce__): snapshots are shared in bug reports, so every global is refused. Nothing
    legitimate needs one: spillway.dump_snapshot writes plain types only, as do PyTorch's writers
    (torch.cuda.memory._dump_snapshot pickles the dict of _cuda_memorySnapshot, and the C++
    _memory_snapshot_pickled uses untyped lists and dicts, which its pickler writes without type
    tags), and pytorch.org/memory_viz's own unpickler has no opcode for a global at all. (Below
    protocol 3 bytes are written through the global _codecs.encode, refused too: no snapshot
    writer puts bytes in a pickle of those protocols.)"""

    def find_class(self, module, name):
        raise RefusedGlobalError(
            f"refused to load the global {module}.{name}: a memory snapshot holds only plain types "
            "(dict, list, tuple, str, bytes, int, float, bool, None), so this file is no snapshot "
            "and loading it could run code")


def load(path):
    """The snapshot pickled in `path`. Refuses (RefusedGlobalError) a file that names any class
    or function, rather than import and call it as pickle.load would."""
    with open(path, "rb") as f:
        return _PlainUnpickler(f).load()


def devices(snapshot):
    """The devices the snapshot has anything for (history, segments or offload events), in
    order; [0] when it has nothing at all."""
    found = {i for i, trace in enumerate(snapshot["device_traces"]) if trace}
    found.update(s["device"] for s in snapshot["segments"])
    found.update(e.get("device", 0) for e in snapshot.get("spillway", {}).get("events", []))
    return sorted(found) or [0]


def devices_of(snapshots):
    """The devices any of the snapshots has anything for, in order (see devices)."""
    return sorted({d for snap in snapshots for d in devices(snap)})


def series(snapshot, device=0):
    """Timelines from the snapshot's history: a dict of lists `t` (seconds from the first event),
    `allocated` (bytes requested by live allocations, as the history and memory_viz count them),
    `reserved` and `spilled` (bytes after each event), and `t0_us`, the first event's time. The
    starting levels are derived from the end state, so the curves end where the snapshot's
    segments are."""
    traces = snapshot["device_traces"]
    trace = traces[device] if device < len(traces) else []
    section = snapshot.get("spillway", {})
    offload_events = [e for e in section.get("events", []) if e.get("device", 0) == device]
    if trace:
        # The engine keeps its last 65536 events whether history is recorded or not: those from
        # before the history began would stretch the timeline back over a span it knows nothing
        # else of (the allocated curve flat there). The spilled level they left is the start's.
        offload_events = [e for e in offload_events if e["time_us"] >= trace[0]["time_us"]]
    segments = [s for s in snapshot["segments"] if s["device"] == device]
    # The history's allocation events carry the requested sizes, as PyTorch's do (block sizes in
    # snapshots Spillway wrote before it said so).
    size_key = "requested_size" if section.get("trace_sizes") == "requested" else "size"
    end_allocated = sum(b.get(size_key, b["size"]) for s in segments for b in s["blocks"]
                        if b["state"] == "active_allocated")
    end_reserved = sum(s["total_size"] for s in segments)
    d_alloc = {"alloc": 1, "free_requested": -1}
    d_reserved = {"segment_alloc": 1, "segment_free": -1}
    start_allocated = end_allocated - sum(d_alloc.get(e["action"], 0) * e["size"] for e in trace)
    start_reserved = end_reserved - sum(d_reserved.get(e["action"], 0) * e["size"] for e in trace)
    # "failed" is noted only for a spill whose copy failed: its bytes never reached the host.
    # "taken_back": a spill still copying that backward wanted; its device block became the
    # storage's memory again (no copy back).
    d_spill = {"spill": 1, "reload": -1, "taken_back": -1, "drop_spilled": -1,
               "prefetch_given_back": 1, "failed": -1}
    by_device = section.get("spilled_bytes_by_device")
    if by_device:
        end_spilled = by_device[device] if device < len(by_device) else 0
    else:  # a snapshot from before the per-device count: the engine's total
        end_spilled = section.get("stats", {}).get("spilled_bytes.current", 0)
    start_spilled = end_spilled - sum(d_spill.get(e["action"], 0) * e["bytes"]
                                      for e in offload_events)
    merged = [(e["time_us"], 0, e) for e in trace] + [(e["time_us"], 1, e) for e in offload_events]
    merged.sort(key=lambda item: (item[0], item[1]))
    t0 = merged[0][0] if merged else 0
    out = {"t": [0.0], "allocated": [start_allocated], "reserved": [start_reserved],
           "spilled": [start_spilled], "t0_us": t0}
    allocated, reserved, spilled = start_allocated, start_reserved, start_spilled
    for time_us, kind, e in merged:
        if kind == 0:
            allocated += d_alloc.get(e["action"], 0) * e["size"]
            reserved += d_reserved.get(e["action"], 0) * e["size"]
        else:
            spilled += d_spill.get(e["action"], 0) * e["bytes"]
        out["t"].append((time_us - t0) / 1e6)
        out["allocated"].append(allocated)
        out["reserved"].append(reserved)
        out["spilled"].append(spilled)
    return out


def host_reserved_series(snapshot, t0_us):
    """Pinned host memory reserved over time, from torch 2.14's host_segments and host_traces
    (spillway.record_history(..., record_pinned_host_memory=True) records the offload engine's
    pinned pools there): lists `t` (seconds from `t0_us`; an event before it at 0) and `reserved`
    (bytes after each chunk taken or given back, the start derived from the end state). None when
    the snapshot recorded no host history. The pools of all devices together: host segments name
    no device."""
    trace = snapshot.get("host_traces") or []
    if not trace:
        return None
    d_reserved = {"segment_alloc": 1, "segment_free": -1}
    reserved = sum(s["total_size"] for s in snapshot.get("host_segments", []))
    reserved -= sum(d_reserved.get(e["action"], 0) * e["size"] for e in trace)
    out = {"t": [0.0], "reserved": [reserved]}
    for e in trace:
        reserved += d_reserved.get(e["action"], 0) * e["size"]
        out["t"].append(max(0.0, (e["time_us"] - t0_us) / 1e6))
        out["reserved"].append(reserved)
    return out
