#include "server/step_intents.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/same_bits.h"
#include "base/shortest_number.h"

namespace shardopt {
namespace {

std::string Lrs(const v1::StepIntent& i) {
  std::string out = "[";
  for (int g = 0; g < i.group_lr_size(); ++g) absl::StrAppend(&out, g > 0 ? ", " : "", ShortestNumber(i.group_lr(g)));
  return out + "]";
}

// The first field in which `b` differs from `a`, as "what: a's, b's";
// empty when they are the same bits.
std::pair<std::string, std::pair<std::string, std::string>> FirstDifference(const v1::StepIntent& a,
                                                                            const v1::StepIntent& b) {
  if (!SameBits(a.lr(), b.lr())) return {"lr", {ShortestNumber(a.lr()), ShortestNumber(b.lr())}};
  bool same_groups = a.group_lr_size() == b.group_lr_size();
  for (int g = 0; same_groups && g < a.group_lr_size(); ++g) same_groups = SameBits(a.group_lr(g), b.group_lr(g));
  if (!same_groups) return {"group lrs", {Lrs(a), Lrs(b)}};
  if (!SameBits(a.max_grad_norm(), b.max_grad_norm())) {
    return {"max_grad_norm", {ShortestNumber(a.max_grad_norm()), ShortestNumber(b.max_grad_norm())}};
  }
  if (!SameBits(a.loss_scale(), b.loss_scale())) {
    return {"loss_scale", {ShortestNumber(a.loss_scale()), ShortestNumber(b.loss_scale())}};
  }
  return {};
}

}  // namespace

void StepIntents::Note(uint32_t rank, uint64_t step, const v1::StepIntent* intent) {
  latest_[rank] = intent == nullptr ? Said{} : Said{step, *intent};
}

std::string StepIntents::Disagreement(uint64_t step) const {
  const Said* first = nullptr;
  for (size_t r = 0; r < latest_.size(); ++r) {
    if (latest_[r].step != step) continue;
    if (first == nullptr) {
      first = &latest_[r];
      continue;
    }
    const auto [what, values] = FirstDifference(first->intent, latest_[r].intent);
    if (what.empty()) continue;
    return absl::StrCat("rank ", first - latest_.data(), " pushed it with ", what, " ", values.first, ", rank ", r,
                        " with ", what, " ", values.second);
  }
  return "";
}

}  // namespace shardopt
