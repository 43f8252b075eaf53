#include "offload/policy.h"

#include <algorithm>

namespace spillway {

bool ForwardFootprint::OnSave(size_t allocated) {
  const bool began = read_since_save;
  if (began) saving_high = spilled_high = room_taken = 0;
  read_since_save = false;
  saving_high = std::max(saving_high, allocated);
  return began;
}

void ForwardFootprint::OnSpilledBytes(size_t spilled_now) {
  spilled_high = std::max(spilled_high, spilled_now);
}

void ForwardSpillQuota::OnForwardStart() {
  const bool again = saves_ == learned_saves_;  // as many saves as the run before
  const bool same = limit_.has_value() && again;
  if (taken_back_ > 0) {
    const size_t across = spilled_ - std::min(spilled_, taken_back_);
    if (limit_.has_value()) {
      limit_ = across;
    } else if (unbound_across_.has_value() && again) {
      limit_ = std::max(*unbound_across_, across);  // taken back in two runs running
    }
    unbound_across_ = limit_.has_value() ? std::nullopt : std::optional<size_t>(across);
  } else {
    unbound_across_.reset();
    if (same && first_deferred_ > 0) {
      limit_ = *limit_ + std::max(*limit_ / 8, first_deferred_);
    } else if (!same) {
      limit_.reset();  // another forward that had nothing taken back: no bound
    }
  }
  learned_saves_ = saves_;
  saves_ = spilled_ = taken_back_ = first_deferred_ = 0;
}

void ForwardSpillAhead::OnSave(size_t allocated, size_t spilled) {
  if (!first_.has_value()) first_ = allocated + spilled;
  save_high_ = std::max(save_high_, allocated + spilled);
}

void ForwardSpillAhead::OnForwardStart(size_t target, size_t allocated, size_t spilled) {
  // Unseen (nothing reached the budget): as it was.
  if (reached_high_ > 0) excess_ = reached_high_ > save_high_ ? reached_high_ - save_high_ : 0;
  const size_t rise = save_high_ - std::min(save_high_, first_.value_or(save_high_)) + excess_;
  const size_t high = allocated + spilled + rise;
  ahead_ = high > target ? high - target : 0;
  first_.reset();
  save_high_ = reached_high_ = spilled_ = 0;
  stopped_ = false;
}

SpillPlan PlanEager(bool forward_end) {
  return SpillPlan{std::nullopt, SpillPlan::Spills::kAllEligible, 0, false, false, forward_end};
}

std::optional<SpillPlan> PlanBudget(size_t allocated, size_t incoming, size_t budget) {
  if (allocated + incoming <= budget) return std::nullopt;
  const size_t target = BudgetTarget(budget);
  const size_t goal = target > incoming ? target - incoming : 0;
  return SpillPlan{goal, SpillPlan::Spills::kToTarget, goal, false, true};
}

size_t BudgetTarget(size_t budget) { return budget - budget / 16; }

SpillPlan PlanRescue(OffloadPolicy policy, size_t allocated, size_t bytes) {
  const size_t target = allocated > bytes ? allocated - bytes : 0;
  // Under "off" nothing is spilled, but prefetches of saves an inner block spilled still go back.
  const SpillPlan::Spills spills =
      policy == OffloadPolicy::kOff ? SpillPlan::Spills::kNone : SpillPlan::Spills::kToTarget;
  return SpillPlan{target, spills, target, true, false};
}

size_t BudgetBytes(const OffloadConfig& config, size_t device_total, size_t memory_limit) {
  if (config.budget_bytes != 0) return config.budget_bytes;
  const size_t base = memory_limit == 0 ? device_total : std::min(memory_limit, device_total);
  return static_cast<size_t>(config.budget_fraction * static_cast<double>(base));
}

size_t WindowLimit(const OffloadConfig& config) { return config.prefetch_bytes.value_or(0); }

PrefetchPlan::PrefetchPlan(std::optional<size_t> window, size_t budget,
                           const ForwardFootprint& footprint)
    : window_(window), budget_(budget), depth_(footprint.spilled_high / 8) {
  size_t ceiling = std::min(budget, footprint.saving_high);
  ceiling -= std::min(ceiling, ceiling / 16 + footprint.room_taken);
  ceiling_ = ceiling;
}

bool PrefetchPlan::Admits(size_t prefetched, size_t allocated, size_t bytes) const {
  const size_t after = allocated + bytes;
  if (after > budget_) return false;
  if (!window_.has_value() && prefetched > 0) {
    return prefetched + bytes <= depth_ && after <= ceiling_;
  }
  return true;
}

}  // namespace spillway
