"""What PyTorch's snapshots carry beside the trace (issue #39): record_function ranges as
external_annotations, the compile context and the user metadata of each trace entry, in the
layout torch writes them, on the simulated device through spillway.record_history (under the c10
adapter torch's own _record_memory_history reaches the same core through recordAnnotation,
push/popCompileContext and set/getUserMetadata).

The layout, from THCPModule_memorySnapshot (torch/csrc/cuda/Module.cpp; the same in
torch/csrc/cuda/memory_snapshot.cpp, _memory_snapshot_pickled), read in the copy at commit
25c860357aeeff9a3244a2f3ed71e422d7a999c9 of the fork cyyever/pytorch: each device trace entry has
"compile_context" (the top of the recording thread's compile-context stack, "N/A" when empty:
DeviceCachingAllocator::record_trace in c10/cuda/CUDACachingAllocator.cpp) and "user_metadata"
(the thread's, "" when unset); "external_annotations" is a list of dicts, each the annotation's
pairs ("name", "stage": "START" or "END", from the RecordFunction callback of
torch/csrc/cuda/memory_snapshot.cpp, _initRecordAnnotations) plus "device" and "time_us"."""

import pickle
import threading

import pytest
import torch
from torch.cuda import _memory_viz

import spillway
from test_snapshot import NOTES, training_step

ANNOTATION_KEYS = {"name", "stage", "device", "time_us"}


@pytest.fixture
def recorded():
    spillway.record_history(True, max_entries=100000)
    yield
    spillway.record_history(False)
    spillway.set_memory_metadata("")


def test_record_function_ranges_are_external_annotations(recorded):
    before = spillway.snapshot()["device_traces"][0]
    start_us = before[-1]["time_us"] if before else 0
    with torch.autograd.profiler.record_function("outer"):
        x = torch.empty(4096)
        with torch.autograd.profiler.record_function("inner"):
            y = torch.empty(4096)
    del x, y
    snap = spillway.snapshot()
    annotations = snap["external_annotations"]
    assert [(a["name"], a["stage"]) for a in annotations] == [
        ("outer", "START"), ("inner", "START"), ("inner", "END"), ("outer", "END")]
    for a in annotations:
        assert a.keys() == ANNOTATION_KEYS, a
        assert a["device"] == 0
        assert isinstance(a["time_us"], int) and a["time_us"] >= start_us
    # On the trace's clock: the allocations inside the range fall between its START and END.
    times = [a["time_us"] for a in annotations]
    assert times == sorted(times)
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"
              and e["size"] == 4096 * 4]
    assert len(allocs) >= 2
    assert times[0] <= allocs[-2]["time_us"] and allocs[-1]["time_us"] <= times[3]
    pickle.loads(pickle.dumps(snap, protocol=4))


def test_annotations_are_recorded_only_while_history_is_and_go_with_it():
    with torch.autograd.profiler.record_function("before"):
        pass
    spillway.record_history(True)
    try:
        assert spillway.snapshot()["external_annotations"] == []
        with torch.autograd.profiler.record_function("during"):
            pass
        assert len(spillway.snapshot()["external_annotations"]) == 2
    finally:
        spillway.record_history(False)
    assert spillway.snapshot()["external_annotations"] == []  # stopping clears, as the history
    with torch.autograd.profiler.record_function("after"):
        pass
    spillway.record_history(True)
    try:
        assert spillway.snapshot()["external_annotations"] == []
    finally:
        spillway.record_history(False)


@pytest.mark.parametrize("global_record_annotations", [False, True])
def test_other_threads_ranges_only_with_global_record_annotations(global_record_annotations):
    """torch's default records the ranges of the thread that turned recording on (a thread-local
    RecordFunction callback); global_record_annotations=True records every thread's."""
    spillway.record_history(True, global_record_annotations=global_record_annotations)
    try:
        def work():
            with torch.autograd.profiler.record_function("worker"):
                pass

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        with torch.autograd.profiler.record_function("main"):
            pass
        names = [a["name"] for a in spillway.snapshot()["external_annotations"]]
    finally:
        spillway.record_history(False)
    expected = (["worker"] * 2 if global_record_annotations else []) + ["main"] * 2
    assert names == expected


def test_every_trace_entry_has_a_compile_context_and_user_metadata(recorded):
    x = torch.empty(1 << 16)
    del x
    trace = spillway.snapshot()["device_traces"][0]
    assert trace
    for e in trace:
        assert e["compile_context"] == "N/A", e  # no compiled region: torch's "N/A"
        assert e["user_metadata"] == "", e
        assert e["pool_id"] == (0, 0), e  # torch 2.14's key: the default pool


def test_user_metadata_labels_what_the_thread_records_from_when_it_is_set(recorded):
    assert spillway.get_memory_metadata() == ""
    spillway.set_memory_metadata("step 1")
    assert spillway.get_memory_metadata() == "step 1"
    first = torch.empty(1 << 16)
    spillway.set_memory_metadata("step 2")
    del first
    seen = {}

    def other():
        seen["metadata"] = spillway.get_memory_metadata()
        y = torch.empty(1 << 16)
        del y

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    spillway.set_memory_metadata("")
    z = torch.empty(1 << 16)
    del z
    assert seen["metadata"] == ""  # per thread, as torch's
    by_action = [(e["action"], e["user_metadata"]) for e in spillway.snapshot()["device_traces"][0]
                 if e["size"] == 4 << 16 and e["action"] in ("alloc", "free_requested")]
    assert by_action == [("alloc", "step 1"), ("free_requested", "step 2"),
                         ("alloc", ""), ("free_requested", ""),
                         ("alloc", ""), ("free_requested", "")]


def test_user_metadata_is_checked():
    with pytest.raises(ValueError, match="metadata must be a str"):
        spillway.set_memory_metadata(3)


def test_user_metadata_and_spillways_notes_are_both_kept(recorded):
    """An entry with Spillway's note (a saved, spilled or reloaded allocation) keeps the user's
    string too: the user's, a newline, then the note. Other entries carry the user's as is."""
    spillway.set_memory_metadata("epoch 3")
    model, loss = training_step()
    loss.backward()
    trace = spillway.snapshot()["device_traces"][0]
    categories = set()
    for e in trace:
        note = NOTES.get(e.get("category"))
        if note is None:
            assert e["user_metadata"] == "epoch 3", e
        else:
            categories.add(e["category"])
            assert e["user_metadata"] == "epoch 3\n" + note, e
            assert e["user_metadata"].rsplit("\n", 1)[1].startswith("spillway: ")
    assert categories == set(NOTES)


def test_compile_context_names_the_compiled_region_only_when_asked():
    """Dynamo runs compiled code inside a function-scope RecordFunction named "Torch-Compiled
    Region: <compile id>"; with compile_context=True the trace entries recorded inside carry
    it, as torch's _record_memory_history(compile_context=True) makes its allocator's."""
    torch._dynamo.reset()

    @torch.compile(backend="eager")
    def compiled(x):
        return (x * 2).sin() + 1

    def entries_of(**kwargs):
        spillway.record_history(True, **kwargs)
        try:
            compiled(torch.randn(1 << 14))
            return spillway.snapshot()["device_traces"][0]
        finally:
            spillway.record_history(False)

    compiled(torch.randn(1 << 14))  # compiled before recording
    inside = {e["compile_context"] for e in entries_of(compile_context=True)}
    assert any(c.startswith("Torch-Compiled Region: ") for c in inside), inside
    assert "N/A" in inside  # the input, made outside the region
    assert {e["compile_context"] for e in entries_of()} == {"N/A"}
    torch._dynamo.reset()


def test_pytorchs_memory_viz_reads_a_snapshot_with_annotations(recorded):
    spillway.set_memory_metadata("viz")
    with torch.autograd.profiler.record_function("step"):
        model, loss = training_step()
    spillway.annotate_tensor(model[0].weight, "a parameter")
    snap = pickle.loads(pickle.dumps(spillway.snapshot(), protocol=4))
    loss.backward()
    assert snap["external_annotations"]
    _memory_viz.trace(snap)
    assert _memory_viz.segsum(snap)


@pytest.mark.parametrize("keyword", ["compile_context", "global_record_annotations"])
def test_the_torch_keywords_take_booleans(keyword):
    with pytest.raises(ValueError, match=f"{keyword} must be True"):
        spillway.record_history(True, **{keyword: "yes"})
    assert spillway.snapshot()["device_traces"][0] == []  # refused before recording started


def annotate_entries():
    return [e for e in spillway.snapshot()["device_traces"][0] if e["action"] == "annotate"]


def test_annotate_tensor_records_an_entry_for_the_storages_allocation(recorded):
    """torch 2.14's torch.cuda.memory._annotate_tensor, which under the c10 adapter reaches the
    same core call (annotateMemory): an "annotate" entry keyed to the base address of the
    tensor's untyped storage (so a view annotates its base), the allocation's size, the frames of
    the call, and the annotation as its user_metadata (not the thread's own)."""
    spillway.set_memory_metadata("thread's")
    x = torch.empty(1 << 16)
    view = x[1000:].view(-1, 8)
    spillway.annotate_tensor(view, "packed for backward")
    entries = annotate_entries()
    assert len(entries) == 1
    e = entries[0]
    assert e["addr"] == x.untyped_storage().data_ptr() != view.data_ptr()
    assert e["size"] == x.untyped_storage().nbytes()
    assert e["user_metadata"] == "packed for backward"
    assert e["compile_context"] == "N/A" and e["pool_id"] == (0, 0)
    assert "category" not in e  # no allocation event: the viewer colours by its alloc's
    assert any(f["name"] == "test_annotate_tensor_records_an_entry_for_the_storages_allocation"
               for f in e["frames"]), e["frames"]
    trace = spillway.snapshot()["device_traces"][0]
    alloc = next(i for i, t in enumerate(trace)
                 if t["action"] == "alloc" and t["addr"] == e["addr"])
    assert trace[alloc]["user_metadata"] == "thread's"
    assert trace.index(e) > alloc
    spillway.annotate_tensor(x, "again")  # annotations accumulate
    assert [a["user_metadata"] for a in annotate_entries()] == ["packed for backward", "again"]


def test_annotate_tensor_does_nothing_without_history_or_memory():
    x = torch.empty(1 << 16)
    spillway.annotate_tensor(x, "not recorded")
    spillway.record_history(True)
    try:
        assert annotate_entries() == []
        spillway.annotate_tensor(torch.empty(0), "no memory")  # nothing to key it to
        assert annotate_entries() == []
        spillway.annotate_tensor(x, "recorded")
        assert [a["user_metadata"] for a in annotate_entries()] == ["recorded"]
    finally:
        spillway.record_history(False)


def test_annotate_tensor_checks_its_arguments(recorded):
    with pytest.raises(ValueError, match="expects a torch.Tensor"):
        spillway.annotate_tensor("x", "m")
    with pytest.raises(ValueError, match="metadata must be a str"):
        spillway.annotate_tensor(torch.empty(4), 3)
    # Memory no allocator of Spillway's made: named, and nothing recorded.
    foreign = torch.frombuffer(bytearray(4096), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"annotate: .*not allocated by Spillway.*data_ptr"):
        spillway.annotate_tensor(foreign, "m")
    with pytest.raises(ValueError, match="not on the device Spillway serves"):
        spillway.annotate_tensor(torch.empty(4, device="meta"), "m")
    assert annotate_entries() == []
