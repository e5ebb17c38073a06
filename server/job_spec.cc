#include "server/job_spec.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "checkpoint/format.h"
#include "base/report_lines.h"
#include "google/protobuf/util/message_differencer.h"
#include "rpc/tensor_shapes.h"
#include "server/messages.h"

namespace shardopt {

absl::StatusOr<DType> FromProto(v1::DType d) {
  switch (d) {
    case v1::FP32: return DType::kFp32;
    case v1::BF16: return DType::kBf16;
    default: return absl::InvalidArgumentError("dtype must be FP32 or BF16");
  }
}

v1::DType ToProto(DType d) { return d == DType::kFp32 ? v1::FP32 : v1::BF16; }

absl::Status CheckDataLength(uint64_t bytes, DType dtype, const std::string& what) {
  if (bytes % DTypeSize(dtype) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", bytes, " bytes is not a whole number of ",
                                                   DTypeName(dtype), " elements (", DTypeSize(dtype), " B each)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::CreateJobRequest> NormalizeJobSpec(const v1::CreateJobRequest& in, absl::Duration default_barrier) {
  v1::CreateJobRequest r = in;
  if (r.job().empty()) return absl::InvalidArgumentError("job name is empty");
  if (r.job().size() > kMaxNameBytes || checkpoint::JobDirectoryName(r.job()).size() > checkpoint::kMaxFileNameBytes) {
    // Over 64 bytes, as every name refused here is, Quote gives the length.
    return absl::InvalidArgumentError(absl::StrCat("job name ", Quote(r.job()), " is too long: at most ",
                                                   kMaxNameBytes, " bytes, and ", checkpoint::kMaxFileNameBytes,
                                                   " once %-escaped for its checkpoint directory"));
  }
  // (A server's --max_world_size, lower, is checked apart: RESOURCE_EXHAUSTED.)
  if (r.world_size() < 1) return absl::InvalidArgumentError("world_size is 0: a job has at least one rank");
  if (r.world_size() > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat("world_size must be in [1, ", kMaxWorldSize, "], got ", r.world_size()));
  }
  if (r.rank() >= r.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", r.rank(), " is out of range for world_size ", r.world_size()));
  }
  if (r.groups_size() == 0) return absl::InvalidArgumentError("a job needs at least one group");
  for (int i = 0; i < r.groups_size(); ++i) {
    v1::Group& g = *r.mutable_groups(i);
    if (g.name().size() > kMaxNameBytes) {
      return absl::InvalidArgumentError(absl::StrCat("group ", i, "'s name ", Quote(g.name()), " is ", g.name().size(),
                                                     " bytes; at most ", kMaxNameBytes));
    }
    const std::string what = absl::StrCat("group ", i, " ('", g.name(), "'): ");
    if (!(g.beta1() >= 0 && g.beta1() < 1) || !(g.beta2() >= 0 && g.beta2() < 1)) {
      return absl::InvalidArgumentError(absl::StrCat(what, "beta1 and beta2 must be in [0, 1)"));
    }
    if (!(g.eps() > 0) || !std::isfinite(g.eps())) return absl::InvalidArgumentError(absl::StrCat(what, "eps must be finite and > 0"));
    if (!(g.weight_decay() >= 0) || !std::isfinite(g.weight_decay())) {
      return absl::InvalidArgumentError(absl::StrCat(what, "weight_decay must be finite and >= 0"));
    }
    if (g.lr_multiplier() == 0) g.set_lr_multiplier(1);
    if (!(g.lr_multiplier() > 0) || !std::isfinite(g.lr_multiplier())) {
      return absl::InvalidArgumentError(absl::StrCat(what, "lr_multiplier must be finite and > 0 (0 is taken as 1)"));
    }
    if (g.precision() != v1::PRECISION_FP32 && g.precision() != v1::PRECISION_BF16) {
      return absl::InvalidArgumentError(absl::StrCat(what, "unknown precision"));
    }
  }
  if (r.tensors_size() == 0) return absl::InvalidArgumentError("a job needs at least one tensor");
  absl::flat_hash_map<std::string, int> names;
  for (int i = 0; i < r.tensors_size(); ++i) {
    const v1::TensorSpec& t = r.tensors(i);
    if (t.name().empty()) return absl::InvalidArgumentError(absl::StrCat("tensor ", i, " has no name"));
    if (t.name().size() > kMaxNameBytes) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", i, "'s name ", Quote(t.name()), " is ", t.name().size(),
                                                     " bytes; at most ", kMaxNameBytes));
    }
    if (!names.emplace(t.name(), i).second) return absl::InvalidArgumentError(absl::StrCat("tensor name ", Quote(t.name()), " is used twice"));
    if (t.numel() == 0 || t.numel() > kMaxNumel) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name(), "' has numel ", t.numel(),
                                                     "; it must be in [1, 2^40]"));
    }
    if (!ShapeFits(t.shape(), t.numel())) return absl::InvalidArgumentError(ShapeRefusal(t.name(), t.shape(), t.numel()));
    if (t.group() >= static_cast<uint32_t>(r.groups_size())) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name(), "' names group ", t.group(), " of ", r.groups_size()));
    }
    // BF16 is the default: spelled as unspecified, so that requests from
    // before param_dtype existed and checkpoints written then compare equal.
    if (t.param_dtype() == v1::BF16) r.mutable_tensors(i)->clear_param_dtype();
    if (t.param_dtype() != v1::DTYPE_UNSPECIFIED && t.param_dtype() != v1::FP32) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name(), "': param_dtype must be FP32 or BF16"));
    }
  }
  if (r.shards_size() == 0) {
    for (const v1::TensorSpec& t : r.tensors()) {
      v1::ShardRange* s = r.add_shards();
      s->set_tensor(t.name());
      s->set_offset(0);
      s->set_length(t.numel());
    }
  }
  absl::flat_hash_map<std::string, bool> owned;
  for (const v1::ShardRange& s : r.shards()) {
    auto it = names.find(s.tensor());
    if (it == names.end()) return absl::InvalidArgumentError(absl::StrCat("shard names unknown tensor ", Quote(s.tensor())));
    if (!owned.emplace(s.tensor(), true).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", s.tensor(), "' has two shards on one server"));
    }
    const uint64_t numel = r.tensors(it->second).numel();
    if (s.length() == 0 || s.offset() > numel || s.length() > numel - s.offset()) {
      return absl::InvalidArgumentError(absl::StrCat("shard ", Range(s.offset(), s.offset() + s.length()), " of tensor '",
                                                     s.tensor(), "' is empty or past its ", numel, " elements"));
    }
  }
  if (r.grad_dtype() == v1::DTYPE_UNSPECIFIED) r.set_grad_dtype(v1::BF16);
  if (r.grad_dtype() != v1::FP32 && r.grad_dtype() != v1::BF16) return absl::InvalidArgumentError("unknown grad_dtype");
  if (r.barrier_timeout_ms() == 0) r.set_barrier_timeout_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(default_barrier)));
  return r;
}


namespace {

// Normalize keeps a bf16 tensor's param_dtype unspecified (what servers
// before the field stored); a report names it BF16, which is what callers
// send.
v1::CreateJobRequest AsReported(v1::CreateJobRequest r) {
  for (v1::TensorSpec& t : *r.mutable_tensors()) {
    if (t.param_dtype() == v1::DTYPE_UNSPECIFIED) t.set_param_dtype(v1::BF16);
  }
  return r;
}

// How an attach compares two specs: a field at proto3's default is absent,
// so compared and shown as 0, not as "added" with one side's value alone;
// and a group's name is for messages only.
void CompareAsAnAttach(google::protobuf::util::MessageDifferencer* differ) {
  differ->set_message_field_comparison(google::protobuf::util::MessageDifferencer::EQUIVALENT);
  differ->IgnoreField(v1::Group::descriptor()->FindFieldByName("name"));
  CompareOnlyWhereBothSayIt(differ);
}

// Whether `requested` differs from `existing` only in the order of its
// tensors (and so in its placement, which follows that order), or only in
// its trainers_per_rank: a caller that got one thing wrong about a job that
// is right, whose way out is to fix the call, where dropping the job would
// lose its state. A relaunch that built its groups otherwise got a diff
// listing every moved tensor, which reads like another model.
// Whether an attach takes `b` for `a`; where `placement_aside`, whatever
// their shards (the client's placement).
bool SameAsAnAttach(const v1::CreateJobRequest& a, const v1::CreateJobRequest& b, bool placement_aside) {
  google::protobuf::util::MessageDifferencer differ;
  CompareAsAnAttach(&differ);
  if (placement_aside) differ.IgnoreField(v1::CreateJobRequest::descriptor()->FindFieldByName("shards"));
  return differ.Compare(a, b);
}

bool OnlyTheOrderDiffers(const v1::CreateJobRequest& existing, const v1::CreateJobRequest& requested) {
  if (existing.tensors_size() != requested.tensors_size()) return false;
  absl::flat_hash_map<std::string, const v1::TensorSpec*> theirs;
  for (const v1::TensorSpec& t : requested.tensors()) theirs.emplace(t.name(), &t);
  v1::CreateJobRequest reordered = requested;
  bool moved = false;
  for (int i = 0; i < existing.tensors_size(); ++i) {
    auto it = theirs.find(existing.tensors(i).name());
    if (it == theirs.end()) return false;
    *reordered.mutable_tensors(i) = *it->second;
    moved = moved || existing.tensors(i).name() != requested.tensors(i).name();
  }
  return moved && SameAsAnAttach(existing, reordered, /*placement_aside=*/true);
}

bool OnlyTrainersPerRankDiffers(const v1::CreateJobRequest& existing, const v1::CreateJobRequest& requested) {
  if (!OtherTrainersPerRank(existing, requested)) return false;
  v1::CreateJobRequest theirs = requested;
  theirs.set_trainers_per_rank(existing.trainers_per_rank());
  return SameAsAnAttach(existing, theirs, /*placement_aside=*/false);
}

}  // namespace

absl::Status SameJobSpec(const v1::CreateJobRequest& existing, const v1::CreateJobRequest& requested) {
  google::protobuf::util::MessageDifferencer differ;
  CompareAsAnAttach(&differ);
  // Every attach compares; only a job that differs is reported, from copies
  // that name its dtypes as callers do.
  if (differ.Compare(existing, requested)) return absl::OkStatus();
  std::string diff;
  differ.set_report_ignores(false);  // a group's name, or a shape one side lacks, is not why
  differ.ReportDifferencesToString(&diff);
  differ.Compare(AsReported(existing), AsReported(requested));
  // The shards are the client's placement. Where the rest is the same, they
  // differ because the ranks list the servers in different orders or
  // numbers, or the job is attached with other servers than it was made
  // with; where the tensors differ, the diff says that already.
  const bool placed_otherwise = SameAsAnAttach(existing, requested, /*placement_aside=*/true);
  return absl::AlreadyExistsError(absl::StrCat(
      "job '", requested.job(), "' exists with a different configuration (this server's -> this call's: ",
      OneLineReport(diff),
      OnlyTheOrderDiffers(existing, requested)
          ? "); this call names the job's tensors in another order: give them in the order the job was made with, "
            "and do not drop the job for this, which would lose its state"
      : OnlyTrainersPerRankDiffers(existing, requested)
          ? "); attach this node with the job's number of local ranks (its trainers_per_rank, which `shardopt "
            "describe JOB` shows), and do not drop the job for this, which would lose its state"
          : "); drop it or use another name",
      placed_otherwise ? " (only this server's part of it differs: every rank must list the same servers, in the "
                         "same order, as the job was made with; to move a job onto other servers, checkpoint it "
                         "and restart every server that holds it, then attach with the new list: README, "
                         "\"Operations\", \"Deploying on Kubernetes\", \"Scaling\")"
                       : "",
      OtherTrainersPerRank(existing, requested) ? " (every node of a job must have the same number of local ranks: "
                                                  "each averages the gradients over world_size times its own)"
                                                : ""));
}

}  // namespace shardopt
