#include "hooks/saved_tensors.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>

#include <sstream>

#include "allocator/errors.h"
#include "hooks/cuda_allocator.h"
#include "hooks/runtime.h"
#include "hooks/torch_storage.h"

namespace spillway::torch_layer {
namespace {

int DeviceIndexOf(const at::Tensor& t) {
  return t.is_cuda() ? static_cast<int>(t.get_device()) : 0;
}

// Why Spillway keeps `t` as it is, or empty when it can manage it.
const char* SkipReason(const at::Tensor& t, const Runtime& runtime) {
  if (!t.defined()) return "undefined";
  // Before anything that reads sizes or strides, which nested tensors refuse (their layout
  // reads as strided in some releases).
  if (t.is_nested()) return "nested";
  if (t.layout() != at::kStrided) return "layout";
  if (t.key_set().has(c10::DispatchKey::Python)) return "subclass";
  if (t.is_quantized()) return "quantized";
  if (!t.has_storage()) return "no_storage";
  if (!runtime.Serves(t.device())) return "other_device";
  return nullptr;
}

}  // namespace

SavedHandle::SavedHandle(const at::Tensor& kept)
    : kept_(kept.defined() ? kept.detach() : kept), kept_registration_(kept_) {
  if (!kept.defined()) return;
  options_ = kept.options();
  if (!kept.is_nested()) sizes_ = kept.sizes().vec();  // for messages; nested tensors have none
  version_counter_ = kept.unsafeGetTensorImpl()->version_counter();
  if (version_counter_.enabled()) saved_version_ = version_counter_.current_version();
}

SavedHandle::SavedHandle(KeeperId id, const at::Tensor& t)
    : id_(id),
      sizes_(t.sizes().vec()),
      strides_(t.strides().vec()),
      offset_(t.storage_offset()),
      options_(t.options()),
      conj_(t.is_conj()),
      neg_(t.is_neg()),
      version_counter_(t.unsafeGetTensorImpl()->version_counter()),
      saved_version_(t.unsafeGetTensorImpl()->version_counter().current_version()) {}

SavedHandle::~SavedHandle() {
  if (!managed()) return;
  try {
    Runtime::Get().engine().RemoveKeeper(id_);
  } catch (const std::exception&) {
    // A destructor cannot report; the keeper is gone either way.
  }
}

std::string SavedHandle::Describe() const {
  std::ostringstream out;
  out << c10::toString(c10::typeMetaToScalarType(options_.dtype())) << "[";
  for (size_t i = 0; i < sizes_.size(); ++i) out << (i ? ", " : "") << sizes_[i];
  out << "]";
  return out.str();
}

void SavedHandle::CheckVersion() const {
  if (!version_counter_.enabled()) return;  // undefined, or an inference tensor: nothing to track
  const uint32_t current = version_counter_.current_version();
  TORCH_CHECK(current == saved_version_,
              "one of the variables needed for gradient computation has been modified by an "
              "inplace operation: [",
              Describe(), "] is at version ", current, "; expected version ", saved_version_,
              " instead. Hint: the tensor was saved for backward (",
              // Whether it was spilled does not matter here: the version is checked either way.
              managed() ? "tracked for offload" : "kept as it is",
              " by Spillway) and changed in place afterwards.");
}

at::Tensor SavedHandle::ViewOn(const c10::Storage& storage) const {
  // What at::empty({0}, options) then set_(storage, offset, sizes, strides) made, without their
  // two trips through the dispatcher: those were three quarters of an unpack's instructions (and
  // a zero-byte allocation), measured with callgrind on 2026-12-08. set_'s bounds check is kept:
  // a storage shrunk in place after the save has no bytes for the view.
  const auto needed = at::detail::computeStorageNbytes(
      sizes_, strides_, options_.dtype().itemsize(), static_cast<size_t>(offset_));
  TORCH_CHECK(needed <= storage.nbytes(), "spillway: the saved tensor ", Describe(),
              " cannot be used in backward: its view needs ", needed,
              " bytes of its storage, which holds ", storage.nbytes(),
              " since it was resized after the save");
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(storage), c10::DispatchKeySet(options_.computeDispatchKey()), options_.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(sizes_, strides_, offset_);
  if (conj_) out._set_conj(true);
  if (neg_) out._set_neg(true);
  return out;
}

at::Tensor SavedHandle::Unpack() const {
  CheckVersion();
  if (!managed()) return kept_;
  Runtime& runtime = Runtime::Get();
  OffloadEngine& engine = runtime.engine();
  auto storage = std::dynamic_pointer_cast<TorchStorage>(engine.StorageOf(id_));
  TORCH_CHECK(storage != nullptr, "spillway: saved tensor ", Describe(), " was already released");
  // A storage freed under the saved view (spillway.release(force=True), or resized to nothing)
  // has no bytes to give: building the view would allocate fresh, uninitialized memory for it.
  TORCH_CHECK(storage->nbytes() > 0, "spillway: the saved tensor ", Describe(),
              " cannot be used in backward: its storage was freed (spillway.release(force=True), "
              "or resized to 0 bytes) after it was saved");
  // Build the view first: it holds the storage from here on, so nothing (a prefetch's
  // out-of-memory rescue, another thread's budget check) can spill it between the reload and
  // the caller's first use. The view reads the storage's data pointer only when used.
  at::Tensor out = ViewOn(storage->storage());
  const StreamRef consumer = runtime.CurrentStream(storage->device());
  try {
    engine.Acquire(id_, consumer);
    if (runtime.host_consumers()) engine.WaitResident(id_);
  } catch (const OutOfMemoryError& e) {
    // The reload's allocation was made inside the engine's operation, so PyTorch's out-of-memory
    // observers hear of it only now. Out of memory stays out of memory
    // (torch.cuda.OutOfMemoryError), so that programs that catch it to shrink their batch see it
    // as such.
    if (options_.device().is_cuda()) NotifyOutOfMemory(e);
    C10_THROW_ERROR(OutOfMemoryError, "spillway could not bring back the saved tensor " +
                                          Describe() + ": " + e.what());
  } catch (const ProgramStreamError& e) {
    // The program's own copy failed; Spillway's record on its stream only heard of it first.
    TORCH_CHECK(false, "an earlier copy on the current stream failed (heard of while unpacking ",
                Describe(), " for backward): ", e.what());
  } catch (const Error& e) {
    TORCH_CHECK(false, "spillway could not bring back the saved tensor ", Describe(), ": ",
                e.what());
  }
  return out;
}

std::shared_ptr<SavedHandle> Pack(const at::Tensor& tensor, std::optional<SaveSettings> settings) {
  Runtime& runtime = Runtime::Get();
  OffloadEngine& engine = runtime.engine();
  if (const char* reason = SkipReason(tensor, runtime)) {
    engine.CountSkip(reason);
    return std::make_shared<SavedHandle>(tensor);
  }
  const c10::Storage& storage = tensor.storage();
  // A second storage over Spillway's memory (from_numpy, DLPack): spilling it would free nothing,
  // and it has no allocator to reload with. Only that needs asking here: AddKeeper looks the
  // pointer up in the allocator anyway, and refuses memory that is not one of its blocks.
  // (Empty storages are the engine's to count.)
  if (storage.nbytes() > 0 && storage.unsafeGetStorageImpl()->allocator() == nullptr) {
    engine.CountSkip(kSkipForeign);
    return std::make_shared<SavedHandle>(tensor);
  }
  const int device = DeviceIndexOf(tensor);
  // A save made while the autograd engine runs a backward on this thread that frees its graph as
  // it goes (a reentrant checkpoint's recomputation) is read within that backward: the engine
  // keeps it on the device and counts it in no forward (SavePhase). A backward that keeps its
  // graph (create_graph, retain_graph) may be saving for a later backward, which reads it as it
  // reads a forward's saves: those are a forward's. Under an offload block around the whole step,
  // or the environment hook's process-wide hooks, such saves reach the hooks as any other. One
  // thread-local read per save: outside any backward autograd answers "keeps its graph" (true).
  const SavePhase phase = torch::autograd::get_current_graph_task_keep_graph()
                              ? SavePhase::kForward
                              : SavePhase::kBackward;
  ViewInfo view;
  view.offset = tensor.storage_offset();
  view.sizes = tensor.sizes().vec();
  view.strides = tensor.strides().vec();
  view.element_size = static_cast<size_t>(tensor.element_size());
  const std::optional<KeeperId> id = engine.AddKeeper(
      storage.unsafeGetStorageImpl(),
      [&] { return std::make_shared<TorchStorage>(storage, device); }, std::move(view),
      runtime.CurrentStream(device), settings, phase);
  if (!id) return std::make_shared<SavedHandle>(tensor);
  return std::make_shared<SavedHandle>(*id, tensor);
}

at::Tensor Unpack(const SavedHandle& handle) { return handle.Unpack(); }

void ForwardEnd() {
  if (OffloadEngine* engine = Runtime::Get().engine_if_created()) engine->ForwardEnd();
}

}  // namespace spillway::torch_layer
