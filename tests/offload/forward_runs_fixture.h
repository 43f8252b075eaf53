// Runs of a forward and its backward through the engine, for the tests of what a policy learns
// from one run of a forward for the next (link_quota_test.cc: eager's bound; spill_ahead_test.cc:
// auto's spills ahead of its budget).
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "tests/offload/fault_fixture.h"

namespace spillway::testing {

class OffloadForwardRuns : public OffloadFaultInjection {
 protected:
  using Saves = std::vector<std::shared_ptr<TestStorage>>;

  // A forward's save: a new storage of 4 MiB with the bytes of `seed`, saved (the program still
  // holds it).
  std::shared_ptr<TestStorage> SaveNew(uint32_t seed) {
    std::shared_ptr<TestStorage> s = NewStorage(4 * kMiB, seed);
    ids_[s.get()] = Save(s);
    return s;
  }

  // Backward: reads `saves` from `keep` on (saves[i] made with `seed` + i), newest first, and lets
  // them go, storages and all (the next forward finds the memory as a training step's would);
  // the first `keep` stay, unread.
  void Backward(Saves& saves, uint32_t seed, size_t keep = 0) {
    for (size_t i = saves.size(); i-- > keep;) {
      const std::shared_ptr<TestStorage>& s = saves[i];
      const KeeperId id = ids_.at(s.get());
      EXPECT_EQ(AcquireAndRead(id, s->nbytes()), Pattern(s->nbytes(), seed + uint32_t(i)));
      engine_->RemoveKeeper(id);
      ids_.erase(s.get());
      std::erase(storages_, s);
    }
    saves.resize(keep);
  }

  // Another policy runs, then the engine's own again: what a policy learned of its forwards
  // goes with the change.
  void AnotherPolicyInBetween(OffloadPolicy other) {
    OffloadConfig config = engine_->config();
    const OffloadPolicy own = config.policy;
    config.policy = other;
    engine_->SetConfig(config);
    config.policy = own;
    engine_->SetConfig(config);
  }

  int Spilled(const Saves& saves) {
    int n = 0;
    for (const auto& s : saves) n += StateOf(s) != Residency::kResident ? 1 : 0;
    return n;
  }

  std::map<const TestStorage*, KeeperId> ids_;
};

}  // namespace spillway::testing
