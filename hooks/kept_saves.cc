#include "hooks/kept_saves.h"

#include "hooks/runtime.h"

namespace spillway::torch_layer {

KeptSaves& KeptSaves::Get() {
  // Leaked: handles may go away during interpreter shutdown, after static destructors ran.
  static auto* const saves = new KeptSaves();  // NOLINT(cppcoreguidelines-owning-memory)
  return *saves;
}

std::optional<const void*> SpillwayBlockOf(const at::Tensor& tensor) {
  const Runtime& runtime = Runtime::Get();
  if (!runtime.installed() || !tensor.defined()) return std::nullopt;
  const void* data = nullptr;
  try {
    // Some kinds answer has_storage() yet refuse storage() (wrapper subclasses, some releases'
    // nested tensors): then there is no memory to name.
    if (!tensor.has_storage()) return std::nullopt;
    data = tensor.storage().data();
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (data == nullptr || !runtime.Serves(tensor.device())) return std::nullopt;
  const std::optional<AllocationInfo> block = runtime.allocator().LookupContaining(data);
  if (!block) return std::nullopt;
  return block->ptr;
}

uint64_t KeptSaves::Add(const at::Tensor& tensor) {
  const std::optional<const void*> block = SpillwayBlockOf(tensor);
  if (!block) return 0;
  KeptSave save;
  save.block = *block;
  save.storage = tensor.storage().unsafeGetStorageImpl();
  // Nested tensors have no sizes or strides of their own (their buffer's are kept as they are).
  if (!tensor.is_nested()) {
    save.view.sizes = tensor.sizes().vec();
    save.view.strides = tensor.strides().vec();
    save.view.offset = tensor.storage_offset();
    save.view.element_size = static_cast<size_t>(tensor.element_size());
  }
  std::lock_guard lock(mutex_);
  const uint64_t token = next_token_++;
  by_block_[save.block].emplace(token, save);
  block_of_.emplace(token, save.block);
  return token;
}

void KeptSaves::Remove(uint64_t token) {
  std::lock_guard lock(mutex_);
  const auto it = block_of_.find(token);
  if (it == block_of_.end()) return;
  const auto saves = by_block_.find(it->second);
  saves->second.erase(token);
  if (saves->second.empty()) by_block_.erase(saves);
  block_of_.erase(it);
}

void KeptSaves::Forget(const void* block) {
  std::lock_guard lock(mutex_);
  const auto it = by_block_.find(block);
  if (it == by_block_.end()) return;
  for (const auto& [token, save] : it->second) block_of_.erase(token);
  by_block_.erase(it);
}

std::vector<KeptSave> KeptSaves::On(const void* block) const {
  std::lock_guard lock(mutex_);
  std::vector<KeptSave> out;
  if (const auto it = by_block_.find(block); it != by_block_.end()) {
    for (const auto& [token, save] : it->second) out.push_back(save);
  }
  return out;
}

std::vector<const void*> KeptSaves::Blocks() const {
  std::lock_guard lock(mutex_);
  std::vector<const void*> out;
  for (const auto& [block, saves] : by_block_) out.push_back(block);
  return out;
}

}  // namespace spillway::torch_layer
