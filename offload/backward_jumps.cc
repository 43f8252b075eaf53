#include "offload/backward_jumps.h"

#include <utility>

namespace spillway {
namespace {
// A cycle that never ends (a graph kept alive for good keeps the engine from emptying) stops
// learning here rather than grow without bound: 12 bytes a save and 8 a run, in the cycle learned
// and the current one, about 40 MiB at most.
constexpr size_t kMaxPositions = size_t{1} << 20;
}  // namespace

void BackwardJumps::OnSave(uint64_t seq, size_t bytes, bool forward) {
  if (!in_cycle_) {
    in_cycle_ = true;
    base_ = seq;
    current_ = Cycle{};
    newest_read_.reset();
    saved_since_read_ = false;
  }
  if (forward && newest_read_.has_value()) saved_since_read_ = true;
  if (seq < base_ || seq - base_ >= kMaxPositions) return;
  const auto pos = static_cast<size_t>(seq - base_);
  if (pos >= current_.bytes.size()) {
    current_.bytes.resize(pos + 1, 0);
    current_.run_of.resize(pos + 1, kNoRun);
  }
  current_.bytes[pos] = bytes;
}

std::optional<size_t> BackwardJumps::Position(uint64_t seq) const {
  if (!in_cycle_ || seq < base_ || seq - base_ >= kMaxPositions) return std::nullopt;
  return static_cast<size_t>(seq - base_);
}

void BackwardJumps::OnRead(uint64_t seq) {
  const std::optional<size_t> pos = Position(seq);
  if (!pos.has_value() || *pos >= current_.run_of.size()) return;
  // A read of a save newer than every one read before begins another run: the next graph's
  // backward. Within one graph's, reads go back and forth between a layer's saves, older than
  // the newest read so far: one run. (A graph's first reads may climb a save or two, a loss
  // reading its saves in save order: each is a run of its own, whose jump is to the read after
  // it, where backward does go.) The run before learns where this one began, unless a forward
  // saved in between.
  const bool newest = !newest_read_.has_value() || *pos > *newest_read_;
  if (newest) {
    if (!current_.next_run_start.empty()) {
      current_.next_run_start.back() = saved_since_read_ ? kNoRun : static_cast<int64_t>(*pos);
    }
    current_.next_run_start.push_back(kNoRun);
  }
  // A save read again (two views, two graphs) belongs to the run that read it first.
  if (current_.run_of[*pos] == kNoRun) {
    current_.run_of[*pos] = static_cast<int32_t>(current_.next_run_start.size() - 1);
  }
  if (newest) newest_read_ = *pos;
  saved_since_read_ = false;
}

void BackwardJumps::OnEmpty() {
  if (!in_cycle_) return;
  // A cycle that read nothing (an evaluation's forward with grad on, a graph dropped unread) says
  // nothing of the next training step's backward: what the last one learned stays.
  if (!current_.next_run_start.empty()) learned_ = std::move(current_);
  current_ = Cycle{};
  in_cycle_ = false;
}

std::optional<BackwardJumps::Jump> BackwardJumps::After(uint64_t seq) const {
  const std::optional<size_t> pos = Position(seq);
  if (!pos.has_value() || *pos >= learned_.run_of.size()) return std::nullopt;
  const int32_t run = learned_.run_of[*pos];
  if (run == kNoRun) return std::nullopt;
  const int64_t next = learned_.next_run_start[static_cast<size_t>(run)];
  if (next == kNoRun) return std::nullopt;
  const auto at = static_cast<size_t>(next);
  return Jump{base_ + at, learned_.bytes[at]};
}

}  // namespace spillway
