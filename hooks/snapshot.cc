#include "hooks/snapshot.h"

#include <ATen/record_function.h>
#include <Python.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <frameobject.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "allocator/errors.h"
#include "allocator/format.h"
#include "hooks/kept_saves.h"
#include "hooks/runtime.h"
#include "hooks/storage_tools.h"
#include "hooks/trace_context.h"

namespace py = pybind11;

namespace spillway::torch_layer {
namespace {

constexpr int kMaxFrames = 64;

// PyFrame_GetCode and PyFrame_GetBack came with Python 3.9; torch 2.4 still supports 3.8, whose
// frame fields are public.
PyCodeObject* FrameCode(PyFrameObject* frame) {
#if PY_VERSION_HEX >= 0x03090000
  return PyFrame_GetCode(frame);
#else
  Py_INCREF(frame->f_code);
  return frame->f_code;
#endif
}
PyFrameObject* FrameBack(PyFrameObject* frame) {
#if PY_VERSION_HEX >= 0x03090000
  return PyFrame_GetBack(frame);
#else
  Py_XINCREF(frame->f_back);
  return frame->f_back;
#endif
}

// Python frames of the allocating thread, innermost first. PyTorch releases the GIL inside ops,
// so it is taken here, as PyTorch's own stack gathering does. The allocator never calls this with
// its locks held; allocations the offload engine makes (reloads) happen inside an engine operation,
// where waiting for the GIL could deadlock against a Python thread waiting for the engine: those
// carry no frames.
TraceContext GatherPythonFrames() {
  if (!Py_IsInitialized() || OffloadEngine::InsideEngineOnThisThread()) return nullptr;
  py::gil_scoped_acquire gil;
  // An exception being raised (a free while the stack unwinds) stays as it was, and one of ours
  // (a filename that is no valid UTF-8) is not left set for the next C-API caller to trip on.
  const py::error_scope keep_pending_error;
  auto context = std::make_shared<TorchTraceContext>();
  std::vector<PythonFrame>* frames = &context->frames;
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr && static_cast<int>(frames->size()) < kMaxFrames) {
    PyCodeObject* code = FrameCode(frame);  // new reference
    const char* filename = PyUnicode_AsUTF8(code->co_filename);
    if (filename == nullptr) PyErr_Clear();
    const char* name = PyUnicode_AsUTF8(code->co_name);
    if (name == nullptr) PyErr_Clear();
    frames->push_back(
        PythonFrame{filename ? filename : "?", PyFrame_GetLineNumber(frame), name ? name : "?"});
    Py_DECREF(code);
    PyFrameObject* back = FrameBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  return context;
}

py::list FramesOf(const TraceContext& context) {
  py::list out;
  if (context == nullptr) return out;
  for (const PythonFrame& f : AsTorchContext(context)->frames) {
    py::dict d;
    d["filename"] = f.filename;
    d["line"] = f.line;
    d["name"] = f.name;
    out.append(d);
  }
  return out;
}

using LiveCategories = std::unordered_map<uintptr_t, TraceCategory>;  // by block address

// The category of each entry of one device's `trace`. What the layers above learn of an
// allocation (TraceCategory) comes after its alloc entry was recorded: the history has it in the
// entries of its free, and the snapshot in its block while it lives. Every entry of an allocation
// gets it, its alloc entry included (the one the viewer colours, or its free's when the history
// begins after the alloc).
std::vector<TraceCategory> AllocationCategories(const std::vector<TraceEntry>& trace,
                                                const LiveCategories& live) {
  std::vector<TraceCategory> out(trace.size(), TraceCategory::kUnknown);
  std::unordered_map<uintptr_t, size_t> open;  // address -> the alloc entry of the live block
  for (size_t i = 0; i < trace.size(); ++i) {
    const TraceEntry& e = trace[i];
    if (e.action == TraceAction::kAlloc) {
      open[e.addr] = i;
    } else if (e.action == TraceAction::kFreeRequested || e.action == TraceAction::kFreeCompleted) {
      out[i] = e.category;
      if (const auto it = open.find(e.addr); it != open.end()) {
        out[it->second] = e.category;
        open.erase(it);
      }
    }
  }
  for (const auto& [address, index] : open) {
    if (const auto it = live.find(address); it != live.end()) out[index] = it->second;
  }
  return out;
}

// What PyTorch's memory viewer (pytorch.org/memory_viz, MemoryViz.js) prints for an allocation of
// a category, as its `user_metadata`: the viewer prints a string there as "User Metadata:" and
// the string on the next line, under an entry of the trace list, an allocation of the timeline
// and a block of the allocator state view (where a block comes from its free_completed entry, or
// from the segments' block at the end). The category itself it only colours by. A spill's block
// is a free_requested waiting for its free_completed until the copy to host is done, which that
// view draws red as "block freed but waiting due to record_stream" (its text for any such block):
// the line below it says that this wait is the spill's copy. nullptr: no note.
const char* ViewerNote(TraceCategory category) {
  switch (category) {
    case TraceCategory::kUnknown:
      return nullptr;
    case TraceCategory::kSavedForBackward:
      return "spillway: saved for backward";
    case TraceCategory::kSpilled:
      return "spillway: saved for backward, then spilled to host; the spill freed it, and a wait "
             "for that free to complete is the copy to host, not a record_stream";
    case TraceCategory::kReloaded:
      return "spillway: reloaded from host for backward";
  }
  return nullptr;
}

// A trace entry's `compile_context` as PyTorch writes it: the top of the recording thread's
// compile-context stack, "N/A" when it had none (DeviceCachingAllocator::record_trace).
std::string CompileContextValue(const TraceEntry& e) {
  if (e.labels == nullptr || e.labels->compile_context.empty()) return "N/A";
  return e.labels->compile_context;
}

// A trace entry's `user_metadata`: the recording thread's user metadata, as PyTorch writes it
// ("" when none), and Spillway's viewer note (ViewerNote) where the entry has one. Both are kept
// when both exist, the user's first, then a newline and the note: the viewer prints this one
// string only, and each half says what the other cannot (the user's what the program was doing,
// the note why the block looks like it waits for a record_stream). The note always starts with
// "spillway: " on the string's last line, so a reader can take the user's part back.
std::string UserMetadataValue(const TraceEntry& e, const char* note) {
  std::string user = e.labels != nullptr ? e.labels->user_metadata : std::string();
  if (note == nullptr) return user;
  if (user.empty()) return note;
  return user + "\n" + note;
}

py::list AnnotationList(const std::vector<AnnotationEntry>& annotations) {
  py::list out;
  for (const AnnotationEntry& a : annotations) {
    // As THCPModule_memorySnapshot: the pairs first (a repeated name keeps its last value, as
    // torch's map does), then device and time_us, which win over a pair of those names.
    py::dict d;
    for (const auto& [name, value] : a.metadata) d[py::str(name)] = value;
    d["device"] = a.device;
    d["time_us"] = a.time_us;
    out.append(d);
  }
  return out;
}

// What Spillway's record_history installs, as torch's _record_memory_history does for its own
// allocator (torch/csrc/cuda/memory_snapshot.cpp, setRecordFunctionCallbacks), so that the
// simulated device, whose torch has no CUDA and so no _record_memory_history, gets the same: a
// callback on the user-scope RecordFunctions (torch.autograd.profiler.record_function) that
// records a "START" and an "END" annotation of each, on the calling thread only unless
// `global_record_annotations`; and with `compile_context`, one on the function-scope ones that
// pushes and pops Dynamo's "Torch-Compiled Region: ..." ranges. The callbacks take no lock of
// ours but the allocator's annotation mutex, and call no Python.
class RecordFunctionCallbacks {
 public:
  static RecordFunctionCallbacks& Get() {
    static RecordFunctionCallbacks callbacks;
    return callbacks;
  }

  void Set(bool enabled, bool compile_context, bool global_annotations) {
    std::lock_guard lock(mutex_);
    if (!enabled) {
      for (at::CallbackHandle* handle : {&annotations_, &compile_contexts_}) {
        if (*handle != 0) at::removeCallback(*handle);
        *handle = 0;
      }
      return;
    }
    // As torch's: enabling again adds what is missing and keeps what is there.
    if (annotations_ == 0) {
      at::RecordFunctionCallback callback(&AnnotateStart, &AnnotateEnd);
      callback.scopes({at::RecordScope::USER_SCOPE});
      annotations_ = global_annotations ? at::addGlobalCallback(callback)
                                        : at::addThreadLocalCallback(callback);
    }
    if (compile_context && compile_contexts_ == 0) {
      at::RecordFunctionCallback callback(&CompileRegionStart, &CompileRegionEnd);
      callback.scopes({at::RecordScope::FUNCTION});
      compile_contexts_ = at::addGlobalCallback(callback);
    }
  }

 private:
  static constexpr std::string_view kCompiledRegion = "Torch-Compiled Region";

  // The device current on this thread, as torch's recordAnnotation takes it: CUDA's when
  // Spillway serves CUDA, 0 (the one device) on the simulated device.
  static int CurrentDevice() {
    Runtime& runtime = Runtime::Get();
    if (runtime.mode() == Mode::kSim || !c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) {
      return 0;
    }
    return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index();
  }
  static void Annotate(const at::RecordFunction& fn, const char* stage) {
    Runtime::Get().allocator().RecordAnnotation(
        CurrentDevice(), {{"name", std::string(fn.name())}, {"stage", stage}});
  }
  static std::unique_ptr<at::ObserverContext> AnnotateStart(const at::RecordFunction& fn) {
    Annotate(fn, "START");
    return nullptr;
  }
  static void AnnotateEnd(const at::RecordFunction& fn, at::ObserverContext* /*context*/) {
    Annotate(fn, "END");
  }
  static std::unique_ptr<at::ObserverContext> CompileRegionStart(const at::RecordFunction& fn) {
    if (std::string name(fn.name()); name.starts_with(kCompiledRegion)) {
      Runtime::Get().allocator().PushCompileContext(std::move(name));
    }
    return nullptr;
  }
  static void CompileRegionEnd(const at::RecordFunction& fn, at::ObserverContext* /*context*/) {
    if (std::string_view(fn.name()).starts_with(kCompiledRegion)) {
      Runtime::Get().allocator().PopCompileContext();
    }
  }

  std::mutex mutex_;
  at::CallbackHandle annotations_ = 0;
  at::CallbackHandle compile_contexts_ = 0;
};

bool IsAllocationEvent(TraceAction action) {
  return action == TraceAction::kAlloc || action == TraceAction::kFreeRequested ||
         action == TraceAction::kFreeCompleted;
}

py::dict SpillwaySection(Runtime& runtime, py::dict& block_sections) {
  py::list entries;
  // Saves kept as they are (subclasses, nested or quantized tensors, a second storage over the
  // memory) hold their blocks too. Their own tensors are no holders unknown to Spillway (as
  // keepers() counts them).
  const std::map<const void*, std::vector<KeptSave>> kept_by_block = KeptSaves::Get().ByBlock();
  OffloadEngine* engine = runtime.engine_if_created();
  if (engine != nullptr) {
    CachingAllocator& allocator = runtime.allocator();
    for (const void* key : engine->EntryKeys()) {
      const std::optional<EntryInfo> info = engine->Describe(key);
      if (!info) continue;  // dropped meanwhile
      py::dict e;
      e["entry"] = reinterpret_cast<uintptr_t>(key);
      e["device"] = info->device;
      e["nbytes"] = info->nbytes;
      e["residency"] = std::string(ResidencyName(info->residency));
      e["keepers"] = SavedViewDicts(*info);
      e["element_size"] = info->keepers.empty() ? 1 : info->keepers.front().view.element_size;
      int64_t external = info->external_holders;
      e["spill_count"] = info->spill_count;
      e["reload_count"] = info->reload_count;
      e["last_spill_us"] = info->last_spill_us;
      e["last_reload_us"] = info->last_reload_us;
      py::object address = py::none();
      if (info->data != nullptr) {
        if (const auto block = allocator.Lookup(info->data)) {
          address = py::int_(reinterpret_cast<uintptr_t>(block->ptr));
          py::list keepers = e["keepers"];
          if (const auto kept = kept_by_block.find(block->ptr); kept != kept_by_block.end()) {
            // The engine keys entries by their StorageImpl.
            external -= KeptOn(static_cast<const c10::StorageImpl*>(key), kept->second);
            keepers = e["keepers"].attr("copy")();
            for (const py::handle k : KeptSaveDicts(kept->second)) keepers.append(k);
          }
          py::dict b;
          b["entry"] = e["entry"];
          b["residency"] = e["residency"];
          b["keepers"] = keepers;
          b["external_holders"] = external;
          block_sections[address] = b;
        }
      }
      e["external_holders"] = external;
      e["address"] = address;
      entries.append(e);
    }
  }
  // Blocks only saves kept as they are hold.
  for (const auto& [block, kept] : kept_by_block) {
    const py::int_ address(reinterpret_cast<uintptr_t>(block));
    if (block_sections.contains(address)) continue;  // listed with the entry's saves above
    py::dict b;
    b["entry"] = py::none();
    b["residency"] = "resident";
    b["keepers"] = KeptSaveDicts(kept);
    b["external_holders"] = OtherHoldersOfKeptStorages(kept);
    block_sections[address] = b;
  }
  py::list events;
  if (engine != nullptr) {
    for (const OffloadEvent& ev : engine->Events()) {
      py::dict d;
      d["time_us"] = ev.time_us;
      d["action"] = std::string(OffloadEventName(ev.kind));
      d["device"] = ev.device;
      d["entry"] = reinterpret_cast<uintptr_t>(ev.key);
      d["bytes"] = ev.bytes;
      events.append(d);
    }
  }
  py::dict section;
  section["entries"] = entries;
  section["events"] = events;
  section["releases"] = ReleaseLog();
  section["allocator_stats"] = py::cast(runtime.allocator().FlatStats(0));
  section["blocks"] = block_sections;
  // What an allocation's history events carry (block sizes, in snapshots of earlier versions).
  section["trace_sizes"] = "requested";
  section["stats"] = engine != nullptr ? py::cast(engine->stats().Flatten()) : py::dict();
  // Per device, its part of stats' spilled_bytes.current (the report plots each device).
  py::list spilled;
  for (int d = 0; engine != nullptr && d < runtime.allocator().device_count(); ++d) {
    spilled.append(engine->spilled_bytes(d));
  }
  section["spilled_bytes_by_device"] = spilled;
  return section;
}

// The offload engine's pinned host pools as torch 2.14 shows its own pinned host allocator
// (torch.cuda.memory._record_memory_history(record_pinned_host_memory=True), PyTorch PR #182407):
// the layout of the host_segments and host_traces that THCPModule_memorySnapshot builds in
// torch/csrc/cuda/Module.cpp (read in the copy of that file at commit 25c860357aee of the fork
// cyyever/pytorch; torch 2.14.1's memory.py documents the same trace entry fields, pool_id
// included, and its c10/core/CachingDeviceAllocator.h and ATen/core/CachingHostAllocator.h the
// HostSegmentInfo and host TraceEntry it fills them from). Constant where torch writes constants
// for host memory: device -1, stream 0, segment_type "small", no expandable segments; pool (0, 0),
// the default pool, as the engine's buffers are never a CUDA graph's.
// Where the layouts differ: torch's host allocator never splits what it pins, so each of its
// segments has one block; a pool chunk is carved into buffers, and its segment lists them all (the
// device segments' layout), so that a segment_alloc and segment_free of the trace name a segment.
py::dict HostSegmentDict(const SegmentSnapshot& s) {
  py::dict seg;
  seg["device"] = -1;
  seg["address"] = s.address;
  seg["total_size"] = s.total_size;
  seg["allocated_size"] = s.allocated_size;
  seg["active_size"] = s.active_size;
  seg["requested_size"] = s.requested_size;
  seg["stream"] = 0;
  seg["segment_type"] = "small";
  seg["segment_pool_id"] = py::make_tuple(0, 0);
  seg["is_expandable"] = false;
  // Torch writes frames where it gathered none as an empty list; the pools are called from inside
  // the engine, where no frames are gathered (GatherPythonFrames).
  seg["frames"] = py::list();
  py::list blocks;
  for (const BlockSnapshot& b : s.blocks) {
    py::dict blk;
    blk["address"] = b.address;
    blk["size"] = b.size;
    blk["requested_size"] = b.requested_size;
    blk["state"] = std::string(BlockStateName(b.state));
    blk["frames"] = py::list();
    blocks.append(blk);
  }
  seg["blocks"] = blocks;
  return seg;
}

// One entry of host_traces: torch's trace entry, as its device traces have them, with no frames
// key (torch adds one only to an entry that gathered a context, and the pools gather none).
py::dict HostTraceDict(const TraceEntry& e) {
  py::dict d;
  d["action"] = std::string(TraceActionName(e.action));
  d["addr"] = e.addr;
  d["size"] = e.size;
  d["stream"] = 0;
  d["time_us"] = e.time_us;
  d["compile_context"] = "";
  d["user_metadata"] = "";
  d["pool_id"] = py::make_tuple(0, 0);
  return d;
}

}  // namespace

void RecordHistory(bool enabled, size_t max_entries, const std::string& stacks, bool free_context,
                   bool pinned_host_memory, bool compile_context, bool global_record_annotations) {
  if (stacks != "python" && stacks != "none") {
    throw InvalidArgumentError("record_history: stacks must be \"python\" or \"none\", got \"" +
                               stacks + "\"");
  }
  ContextGatherer gatherer;
  if (stacks == "python") gatherer = GatherPythonFrames;
  Runtime& runtime = Runtime::Get();
  CachingAllocator& allocator = runtime.allocator();
  allocator.RecordHistory(enabled, max_entries, std::move(gatherer), free_context);
  runtime.RecordHostHistory(enabled && pinned_host_memory,
                            max_entries == 0 ? allocator.config().history_entries : max_entries);
  RecordFunctionCallbacks::Get().Set(enabled, compile_context, global_record_annotations);
}

void SetUserMetadata(const std::string& metadata) {
  Runtime::Get().allocator().SetUserMetadata(metadata);
}

std::string GetUserMetadata() { return Runtime::Get().allocator().user_metadata(); }

void AnnotateTensor(const at::Tensor& tensor, const std::string& metadata) {
  Runtime& runtime = Runtime::Get();
  runtime.CheckServes(tensor.device(), "annotate_tensor");
  // Not tensor.data_ptr(): a view's points past its storage's start, and the annotation is the
  // allocation's.
  runtime.allocator().AnnotateMemory(tensor.storage().data_ptr().get(), metadata);
}

py::dict Snapshot() {
  Runtime& runtime = Runtime::Get();
  CachingAllocator& allocator = runtime.allocator();
  const spillway::Snapshot snap = allocator.TakeSnapshot();
  py::dict out;
  py::list segments;
  std::vector<LiveCategories> live(snap.device_traces.size());
  for (const SegmentSnapshot& s : snap.segments) {
    py::dict seg;
    seg["device"] = s.device;
    seg["address"] = s.address;
    seg["total_size"] = s.total_size;
    seg["allocated_size"] = s.allocated_size;
    seg["active_size"] = s.active_size;
    seg["requested_size"] = s.requested_size;
    seg["stream"] = snap.StreamValue(s.stream);
    seg["segment_type"] = s.pool == PoolKind::kSmall ? "small" : "large";
    seg["segment_pool_id"] = py::make_tuple(0, 0);
    seg["is_expandable"] = false;
    seg["frames"] = FramesOf(s.context);
    py::list blocks;
    for (const BlockSnapshot& b : s.blocks) {
      if (b.state != BlockState::kInactive && static_cast<size_t>(s.device) < live.size()) {
        live[static_cast<size_t>(s.device)][b.address] = b.category;
      }
      py::dict blk;
      blk["address"] = b.address;
      blk["size"] = b.size;
      blk["requested_size"] = b.state == BlockState::kInactive ? b.size : b.requested_size;
      blk["state"] = std::string(BlockStateName(b.state));
      blk["frames"] = FramesOf(b.context);
      if (b.state != BlockState::kInactive) {
        if (const char* note = ViewerNote(b.category)) blk["user_metadata"] = note;
      }
      if (b.state == BlockState::kActiveAllocated) {
        // The older (torch <= 2.0) snapshot readers attribute a block's bytes through this.
        py::dict h;
        h["addr"] = b.address;
        h["real_size"] = b.requested_size;
        h["frames"] = blk["frames"];
        py::list history;
        history.append(h);
        blk["history"] = history;
      }
      blocks.append(blk);
    }
    seg["blocks"] = blocks;
    segments.append(seg);
  }
  out["segments"] = segments;
  py::list traces;
  for (size_t device = 0; device < snap.device_traces.size(); ++device) {
    const std::vector<TraceEntry>& device_trace = snap.device_traces[device];
    const std::vector<TraceCategory> categories = AllocationCategories(device_trace, live[device]);
    py::list t;
    for (size_t i = 0; i < device_trace.size(); ++i) {
      const TraceEntry& e = device_trace[i];
      py::dict d;
      d["action"] = std::string(TraceActionName(e.action));
      if (e.action == TraceAction::kOom) {
        d["device_free"] = e.addr;
        d["addr"] = 0;
      } else {
        d["addr"] = e.addr;
      }
      d["size"] = e.size;
      d["stream"] = snap.StreamValue(e.stream);
      d["time_us"] = e.time_us;
      d["frames"] = FramesOf(e.context);
      d["compile_context"] = CompileContextValue(e);
      const char* note = nullptr;
      // Every allocation's entries, "unknown" where nothing was learned: the viewer lists each
      // category it finds in its legend, and some releases of it fail on a snapshot with
      // categories among which "unknown" is missing (a misspelt push in MemoryViz.js).
      if (IsAllocationEvent(e.action)) {
        d["category"] = std::string(TraceCategoryName(categories[i]));
        note = ViewerNote(categories[i]);
      }
      // An annotate entry's user metadata is the annotation itself (AnnotateMemory's labels).
      d["user_metadata"] = UserMetadataValue(e, note);
      // The default pool's (0, 0), as torch writes it for an entry outside a private pool:
      // Spillway has no private pools (MemPool and CUDA graph capture are refused).
      d["pool_id"] = py::make_tuple(0, 0);
      t.append(d);
    }
    traces.append(t);
  }
  out["device_traces"] = traces;
  out["external_annotations"] = AnnotationList(snap.external_annotations);
  py::dict settings;
  const AllocatorConfig& config = allocator.config();
  settings["max_split_size"] = config.max_split_size == std::numeric_limits<size_t>::max()
                                   ? py::int_(-1)
                                   : py::int_(config.max_split_size);
  settings["garbage_collection_threshold"] = config.garbage_collection_threshold;
  settings["expandable_segments"] = false;
  settings["backend"] = "spillway";
  settings["device"] = runtime.mode() == Mode::kSim ? "sim" : "cuda";
  out["allocator_settings"] = settings;
  // Empty unless recorded, as in torch (which writes both keys either way).
  py::list host_segments;
  py::list host_traces;
  if (OffloadEngine* engine = runtime.engine_if_created();
      engine != nullptr && engine->host_history_enabled()) {
    for (const SegmentSnapshot& s : engine->HostSegments())
      host_segments.append(HostSegmentDict(s));
    for (const TraceEntry& e : engine->HostHistory()) host_traces.append(HostTraceDict(e));
  }
  out["host_segments"] = host_segments;
  out["host_traces"] = host_traces;
  py::dict block_sections;
  out["spillway"] = SpillwaySection(runtime, block_sections);
  return out;
}

}  // namespace spillway::torch_layer
