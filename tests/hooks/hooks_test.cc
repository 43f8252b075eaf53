// The parts of the torch layer that need no Python interpreter, tested with libtorch alone on the
// simulated device: which storages Spillway made (MadeBySpillway), how many hold a storage
// (Holders), and the registry of saves the hooks keep as they are (KeptSaves, KeptRegistration,
// KeptOn, OtherHoldersOfKeptStorages). The Python suite (tests/python) covers the hooks as
// autograd runs them.
//
// One install per process (Runtime is process-wide and cannot be undone): the simulated device
// then serves every CPU tensor made afterwards. The registry is process-wide too: each test
// removes what it registers.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <vector>

#include "hooks/kept_saves.h"
#include "hooks/runtime.h"
#include "hooks/torch_storage.h"

namespace spillway::torch_layer {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

class HooksTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!Runtime::Get().installed()) Runtime::Get().Install("sim", "", 64 * kMiB);
  }
  void TearDown() override {
    // A test that failed half-way may leave registrations: the next must not see them.
    for (const auto& [block, saves] : KeptSaves::Get().ByBlock()) {
      ADD_FAILURE() << saves.size() << " save(s) still registered on block " << block;
    }
  }

  static const c10::StorageImpl* ImplOf(const at::Tensor& tensor) {
    return tensor.storage().unsafeGetStorageImpl();
  }
  static AllocationInfo BlockOf(const at::Tensor& tensor) {
    const std::optional<AllocationInfo> block = SpillwayBlockOf(tensor);
    if (!block.has_value()) throw std::runtime_error("the tensor is in no Spillway block");
    return *block;
  }
};

TEST_F(HooksTest, MadeBySpillwayTellsItsOwnStoragesFromBorrowedMemory) {
  const at::Tensor own = at::empty({256}, at::kFloat);
  EXPECT_TRUE(MadeBySpillway(own.storage()));
  EXPECT_TRUE(Runtime::Get().allocator().Lookup(own.data_ptr()).has_value());
  // A second storage over the same memory (at::from_blob, as DLPack makes): no allocator of its
  // own, and dropping its memory would free nothing.
  const at::Tensor borrowed = at::from_blob(own.data_ptr(), {256}, at::kFloat);
  EXPECT_FALSE(MadeBySpillway(borrowed.storage()));
  std::vector<float> host(16);
  EXPECT_FALSE(MadeBySpillway(at::from_blob(host.data(), {16}, at::kFloat).storage()));
}

// Without a Python object (none is made from C++), the holders are the storage's strong
// references: one per tensor on it, one per c10::Storage handle.
TEST_F(HooksTest, HoldersCountsTheStrongReferencesToAStorage) {
  const at::Tensor base = at::empty({64}, at::kFloat);
  const c10::StorageImpl* impl = ImplOf(base);
  EXPECT_EQ(Holders(impl), 1);
  {
    const at::Tensor view = base.slice(0, 8, 16);
    EXPECT_EQ(Holders(impl), 2);
    // A copy on purpose: a storage handle is one more holder, which is what is counted.
    // NOLINTNEXTLINE(performance-unnecessary-copy-initialization)
    const c10::Storage handle = base.storage();
    EXPECT_EQ(Holders(impl), 3);
  }
  EXPECT_EQ(Holders(impl), 1);
}

TEST_F(HooksTest, AKeptSaveIsFoundOnItsBlockWithItsGeometryUntilRemoved) {
  const at::Tensor base = at::empty({1024}, at::kFloat);
  const at::Tensor view = base.slice(0, 256, 512).view({16, 16});
  const AllocationInfo block = BlockOf(base);
  const uint64_t token = KeptSaves::Get().Add(view);
  ASSERT_NE(token, 0u);
  const std::vector<KeptSave> kept = KeptSaves::Get().On(block);
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_EQ(kept[0].storage, ImplOf(base));
  EXPECT_FALSE(kept[0].nested);
  EXPECT_EQ(kept[0].view.offset, 256);
  EXPECT_EQ(kept[0].view.sizes, (std::vector<int64_t>{16, 16}));
  EXPECT_EQ(kept[0].view.strides, (std::vector<int64_t>{16, 1}));
  EXPECT_EQ(kept[0].view.element_size, sizeof(float));
  const auto by_block = KeptSaves::Get().ByBlock();
  ASSERT_EQ(by_block.count(block.ptr), 1u);
  EXPECT_EQ(by_block.at(block.ptr).size(), 1u);
  // Another block's lookup does not see it.
  const at::Tensor other = at::empty({1024}, at::kFloat);
  EXPECT_TRUE(KeptSaves::Get().On(BlockOf(other)).empty());
  KeptSaves::Get().Remove(token);
  EXPECT_TRUE(KeptSaves::Get().On(block).empty());
}

// Nothing to register: an undefined tensor, and one with no memory. Memory Spillway does not
// serve lies in no block: registered, it shows on none.
TEST_F(HooksTest, SavesWithoutSpillwayMemoryShowOnNoBlock) {
  EXPECT_EQ(KeptSaves::Get().Add(at::Tensor()), 0u);
  EXPECT_EQ(KeptSaves::Get().Add(at::empty({0}, at::kFloat)), 0u);
  std::vector<float> host(16);
  // Kept alive while registered, as the registrant (KeptRegistration) keeps its tensor.
  const at::Tensor outside = at::from_blob(host.data(), {16}, at::kFloat);
  const uint64_t token = KeptSaves::Get().Add(outside);
  EXPECT_TRUE(KeptSaves::Get().ByBlock().empty());
  KeptSaves::Get().Remove(token);
}

TEST_F(HooksTest, ARegistrationLastsAsLongAsItsObjectAndCoversASparseTensorsParts) {
  const at::Tensor dense = at::empty({128}, at::kFloat);
  const AllocationInfo block = BlockOf(dense);
  {
    const KeptRegistration registration(dense);
    EXPECT_EQ(registration.size(), 1u);
    EXPECT_EQ(KeptSaves::Get().On(block).size(), 1u);
  }
  EXPECT_TRUE(KeptSaves::Get().On(block).empty());

  const at::Tensor indices = at::zeros({1, 4}, at::kLong);
  const at::Tensor values = at::ones({4}, at::kFloat);
  const at::Tensor sparse = at::sparse_coo_tensor(indices, values, {8});
  {
    const KeptRegistration registration(sparse);
    EXPECT_EQ(registration.size(), 2u) << "a sparse save holds its indices and its values";
    EXPECT_EQ(KeptSaves::Get().ByBlock().size(), 2u);
  }
  EXPECT_TRUE(KeptSaves::Get().ByBlock().empty());
  EXPECT_EQ(KeptRegistration(at::Tensor()).size(), 0u);
}

TEST_F(HooksTest, ForgetDropsTheSavesOfOneBlockOnly) {
  const at::Tensor first = at::empty({256}, at::kFloat);
  const at::Tensor second = at::empty({256}, at::kFloat);
  const uint64_t a = KeptSaves::Get().Add(first);
  const uint64_t b = KeptSaves::Get().Add(second);
  KeptSaves::Get().Forget(BlockOf(first));
  EXPECT_TRUE(KeptSaves::Get().On(BlockOf(first)).empty());
  EXPECT_EQ(KeptSaves::Get().On(BlockOf(second)).size(), 1u);
  KeptSaves::Get().Remove(a);  // forgotten already: no effect
  KeptSaves::Get().Remove(b);
}

// Two saves on one storage hold it twice between them; every other reference (the tensor the
// views were taken from, a storage handle) is another holder.
TEST_F(HooksTest, OtherHoldersOfKeptStoragesLeaveTheSavesOut) {
  const at::Tensor base = at::empty({512}, at::kFloat);
  const at::Tensor low = base.slice(0, 0, 256);
  const at::Tensor high = base.slice(0, 256, 512);
  const KeptRegistration kept_low(low);
  const KeptRegistration kept_high(high);
  const std::vector<KeptSave> kept = KeptSaves::Get().On(BlockOf(base));
  ASSERT_EQ(kept.size(), 2u);
  EXPECT_EQ(KeptOn(ImplOf(base), kept), 2);
  EXPECT_EQ(OtherHoldersOfKeptStorages(kept), 1);  // `base`
  // A copy on purpose: a storage handle is one more holder, which is what is counted.
  // NOLINTNEXTLINE(performance-unnecessary-copy-initialization)
  const c10::Storage handle = base.storage();
  EXPECT_EQ(OtherHoldersOfKeptStorages(kept), 2);
}

}  // namespace
}  // namespace spillway::torch_layer
