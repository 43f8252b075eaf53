"""Snapshots in PyTorch's format, read by PyTorch's own tools, with Spillway's keeper notes."""

import pickle

import pytest
import torch
from torch.cuda import _memory_viz

import spillway
import conftest
from conftest import stat

VIEWER_SEGMENT_KEYS = {"device", "address", "total_size", "stream", "blocks"}
VIEWER_BLOCK_KEYS = {"size", "state", "requested_size", "frames"}
VIEWER_TRACE_KEYS = {"action", "addr", "size", "stream"}
STATES = {"active_allocated", "active_pending_free", "inactive"}
ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom",
           "snapshot"}
CATEGORIES = {"unknown", "saved_for_backward", "spilled", "reloaded"}


def training_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256))
    x = torch.randn(512, 256)
    with spillway.offload("eager", min_bytes=0, prefetch_bytes=0):
        loss = model(x).square().sum()
    spillway.synchronize()
    return model, loss


@pytest.fixture
def recorded():
    spillway.record_history(True, max_entries=100000, stacks="python")
    yield
    spillway.record_history(False)


def test_snapshot_has_what_the_viewer_requires(recorded):
    model, loss = training_step()
    snap = spillway.snapshot()
    loss.backward()
    assert isinstance(snap["segments"], list) and isinstance(snap["device_traces"], list)
    assert len(snap["device_traces"]) == 1
    for seg in snap["segments"]:
        assert VIEWER_SEGMENT_KEYS <= seg.keys()
        assert seg["device"] == 0
        # Streams are named by handle, as in PyTorch's snapshots: the default stream is 0 (its
        # Spillway id is not).
        assert seg["stream"] == 0
        assert seg["segment_type"] in ("small", "large")
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        for b in seg["blocks"]:
            assert VIEWER_BLOCK_KEYS <= b.keys()
            assert b["state"] in STATES
            assert 0 < b["requested_size"] <= b["size"]
    trace = snap["device_traces"][0]
    assert trace, "history was recorded"
    for e in trace:
        assert VIEWER_TRACE_KEYS <= e.keys()
        assert e["action"] in ACTIONS
        assert e["stream"] == 0
        assert isinstance(e["frames"], list)
    # Allocations made from Python carry the Python frames that made them.
    allocs = [e for e in trace if e["action"] == "alloc"]
    assert any(any(f["name"] == "training_step" for f in e["frames"]) for e in allocs)
    pickle.loads(pickle.dumps(snap, protocol=4))  # plain types only


def test_spills_and_reloads_show_in_the_trace_as_frees_and_allocations(recorded):
    model, loss = training_step()
    spilled = {e["entry"]: e for e in spillway.snapshot()["spillway"]["entries"]
               if e["residency"] in ("spilled", "spilling")}
    assert spilled
    before = len(spillway.snapshot()["device_traces"][0])
    loss.backward()
    trace = spillway.snapshot()["device_traces"][0][before:]
    assert stat("spillway.num_reloads") > 0
    assert sum(e["action"] == "alloc" for e in trace) >= len(spilled)


def test_keeper_annotations_name_the_saved_views():
    x = torch.randn(128, 128, requires_grad=True)
    with spillway.offload("off", min_bytes=0):
        y = x.exp()           # saves y
        z = (y[8:] * 2).sum()  # nothing saved from y's storage
    snap = spillway.snapshot()
    address = y.data_ptr()
    block = snap["spillway"]["blocks"][address]
    assert ({"kind": "saved", "shape": (128, 128), "stride": (128, 1), "offset": 0}
            in block["keepers"])
    assert block["residency"] == "resident"
    assert block["external_holders"] >= 1
    z.backward()


def test_pytorchs_memory_viz_reads_it(tmp_path):
    model, loss = training_step()
    path = spillway.dump_snapshot(str(tmp_path / "snap.pickle"))
    with open(path, "rb") as f:
        snap = pickle.load(f)
    loss.backward()
    after = spillway.snapshot()
    segments = snap["segments"]

    def identity(text):  # skip flamegraph.pl (it downloads)
        return text

    if hasattr(_memory_viz, "segsum"):
        # torch 2.x: the helpers take the whole snapshot. segsum asserts that every byte of
        # every segment is allocated, rounding, or free; trace walks the history.
        summary = _memory_viz.segsum(snap)
        assert f"segments: {len(segments)}" in summary
        assert "active_allocated" in _memory_viz.segments(snap, format_flamegraph=identity)
        assert _memory_viz.memory(snap, format_flamegraph=identity)
        _memory_viz.trace(snap)
    else:
        # torch 1.13: they take the list of segments.
        stats = _memory_viz.stats(segments)
        assert stats["total_size"].value == sum(s["total_size"] for s in segments)
        assert "active_allocated" in _memory_viz.segments(segments, format_flamegraph=identity)
        assert _memory_viz.memory(segments, format_flamegraph=identity)
    _memory_viz.compare(segments, after["segments"], format_flamegraph=identity)


def test_record_history_checks_its_arguments():
    with pytest.raises(ValueError, match="stacks must be"):
        spillway.record_history(True, stacks="cpp")
    with pytest.raises(ValueError, match="context must be 'all', 'alloc', 'state' or None"):
        spillway.record_history(True, context="free")
    with pytest.raises(ValueError, match="max_entries must be a positive"):
        spillway.record_history(True, max_entries=0)


@pytest.mark.parametrize("context", ["all", "alloc", None])
def test_context_says_which_events_carry_frames(context):
    """torch's argument order (enabled, context, stacks, max_entries), positionally: "all" puts
    frames on allocations and frees, "alloc" on allocations only, None on none."""
    spillway.record_history(True, context, "python", 1000)
    try:
        def make_and_drop():
            x = torch.empty(1 << 20, dtype=torch.uint8)
            del x

        make_and_drop()
        trace = spillway.snapshot()["device_traces"][0]
    finally:
        spillway.record_history(False)

    def framed(action):
        return any(any(f["name"] == "make_and_drop" for f in e["frames"])
                   for e in trace if e["action"] == action)

    assert framed("alloc") == (context is not None), trace
    assert framed("free_requested") == (context == "all"), trace


def test_the_history_entries_key_bounds_the_history_recorded_from_python():
    """Helper review: record_history() passed its own default of 100000 entries, so the
    history_entries key did nothing from Python."""
    result = conftest.run_script("""
        import torch, spillway
        spillway.install("sim", conf="history_entries:5")
        spillway.record_history()
        kept = [torch.empty(1024) for _ in range(20)]
        print(len(spillway.snapshot()["device_traces"][0]))
    """)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == 5


def test_a_frame_whose_filename_is_no_utf8_leaves_no_error_set(recorded):
    """Review: the stack gatherer left PyUnicode_AsUTF8's error set, and the next call into
    Python raised SystemError ("returned a result with an exception set")."""
    namespace = {"torch": torch}
    exec(compile("x = torch.empty(1 << 20)", "/tmp/caf\udce9.py", "exec"), namespace)
    assert (torch.ones(3) + 1).sum().item() == 6
    frames = [f for e in spillway.snapshot()["device_traces"][0]
              if e["action"] == "alloc" and e["addr"] == namespace["x"].data_ptr()
              for f in e["frames"]]
    assert any(f["filename"] == "?" for f in frames), frames


def allocations(trace):
    """The entries of each allocation in `trace` (its alloc, free_requested, free_completed), in
    order, paired by address as PyTorch's viewer pairs them."""
    out, live = [], {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = [e]
            out.append(live[e["addr"]])
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            live[e["addr"]].append(e)
            if e["action"] == "free_completed":
                del live[e["addr"]]
    return out


def test_trace_entries_say_which_allocations_were_saved_spilled_or_reloaded(recorded):
    """Issue #39: PyTorch's memory viewer colours allocations by the `category` of their trace
    entries (its legend lists them); Spillway's entries had none, so a snapshot did not show what
    offload did."""
    spills, reloads = stat("spillway.num_spills"), stat("spillway.num_reloads")
    x = torch.randn(256, 256, requires_grad=True)
    with spillway.offload("off", min_bytes=0):
        kept = x.exp()  # saves its result, which "off" never spills
    kept_at = kept.data_ptr()
    model, loss = training_step()  # "eager": spills what only its saves hold
    forward = allocations(spillway.snapshot()["device_traces"][0])
    # Live: from the block. (x itself is no saved tensor: exp saves its result only.)
    kept_alloc = [a for a in forward if a[0]["addr"] == kept_at][-1][0]
    assert kept_alloc["category"] == "saved_for_backward", kept_alloc
    assert [a for a in forward if a[0]["addr"] == x.data_ptr()][-1][0]["category"] == "unknown"
    spilled = [a for a in forward if a[0]["category"] == "spilled"]
    assert len(spilled) == stat("spillway.num_spills") - spills > 0
    assert all(a[1]["action"] == "free_requested" for a in spilled)  # the spill freed them

    loss.backward()
    del kept
    snap = spillway.snapshot()
    trace = snap["device_traces"][0]
    after = allocations(trace)
    reloaded = [a for a in after if a[0]["category"] == "reloaded"]
    assert len(reloaded) == stat("spillway.num_reloads") - reloads > 0
    # Freed since: from its free's entries.
    kept_after = [a for a in after if a[0]["time_us"] == kept_alloc["time_us"]
                  and a[0]["addr"] == kept_at]
    assert [e["action"] for e in kept_after[0]] == ["alloc", "free_requested", "free_completed"]
    assert {e["category"] for e in kept_after[0]} == {"saved_for_backward"}
    # One category for all of an allocation's entries, "unknown" among them (the gradients);
    # segment events have none.
    for entries in after:
        assert len({e["category"] for e in entries}) == 1, entries
    assert {a[0]["category"] for a in after} == CATEGORIES
    for e in trace:
        assert ("category" in e) == (e["action"] in ("alloc", "free_requested",
                                                     "free_completed")), e
    pickle.loads(pickle.dumps(snap, protocol=4))  # still plain types only


def test_completed_frees_and_segments_carry_the_frames_of_their_allocation():
    """PyTorch's allocator gives a free_completed entry the frames of the allocation it ends, and a
    segment (its segment_alloc and segment_free entries too) those of the allocation that made it;
    Spillway's had none, and the viewer said a freed block had no frames."""
    spillway.empty_cache()  # no cached segment to serve the allocation below
    spillway.record_history(True, "alloc", "python", 1000)  # no frames gathered at frees
    try:
        def make_and_drop():
            x = torch.empty((300 << 20) + 4096, dtype=torch.uint8)  # a segment of its own
            segments = [s for s in spillway.snapshot()["segments"]
                        if s["address"] == x.data_ptr()]
            return x.data_ptr(), segments

        address, segments = make_and_drop()
        spillway.empty_cache()
        trace = [e for e in spillway.snapshot()["device_traces"][0] if e["addr"] == address]
    finally:
        spillway.record_history(False)

    def frames(action):
        [entry] = [e for e in trace if e["action"] == action]
        return entry["frames"]

    assert any(f["name"] == "make_and_drop" for f in frames("alloc")), trace
    assert frames("free_requested") == []
    assert frames("free_completed") == frames("alloc")
    assert frames("segment_alloc") == frames("alloc")
    assert frames("segment_free") == frames("alloc")
    assert len(segments) == 1 and segments[0]["frames"] == frames("alloc")


SPILL_NOTE = ("spillway: saved for backward, then spilled to host; the spill freed it, and a wait "
              "for that free to complete is the copy to host, not a record_stream")
NOTES = {"saved_for_backward": "spillway: saved for backward", "spilled": SPILL_NOTE,
         "reloaded": "spillway: reloaded from host for backward"}


def test_the_viewer_prints_what_a_spills_wait_is(recorded):
    """Issue #39: a spill frees its block while the copy to host still reads it, so its
    free_completed comes late, and PyTorch's memory viewer (MemoryViz.js) draws such a block red
    as "block freed but waiting due to record_stream", its words for any free_requested block.
    It prints an entry's or block's `user_metadata` string below that ("User Metadata:", then the
    string), so a spill's entries and blocks carry one that names the spill."""
    model, loss = training_step()
    snap = spillway.snapshot()
    trace = snap["device_traces"][0]
    for e in trace:
        if e.get("category", "unknown") == "unknown":
            assert e["user_metadata"] == "", e  # no note, and no user metadata was set
        else:
            assert e["user_metadata"] == NOTES[e["category"]], e
    # The viewer's state view shows a block red, "waiting", from its free_requested entry until
    # its free_completed one, and takes the block's note from the latter: both name the spill.
    spill_frees = [i for i, e in enumerate(trace)
                   if e["action"] == "free_requested" and e["category"] == "spilled"]
    assert spill_frees, "nothing was spilled"
    blocks = {b["address"]: b for seg in snap["segments"] for b in seg["blocks"]}
    for i in spill_frees:
        assert trace[i]["user_metadata"] == SPILL_NOTE
        later = [e for e in trace[i + 1:] if e["addr"] == trace[i]["addr"]]
        if later:
            assert later[0]["action"] == "free_completed"
            assert later[0]["user_metadata"] == SPILL_NOTE
        else:  # still waiting: the view takes the block from the segments
            block = blocks[trace[i]["addr"]]
            assert block["state"] == "active_pending_free", block
            assert block["user_metadata"] == SPILL_NOTE
    # Blocks of no category carry no note.
    for b in blocks.values():
        assert b.get("user_metadata") in (None, *NOTES.values()), b
    assert any(b.get("user_metadata") == NOTES["saved_for_backward"]
               for seg in snap["segments"] for b in seg["blocks"])
    loss.backward()
    reloaded = [e for e in spillway.snapshot()["device_traces"][0]
                if e.get("category") == "reloaded"]
    assert reloaded and all(e["user_metadata"] == NOTES["reloaded"] for e in reloaded)
    pickle.loads(pickle.dumps(snap, protocol=4))


# Torch 2.14's layout of host_segments and host_traces, which snapshots have when memory history
# is recorded with record_pinned_host_memory=True (PyTorch PR #182407). From
# torch/csrc/cuda/Module.cpp, THCPModule_memorySnapshot, as read in the copy of that file at
# commit 25c860357aeeff9a3244a2f3ed71e422d7a999c9 of the fork cyyever/pytorch (its trace entries
# also carry an "internal_metadata" key when it is set, from a field torch 2.14.1's TraceEntry
# does not have: c10/core/CachingDeviceAllocator.h of Debian's torch 2.14.1); the trace entry
# fields, pool_id included, are the TraceEntry that torch 2.14.1's torch/cuda/memory.py documents
# in _snapshot's docstring. A host segment: device -1, stream 0, segment_type "small",
# is_expandable False, requested_size its size, frames (empty without a context); its blocks'
# requested_size is their size. A host trace entry: no frames key without a context.
HOST_SEGMENT_KEYS = {"device", "address", "total_size", "allocated_size", "active_size",
                     "requested_size", "stream", "segment_type", "segment_pool_id",
                     "is_expandable", "frames", "blocks"}
HOST_BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}
HOST_TRACE_KEYS = {"action", "addr", "size", "stream", "time_us", "compile_context",
                   "user_metadata", "pool_id"}


def check_host_layout(snap):
    """Every field of the snapshot's host_segments and host_traces against torch 2.14's layout;
    returns the host blocks by address."""
    blocks = {}
    for seg in snap["host_segments"]:
        assert seg.keys() == HOST_SEGMENT_KEYS, seg.keys()
        assert seg["device"] == -1 and seg["stream"] == 0
        assert seg["segment_type"] == "small" and seg["is_expandable"] is False
        assert seg["segment_pool_id"] == (0, 0) and seg["frames"] == []
        assert seg["requested_size"] == seg["total_size"]
        # The blocks tile the segment (a pool chunk), in address order.
        address = seg["address"]
        for b in seg["blocks"]:
            assert b.keys() == HOST_BLOCK_KEYS, b.keys()
            assert b["address"] == address and b["size"] > 0
            assert b["requested_size"] == b["size"] and b["frames"] == []
            assert b["state"] in STATES
            address += b["size"]
            blocks[b["address"]] = b
        assert address == seg["address"] + seg["total_size"]

        def bytes_in(*states):
            return sum(b["size"] for b in seg["blocks"] if b["state"] in states)

        assert seg["allocated_size"] == bytes_in("active_allocated")
        assert seg["active_size"] == bytes_in("active_allocated", "active_pending_free")
    times = []
    for e in snap["host_traces"]:
        assert e.keys() == HOST_TRACE_KEYS, e.keys()
        assert e["action"] in ACTIONS - {"oom", "snapshot"}
        assert e["addr"] > 0 and e["size"] > 0 and e["stream"] == 0
        assert e["compile_context"] == "" and e["user_metadata"] == ""
        assert e["pool_id"] == (0, 0)
        times.append(e["time_us"])
    assert times == sorted(times)  # one list, oldest first
    return blocks


def test_the_pinned_host_pool_shows_as_torch_2_14_shows_pinned_memory():
    """Issue #39: torch 2.14 writes its pinned host allocator into snapshots (host_segments,
    host_traces) when history is recorded with record_pinned_host_memory=True; Spillway's
    snapshots had no host memory at all, though its spills live there."""
    spillway.empty_cache()  # the pinned chunks earlier tests left go back
    assert stat("spillway.host_reserved_bytes") == 0
    spillway.record_history(True, max_entries=100000, stacks="python",
                            record_pinned_host_memory=True)
    try:
        model, loss = training_step()  # spills to host
        during = spillway.snapshot()
        loss.backward()
        spillway.synchronize()
        after = spillway.snapshot()
        spillway.empty_cache()
        trimmed = spillway.snapshot()
    finally:
        spillway.record_history(False)

    spilled = [e for e in during["spillway"]["entries"] if e["residency"] == "spilled"]
    assert spilled
    blocks = check_host_layout(during)
    assert (sum(s["total_size"] for s in during["host_segments"])
            == during["spillway"]["stats"]["host_reserved_bytes"] > 0)
    # One pinned buffer per spilled entry, at least its size.
    held = sorted(b["size"] for b in blocks.values() if b["state"] == "active_allocated")
    assert len(held) == len(spilled)
    assert all(size >= need for size, need in zip(held, sorted(e["nbytes"] for e in spilled)))
    # The history: the chunk taken (segment_alloc of the whole segment), then each buffer's alloc.
    trace = during["host_traces"]
    assert [(e["addr"], e["size"]) for e in trace if e["action"] == "segment_alloc"] == [
        (s["address"], s["total_size"]) for s in during["host_segments"]]
    assert sorted((e["addr"], e["size"]) for e in trace if e["action"] == "alloc") == sorted(
        (a, b["size"]) for a, b in blocks.items() if b["state"] == "active_allocated")

    # Backward reloaded them: each buffer was freed, and its memory is free in the segment.
    check_host_layout(after)
    assert all(s["allocated_size"] == s["active_size"] == 0 for s in after["host_segments"])
    trace = after["host_traces"]
    assert trace[:len(during["host_traces"])] == during["host_traces"]
    for entries in allocations(trace):
        assert [e["action"] for e in entries] == ["alloc", "free_requested", "free_completed"]
        assert len({(e["addr"], e["size"]) for e in entries}) == 1

    # empty_cache gave the chunks back: segment_free, and no segment left.
    check_host_layout(trimmed)
    assert trimmed["host_segments"] == []
    assert [(e["addr"], e["size"]) for e in trimmed["host_traces"]
            if e["action"] == "segment_free"] == [
        (s["address"], s["total_size"]) for s in after["host_segments"]]
    pickle.loads(pickle.dumps(trimmed, protocol=4))  # plain types only


def test_pinned_host_memory_is_recorded_only_when_asked(recorded):
    """As in torch 2.14: without record_pinned_host_memory=True the keys are there, empty."""
    model, loss = training_step()
    snap = spillway.snapshot()
    loss.backward()
    assert any(e["residency"] == "spilled" for e in snap["spillway"]["entries"])
    assert snap["host_segments"] == [] and snap["host_traces"] == []
    with pytest.raises(ValueError, match="record_pinned_host_memory must be True or False"):
        spillway.record_history(True, record_pinned_host_memory="yes")
