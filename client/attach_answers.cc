#include "client/attach_answers.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/same_bits.h"

namespace shardopt {

namespace {

// The lowest and highest step of the servers holding a part; lo > hi if
// none does.
std::pair<uint64_t, uint64_t> StepSpan(const std::vector<v1::CreateJobResponse>& answers,
                                       const std::vector<bool>& holds_part) {
  uint64_t lo = std::numeric_limits<uint64_t>::max(), hi = 0;
  for (size_t s = 0; s < answers.size(); ++s) {
    if (!holds_part[s]) continue;
    lo = std::min(lo, answers[s].step());
    hi = std::max(hi, answers[s].step());
  }
  return {lo, hi};
}

}  // namespace

bool OneStepApart(const std::vector<v1::CreateJobResponse>& answers, const std::vector<bool>& holds_part) {
  const auto [lo, hi] = StepSpan(answers, holds_part);
  return lo <= hi && hi == lo + 1;
}

std::optional<HalfCommitted> FindHalfCommittedStep(const std::vector<v1::CreateJobResponse>& answers,
                                                   const std::vector<bool>& holds_part) {
  if (!OneStepApart(answers, holds_part)) return std::nullopt;
  const uint64_t hi = StepSpan(answers, holds_part).second;
  const v1::CreateJobResponse* applied = nullptr;
  HalfCommitted half;
  for (size_t s = 0; s < answers.size(); ++s) {
    if (!holds_part[s]) continue;
    const v1::CreateJobResponse& a = answers[s];
    // Every server keeps step hi's sealed round: those behind, to apply it
    // from; the others, past it, since hi was the last one sealed.
    if (a.sealed_step() != hi) return std::nullopt;
    if (a.step() != hi) {
      half.behind.push_back(static_cast<uint32_t>(s));
    } else if (applied == nullptr) {
      applied = &a;
    } else if (a.applied_skip() != applied->applied_skip() ||
               // Any two skips are the same commit (an older server's may
               // report the numbers it was sent).
               (!a.applied_skip() &&
                (!SameBits(a.applied_lr(), applied->applied_lr()) ||
                 !SameBits(a.applied_gscale(), applied->applied_gscale()) ||
                 !std::equal(a.applied_group_lr().begin(), a.applied_group_lr().end(),
                             applied->applied_group_lr().begin(), applied->applied_group_lr().end(), SameBits<double>)))) {
      return std::nullopt;
    }
  }
  half.commit.set_step(hi);
  half.commit.set_skip(applied->applied_skip());
  if (applied->applied_skip()) {
    half.commit.set_lr(0.0);  // a skip's arguments, as every skip is sent
    half.commit.set_gscale(1.0f);
  } else {
    half.commit.set_lr(applied->applied_lr());
    half.commit.set_gscale(applied->applied_gscale());
    *half.commit.mutable_group_lr() = applied->applied_group_lr();
  }
  return half;
}

absl::StatusOr<uint64_t> AgreedStep(const std::vector<v1::CreateJobResponse>& answers,
                                    const std::vector<bool>& holds_part, const std::vector<std::string>& addresses,
                                    const std::string& job) {
  std::vector<std::string> seen;
  bool differ = false, first = true;
  uint64_t step = 0;
  for (size_t s = 0; s < answers.size(); ++s) {
    if (!holds_part[s]) continue;
    seen.push_back(absl::StrCat(addresses[s], " at step ", answers[s].step()));
    if (!first && answers[s].step() != step) differ = true;
    step = answers[s].step();
    first = false;
  }
  if (differ) {
    return absl::FailedPreconditionError(absl::StrCat("job '", job, "': servers disagree on the step (",
                                                      absl::StrJoin(seen, ", "),
                                                      "); restore every server from one checkpoint, or drop the job "
                                                      "on each (shardopt --server=HOST:PORT drop JOB)"));
  }
  return step;
}

std::optional<DrainTorn> FindDrainTornStep(const std::vector<v1::CreateJobResponse>& answers,
                                           const std::vector<bool>& holds_part) {
  const auto [lo, hi] = StepSpan(answers, holds_part);
  if (lo >= hi) return std::nullopt;  // none holds a part, or all agree
  DrainTorn torn;
  torn.step = hi;
  for (size_t s = 0; s < answers.size(); ++s) {
    if (!holds_part[s]) continue;
    if (answers[s].step() == hi) {
      torn.at.push_back(static_cast<uint32_t>(s));
    } else if (answers[s].has_own_part_step() && answers[s].own_part_step() == hi) {
      torn.behind.push_back(static_cast<uint32_t>(s));
    } else {
      return std::nullopt;  // behind with nothing of `hi` on disk: lost steps, not a drain
    }
  }
  return torn;
}

std::string ReattachOutcome(const v1::CreateJobResponse& answer) {
  if (answer.restored()) return absl::StrCat("restored step ", answer.step());
  if (!answer.created()) {
    return absl::StrCat("holds it at step ", answer.step(), " (another trainer's attach restored or made it first)");
  }
  return "has no checkpoint of it";
}

std::vector<double> AppliedGroupLr(const std::vector<v1::CreateJobResponse>& answers, uint64_t step,
                                   const std::vector<bool>& holds_part, size_t groups) {
  for (size_t s = 0; s < answers.size(); ++s) {
    const v1::CreateJobResponse& a = answers[s];
    // No commit applies with gscale 0 (a skip records 1): 0 is a server, or a
    // checkpoint, too old to say what its step was applied with.
    if (!holds_part[s] || step == 0 || a.step() != step || a.applied_skip() || a.applied_gscale() == 0) continue;
    if (static_cast<size_t>(a.applied_group_lr_size()) == groups) {
      return {a.applied_group_lr().begin(), a.applied_group_lr().end()};
    }
    // A commit without group lrs applied its lr to every group.
    if (a.applied_group_lr_size() == 0) return std::vector<double>(groups, a.applied_lr());
  }
  return {};
}

uint64_t PushedAhead(const std::vector<v1::CreateJobResponse>& answers, uint64_t step,
                     const std::vector<bool>& holds_part, const std::vector<bool>& pushes_to) {
  for (size_t s = 0; s < answers.size(); ++s) {
    if (holds_part[s] && pushes_to[s] && (answers[s].sealed_step() == step + 1 || answers[s].rank_pushed())) {
      return step + 1;
    }
  }
  return 0;
}

}  // namespace shardopt
