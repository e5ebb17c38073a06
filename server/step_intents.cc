#include "server/step_intents.h"

#include <algorithm>

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

// How rank `rb`'s intent first differs from rank `ra`'s, naming both;
// empty when they are the same bits.
std::string FirstDifference(const v1::StepIntent& a, size_t ra, const v1::StepIntent& b, size_t rb) {
  const auto differ = [&](const char* what, const std::string& x, const std::string& y) {
    return absl::StrCat("rank ", ra, " pushed it with ", what, " ", x, ", rank ", rb, " with ", what, " ", y);
  };
  if (!SameBits(a.lr(), b.lr())) return differ("lr", ShortestNumber(a.lr()), ShortestNumber(b.lr()));
  if (!std::equal(a.group_lr().begin(), a.group_lr().end(), b.group_lr().begin(), b.group_lr().end(),
                  SameBits<double>)) {
    return differ("group lrs", Lrs(a), Lrs(b));
  }
  if (!SameBits(a.max_grad_norm(), b.max_grad_norm())) {
    return differ("max_grad_norm", ShortestNumber(a.max_grad_norm()), ShortestNumber(b.max_grad_norm()));
  }
  if (!SameBits(a.loss_scale(), b.loss_scale())) {
    return differ("loss_scale", ShortestNumber(a.loss_scale()), ShortestNumber(b.loss_scale()));
  }
  return "";
}

}  // namespace

void StepIntents::Note(uint32_t rank, uint64_t step, const v1::StepIntent* intent) {
  latest_[rank] = intent == nullptr ? Said{} : Said{step, *intent};
}

std::string StepIntents::Disagreement(uint64_t step) const {
  size_t first = latest_.size();  // the first rank that said how
  for (size_t r = 0; r < latest_.size(); ++r) {
    if (latest_[r].step != step) continue;
    if (first == latest_.size()) {
      first = r;
    } else if (std::string differ = FirstDifference(latest_[first].intent, first, latest_[r].intent, r);
               !differ.empty()) {
      return differ;
    }
  }
  return "";
}

}  // namespace shardopt
