#include "hooks/kept_saves.h"

#include <algorithm>
#include <vector>

#include "hooks/runtime.h"
#include "hooks/torch_storage.h"

namespace spillway::torch_layer {
namespace {

// The storage's data pointer, or null when it has none (or refuses to say: wrapper subclasses,
// some releases' nested tensors answer has_storage() yet refuse storage()).
const void* DataOf(const at::Tensor& tensor) {
  try {
    return tensor.has_storage() ? tensor.storage().data() : nullptr;
  } catch (const std::exception&) {
    return nullptr;
  }
}

bool Within(const void* data, const AllocationInfo& block) {
  const auto* start = static_cast<const char*>(block.ptr);
  const auto* at = static_cast<const char*>(data);
  return data != nullptr && at >= start && at < start + block.size;
}

// The tensors with storages of their own that hold `tensor`'s memory: itself, or a sparse
// tensor's components (storage() refuses sparse tensors; their indices and values are strided).
std::vector<at::Tensor> PartsWithStorage(const at::Tensor& tensor) {
  switch (tensor.layout()) {
    case at::kSparse:
      return {tensor._indices(), tensor._values()};
    case at::kSparseCsr:
    case at::kSparseBsr:
      return {tensor.crow_indices(), tensor.col_indices(), tensor.values()};
    case at::kSparseCsc:
    case at::kSparseBsc:
      return {tensor.ccol_indices(), tensor.row_indices(), tensor.values()};
    default:
      return {tensor};
  }
}

}  // namespace

KeptRegistration::KeptRegistration(const at::Tensor& tensor) {
  if (!tensor.defined()) return;
  try {
    for (const at::Tensor& part : PartsWithStorage(tensor)) {
      if (const uint64_t token = KeptSaves::Get().Add(part); token != 0) tokens_.push_back(token);
    }
  } catch (...) {
    for (const uint64_t token : tokens_) KeptSaves::Get().Remove(token);
    throw;
  }
}

KeptRegistration::~KeptRegistration() {
  for (const uint64_t token : tokens_) KeptSaves::Get().Remove(token);
}

KeptSaves& KeptSaves::Get() {
  // Leaked: handles may go away during interpreter shutdown, after static destructors ran.
  static auto* const saves = new KeptSaves();  // NOLINT(cppcoreguidelines-owning-memory)
  return *saves;
}

std::optional<AllocationInfo> SpillwayBlockOf(const at::Tensor& tensor) {
  const Runtime& runtime = Runtime::Get();
  if (!runtime.installed() || !tensor.defined()) return std::nullopt;
  const void* data = DataOf(tensor);
  if (data == nullptr || !runtime.Serves(tensor.device())) return std::nullopt;
  return runtime.allocator().LookupContaining(data);
}

uint64_t KeptSaves::Add(const at::Tensor& tensor) {
  const Runtime& runtime = Runtime::Get();
  if (!runtime.installed() || !tensor.defined() || !runtime.Serves(tensor.device())) return 0;
  KeptSave save;
  try {
    save.storage = tensor.storage().unsafeGetStorageImpl();
  } catch (const std::exception&) {
    return 0;  // no storage to be had (a wrapper subclass, in newer torch)
  }
  // No memory: a wrapper subclass's empty storage (in torch 1.13), or an empty tensor. Neither
  // reads memory Spillway could free.
  if (save.storage->data() == nullptr) return 0;
  save.view.element_size = static_cast<size_t>(tensor.element_size());
  if (tensor.is_nested()) {
    // A nested tensor has no sizes or strides of its own: its view is the buffer it keeps whole.
    save.nested = true;
    save.view.sizes = {static_cast<int64_t>(tensor.storage().nbytes() / save.view.element_size)};
    save.view.strides = {1};
    save.view.offset = 0;
  } else {
    save.view.sizes = tensor.sizes().vec();
    save.view.strides = tensor.strides().vec();
    save.view.offset = tensor.storage_offset();
  }
  std::lock_guard lock(mutex_);
  const uint64_t token = next_token_++;
  saves_.emplace(token, std::move(save));
  return token;
}

void KeptSaves::Remove(uint64_t token) {
  std::lock_guard lock(mutex_);
  saves_.erase(token);
}

// The lookups below run under the lock: a registration's storage is alive only until its removal,
// which waits for the lock.
std::vector<KeptSave> KeptSaves::On(const AllocationInfo& block) const {
  std::lock_guard lock(mutex_);
  std::vector<KeptSave> out;
  for (const auto& [token, save] : saves_) {
    if (Within(save.storage->data(), block)) out.push_back(save);
  }
  return out;
}

std::map<const void*, std::vector<KeptSave>> KeptSaves::ByBlock() const {
  const CachingAllocator& allocator = Runtime::Get().allocator();
  std::lock_guard lock(mutex_);
  std::map<const void*, std::vector<KeptSave>> out;
  for (const auto& [token, save] : saves_) {
    const void* data = save.storage->data();
    if (data == nullptr) continue;
    if (const std::optional<AllocationInfo> block = allocator.LookupContaining(data)) {
      out[block->ptr].push_back(save);
    }
  }
  return out;
}

void KeptSaves::Forget(const AllocationInfo& block) {
  std::lock_guard lock(mutex_);
  absl::erase_if(saves_,
                 [&](const auto& item) { return Within(item.second.storage->data(), block); });
}

int64_t KeptOn(const c10::StorageImpl* storage, const std::vector<KeptSave>& kept) {
  return static_cast<int64_t>(std::count_if(
      kept.begin(), kept.end(), [&](const KeptSave& k) { return k.storage == storage; }));
}

int64_t OtherHoldersOfKeptStorages(const std::vector<KeptSave>& kept) {
  int64_t others = 0;
  std::vector<const c10::StorageImpl*> seen;
  for (const KeptSave& k : kept) {
    if (std::find(seen.begin(), seen.end(), k.storage) != seen.end()) continue;
    seen.push_back(k.storage);
    others += Holders(k.storage) - KeptOn(k.storage, kept);
  }
  return others;
}

}  // namespace spillway::torch_layer
