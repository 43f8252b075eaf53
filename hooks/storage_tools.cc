#include "hooks/storage_tools.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <string>

#include "allocator/errors.h"
#include "hooks/kept_saves.h"
#include "hooks/runtime.h"
#include "hooks/torch_storage.h"

namespace py = pybind11;

namespace spillway::torch_layer {
namespace {

// Kept as Python objects: only touched with the GIL held (release() and snapshot() run in Python).
constexpr size_t kMaxReleases = 1024;
py::list& Releases() {
  static auto* releases = new py::list();  // NOLINT: leaked, Python may be finalizing at exit
  return *releases;
}

std::optional<EntryInfo> EntryOf(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.has_storage()) return std::nullopt;
  OffloadEngine* engine = Runtime::Get().engine_if_created();
  if (engine == nullptr) return std::nullopt;
  return engine->Describe(tensor.storage().unsafeGetStorageImpl());
}

// The saves kept as they are (by the hooks, or in Python) over the tensor's block.
std::vector<KeptSave> KeptSavesOf(const at::Tensor& tensor) {
  const std::optional<AllocationInfo> block = SpillwayBlockOf(tensor);
  return block ? KeptSaves::Get().On(*block) : std::vector<KeptSave>();
}

// A release report whose dicts and lists are its own.
py::dict CopyOfReport(py::handle report) {
  py::dict copy = report.attr("copy")();
  py::list keepers;
  for (const py::handle k : copy["keepers"]) keepers.append(k.attr("copy")());
  copy["keepers"] = keepers;
  return copy;
}

void CheckTensor(const at::Tensor& tensor, const char* what) {
  if (!tensor.defined() || !tensor.has_storage()) {
    throw InvalidArgumentError(std::string(what) +
                               ": expected a tensor with a storage (a dense, strided tensor)");
  }
}

}  // namespace

py::dict SavedViewDict(const ViewInfo& view) {
  py::dict d;
  d["kind"] = "saved";
  d["shape"] = py::tuple(py::cast(view.sizes));
  d["stride"] = py::tuple(py::cast(view.strides));
  d["offset"] = view.offset;
  return d;
}

py::list SavedViewDicts(const EntryInfo& entry) {
  py::list out;
  for (const KeeperInfo& k : entry.keepers) {
    py::dict d = SavedViewDict(k.view);
    if (k.lost) d["lost"] = true;  // its backward raises: the bytes it saved are gone
    out.append(d);
  }
  return out;
}

py::dict KeptSaveDict(const KeptSave& save) {
  py::dict d = SavedViewDict(save.view);
  if (save.nested) d["nested"] = true;
  return d;
}

py::list KeptSaveDicts(const std::vector<KeptSave>& kept) {
  py::list out;
  for (const KeptSave& save : kept) out.append(KeptSaveDict(save));
  return out;
}

namespace {

// keepers() of a tensor whose entry and kept saves were looked up already.
py::list KeepersOf(const at::Tensor& tensor, const std::optional<EntryInfo>& entry,
                   const std::vector<KeptSave>& kept) {
  py::list out = entry ? SavedViewDicts(*entry) : py::list();
  // Saves kept as they are hold the storage through tensors of their own (counted among its
  // holders when on this very storage, not when on a second storage over its memory).
  for (const KeptSave& save : kept) out.append(KeptSaveDict(save));
  const int64_t ours = entry ? 1 : 0;  // the engine's binding
  const int64_t external = Holders(tensor.storage().unsafeGetStorageImpl()) - ours -
                           KeptOn(tensor.storage().unsafeGetStorageImpl(), kept);
  if (external > 0) {
    py::dict d;
    d["kind"] = "external";
    d["count"] = external;
    out.append(d);
  }
  return out;
}

}  // namespace

py::list Keepers(const at::Tensor& tensor) {
  CheckTensor(tensor, "spillway.keepers");
  return KeepersOf(tensor, EntryOf(tensor), KeptSavesOf(tensor));
}

py::dict Release(const at::Tensor& tensor, bool force) {
  CheckTensor(tensor, "spillway.release");
  const std::optional<EntryInfo> entry = EntryOf(tensor);
  // Saves whose bytes are lost already (a forced release, a failed copy) have nothing to lose.
  const auto needed = entry ? std::count_if(entry->keepers.begin(), entry->keepers.end(),
                                            [](const KeeperInfo& k) { return !k.lost; })
                            : 0;
  if (needed > 0 && !force) {
    throw InvalidArgumentError(
        "spillway.release: " + std::to_string(needed) +
        " tensor(s) saved for backward still keep this storage; releasing it would corrupt the "
        "backward pass. Pass force=True if they will never be read.");
  }
  // Saves the hooks kept as they are read the memory itself at backward: freed, that read would
  // crash or return garbage, where a tracked save raises.
  // Looked up once: each lookup takes the allocator's lock.
  const std::optional<AllocationInfo> block = SpillwayBlockOf(tensor);
  const std::vector<KeptSave> kept = block ? KeptSaves::Get().On(*block) : std::vector<KeptSave>();
  if (!kept.empty() && !force) {
    throw InvalidArgumentError(
        "spillway.release: " + std::to_string(kept.size()) +
        " tensor(s) saved for backward and kept as they are (tensor subclasses, nested, "
        "quantized or sparse tensors, a second storage over this memory such as "
        "torch.from_numpy(t.numpy())) still read this storage's memory; releasing it would "
        "corrupt the backward pass. Pass force=True if they will never be read.");
  }
  // A storage with no memory passes the check below: one on a device Spillway does not serve (a
  // meta tensor, say) must not be emptied all the same.
  Runtime::Get().CheckServes(tensor.device(), "spillway.release");
  const c10::Storage& storage = tensor.storage();
  // Memory of another allocator (torch.from_numpy, a tensor made before install), or a second
  // storage over Spillway's (torch.from_numpy(t.numpy()), DLPack): dropping the storage's hold
  // frees nothing of Spillway's, and "freed_bytes" would say otherwise.
  if (storage.data_ptr().get() != nullptr && !MadeBySpillway(storage)) {
    throw InvalidArgumentError(
        "spillway.release: this tensor's memory is not Spillway's, or not through this storage "
        "(another allocator made it: torch.from_numpy, a tensor created before spillway.install, "
        "or a second storage over Spillway's memory: torch.from_numpy(t.numpy()), DLPack); "
        "release frees only storages that Spillway allocated");
  }
  // Saves made outside Spillway's hooks are invisible to it, and backward then reads freed memory
  // (a crash, not an error). A tensor in an autograd graph is the likely case: a parameter, or an
  // output whose own node saved it.
  if (tensor.requires_grad() && !force) {
    throw InvalidArgumentError(
        "spillway.release: the tensor requires grad (a parameter, or part of an autograd graph), "
        "so backward or an optimizer may still read its storage, which Spillway cannot see unless "
        "saved under its hooks; freed, that read would crash. Pass force=True if nothing will "
        "read it again.");
  }
  py::list keepers = KeepersOf(tensor, entry, kept);
  const int64_t ours = entry ? 1 : 0;
  // The tensor passed in is one holder; the caller asks about the others.
  const int64_t other_holders = Holders(storage.unsafeGetStorageImpl()) - ours - 1;
  const size_t freed = storage.data_ptr().get() != nullptr ? storage.nbytes() : 0;
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  // Forced past saved views: backward must fail at their unpack rather than read freed memory,
  // and nothing may reload the storage (its host copy, if any, goes now).
  if (entry) {
    Runtime::Get().engine().MarkReleased(
        impl, "its storage was freed by spillway.release(force=True) before backward read it");
  }
  // Forced past kept saves: the block goes back and may serve the next tensor, which they must
  // not be taken to hold.
  if (block) KeptSaves::Get().Forget(*block);
  impl->set_data_ptr_noswap(c10::DataPtr(nullptr, storage.device()));
  impl->set_nbytes(0);
  py::dict out;
  out["freed_bytes"] = freed;
  out["other_holders"] = other_holders;
  out["keepers"] = keepers;
  py::list& log = Releases();
  if (py::len(log) == kMaxReleases) log.attr("pop")(0);
  // The log keeps a copy of its own: the caller may change the dict it gets back.
  log.append(CopyOfReport(out));
  return out;
}

py::list ReleaseLog() {
  // Copies, for the same reason: a snapshot's caller may change what it got.
  py::list out;
  for (const py::handle report : Releases()) out.append(CopyOfReport(report));
  return out;
}

py::object ResidencyOf(const at::Tensor& tensor) {
  const std::optional<EntryInfo> entry = EntryOf(tensor);
  // Saves kept as they are stay on the device.
  if (!entry) {
    if (KeptSavesOf(tensor).empty()) return py::none();
    return py::str("resident");
  }
  return py::str(std::string(ResidencyName(entry->residency)));
}

}  // namespace spillway::torch_layer
