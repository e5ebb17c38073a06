#include "server/job_store.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/util/message_differencer.h"
#include "kernels/step_scalars.h"
#include "server/checkpoint.h"
#include "server/interval_set.h"

namespace shardopt {
namespace {

constexpr uint32_t kMaxWorldSize = 65536;
// Names become file and directory names (checkpoint.h) and appear in error
// messages, which travel in gRPC's metadata.
constexpr size_t kMaxNameBytes = 200;
// 2^40 elements (a 1T-parameter tensor): with world_size at most 2^16, every
// byte count a backend computes stays far below 2^64.
constexpr uint64_t kMaxNumel = uint64_t{1} << 40;

absl::StatusOr<DType> FromProto(v1::DType d) {
  switch (d) {
    case v1::FP32: return DType::kFp32;
    case v1::BF16: return DType::kBf16;
    default: return absl::InvalidArgumentError("dtype must be FP32 or BF16");
  }
}

v1::DType ToProto(DType d) { return d == DType::kFp32 ? v1::FP32 : v1::BF16; }

absl::Status CheckDataLength(const std::string& data, DType dtype, const std::string& what) {
  if (data.size() % DTypeSize(dtype) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", data.size(), " bytes is not a whole number of ",
                                                   DTypeName(dtype), " elements (", DTypeSize(dtype), " B each)"));
  }
  return absl::OkStatus();
}

bool SameBits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }
bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

std::string Range(uint64_t begin, uint64_t end) { return absl::StrCat("[", begin, ", ", end, ")"); }

// A caller-supplied name, quoted for an error message and cut short: the
// message travels in gRPC's metadata, which a long name would overflow.
std::string Quote(absl::string_view name) {
  constexpr size_t kShown = 64;
  if (name.size() <= kShown) return absl::StrCat("'", name, "'");
  return absl::StrCat("'", name.substr(0, kShown), "...' (", name.size(), " bytes)");
}

}  // namespace

struct OwnedShard {
  uint32_t tensor;
  uint64_t offset;  // in the tensor
  uint64_t length;
};

class Job {
 public:
  v1::CreateJobRequest spec;  // normalized: defaults filled in
  std::unique_ptr<JobState> state;
  std::vector<AdamWHyper> hypers;  // per group
  absl::flat_hash_map<std::string, uint32_t> tensor_index;
  std::vector<int64_t> shard_of_tensor;  // -1: not on this server
  std::vector<OwnedShard> shards;
  absl::Duration barrier_timeout;

  mutable std::mutex mu;
  std::condition_variable cv;
  bool dropped = false;
  uint64_t step = 0;                // the last step done
  std::vector<uint64_t> adam_steps;  // per shard
  std::vector<IntervalSet> init_cover;
  size_t uninitialized_shards = 0;

  // The barrier round of step `step + 1`. A round ends sealed (every rank
  // covered its shards) and then committed, or aborted at its deadline.
  struct Round {
    bool active = false;
    bool sealed = false;
    uint64_t epoch = 0;
    // Steady, so that a step of the wall clock cannot end a round early or late.
    std::chrono::steady_clock::time_point deadline;
    std::vector<std::vector<IntervalSet>> covered;  // [rank][shard]
    std::vector<std::vector<bool>> no_grad;         // [rank][shard]
    std::vector<bool> finished;                     // [rank]
    std::vector<uint64_t> sessions;                 // [rank]: push streams begun, the latest's number
    uint32_t finished_count = 0;
    std::vector<ShardGrads> contributions;
  } round;
  // The stats of the last sealed round, kept past its commit so that a
  // retried push of a committed step gets its answer again.
  uint64_t sealed_step = 0;
  GradStats sealed_stats;

  struct Applied {  // a commit's arguments
    double lr = 0;
    float gscale = 0;
    bool skip = false;
    std::vector<double> group_lr;  // empty: lr for every group

    double lr_of(uint32_t group) const { return group_lr.empty() ? lr : group_lr[group]; }
    bool operator==(const Applied& o) const {
      if (!SameBits(lr, o.lr) || !SameBits(gscale, o.gscale) || skip != o.skip) return false;
      if (group_lr.size() != o.group_lr.size()) return false;
      for (size_t g = 0; g < group_lr.size(); ++g) {
        if (!SameBits(group_lr[g], o.group_lr[g])) return false;
      }
      return true;
    }
  };
  Applied applied;        // of step `step`
  bool applying = false;  // step + 1 is being applied, piece by piece
  Applied apply_args;     // of step + 1, while applying
  uint64_t apply_progress = 0;  // pieces of step + 1 applied so far
  absl::Status failed;          // set if an apply failed halfway: the state is not a step's

  const std::string& name() const { return spec.job(); }
  uint32_t world_size() const { return spec.world_size(); }
  const std::string& tensor_name(const OwnedShard& s) const { return spec.tensors(s.tensor).name(); }
  bool fp32_params(uint32_t tensor) const { return spec.tensors(tensor).param_dtype() == v1::FP32; }
  // Gradients come in the param's dtype for FP32 params, else in the job's.
  v1::DType grad_dtype(uint32_t tensor) const { return fp32_params(tensor) ? v1::FP32 : spec.grad_dtype(); }

  void StartRound(std::chrono::steady_clock::time_point now) {
    round.active = true;
    round.deadline = now + absl::ToChronoNanoseconds(barrier_timeout);
    round.covered.assign(world_size(), std::vector<IntervalSet>(shards.size()));
    round.no_grad.assign(world_size(), std::vector<bool>(shards.size(), false));
    round.finished.assign(world_size(), false);
    round.sessions.assign(world_size(), 0);
  }

  void EndRound() {
    const uint64_t epoch = round.epoch + 1;
    round = Round{};
    round.epoch = epoch;
    cv.notify_all();
  }

  void ExpireIfLate(std::chrono::steady_clock::time_point now) {
    if (round.active && !round.sealed && now >= round.deadline) EndRound();
  }

  // Which ranks are missing from the round, and the first range one lacks.
  std::string MissingSummary() const {
    if (!round.active) return absl::StrCat("no rank has pushed step ", step + 1);
    std::vector<uint32_t> missing;
    for (uint32_t r = 0; r < world_size(); ++r) {
      if (!round.finished[r]) missing.push_back(r);
    }
    std::string out = absl::StrCat("ranks {", absl::StrJoin(missing, ", "), "} of ", world_size(),
                                   " have not finished pushing step ", step + 1);
    if (missing.empty()) return out;
    const uint32_t r = missing.front();
    for (size_t s = 0; s < shards.size(); ++s) {
      if (round.no_grad[r][s]) continue;
      if (auto gap = round.covered[r][s].FirstGap(0, shards[s].length)) {
        absl::StrAppend(&out, "; rank ", r, " lacks tensor '", tensor_name(shards[s]), "' elements ",
                        Range(shards[s].offset + gap->first, shards[s].offset + gap->second));
        break;
      }
    }
    return out;
  }

  // Resolves a tensor name to this server's shard and checks that
  // [offset, offset+count) in tensor coordinates lies in it.
  absl::StatusOr<uint32_t> LocateRange(const std::string& tensor, uint64_t offset, uint64_t count) const {
    auto it = tensor_index.find(tensor);
    if (it == tensor_index.end()) {
      return absl::NotFoundError(absl::StrCat("job '", name(), "' has no tensor ", Quote(tensor)));
    }
    const int64_t si = shard_of_tensor[it->second];
    const uint64_t numel = spec.tensors(it->second).numel();
    if (offset > numel || count > numel - offset) {
      return absl::OutOfRangeError(absl::StrCat("tensor ", Quote(tensor), " has ", numel, " elements; range ",
                                                Range(offset, offset + count), " is past its end"));
    }
    if (si < 0) {
      return absl::OutOfRangeError(absl::StrCat("tensor '", tensor, "' has no shard on this server"));
    }
    const OwnedShard& s = shards[si];
    if (offset < s.offset || offset + count > s.offset + s.length) {
      return absl::OutOfRangeError(absl::StrCat("range ", Range(offset, offset + count), " of tensor '", tensor,
                                                "' is outside this server's shard ",
                                                Range(s.offset, s.offset + s.length)));
    }
    return static_cast<uint32_t>(si);
  }

  // This server's part of a checkpoint: the state at the last step done.
  // Called under mu and never while a step is being applied piece by piece.
  absl::StatusOr<checkpoint::Part> Snapshot() const {
    if (uninitialized_shards > 0) {
      return absl::FailedPreconditionError(absl::StrCat("job '", name(), "' has shards without initial values; ",
                                                        "nothing to checkpoint before Init completes"));
    }
    checkpoint::Part part;
    v1::PartManifest& m = part.manifest;
    *m.mutable_spec() = spec;
    m.set_step(step);
    m.mutable_applied()->set_step(step);
    m.mutable_applied()->set_lr(applied.lr);
    m.mutable_applied()->set_gscale(applied.gscale);
    m.mutable_applied()->set_skip(applied.skip);
    for (double lr : applied.group_lr) m.mutable_applied()->add_group_lr(lr);
    m.set_sealed_step(sealed_step);
    m.set_sealed_sum_squares(sealed_stats.sum_squares);
    m.set_sealed_nonfinite(sealed_stats.nonfinite);
    uint64_t bytes = 0;
    for (size_t si = 0; si < shards.size(); ++si) {
      bytes += shards[si].length * 3 * (state->held_precision(static_cast<uint32_t>(si)) == Precision::kBf16 ? 2 : 4);
    }
    part.data.reserve(bytes);
    std::vector<float> values;
    for (size_t si = 0; si < shards.size(); ++si) {
      const bool bf16 = state->held_precision(static_cast<uint32_t>(si)) == Precision::kBf16;
      v1::ShardSection* section = m.add_shards();
      section->set_adam_step(adam_steps[si]);
      section->set_dtype(bf16 ? v1::BF16 : v1::FP32);
      values.resize(shards[si].length);
      for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
        if (auto st = state->ReadState(static_cast<uint32_t>(si), kind, 0, values.size(), DType::kFp32, values.data());
            !st.ok()) {
          return st;
        }
        if (!bf16) {
          part.data.append(reinterpret_cast<const char*>(values.data()), values.size() * 4);
          continue;
        }
        // bf16 state read as fp32 is exact, so its top half is the state itself.
        for (float x : values) {
          uint32_t u;
          std::memcpy(&u, &x, 4);
          const uint16_t h = static_cast<uint16_t>(u >> 16);
          part.data.append(reinterpret_cast<const char*>(&h), 2);
        }
      }
    }
    return part;
  }

  // The inverse of Snapshot, on a fresh job whose spec is part's.
  absl::Status Restore(const checkpoint::Part& part) {
    const v1::PartManifest& m = part.manifest;
    uint64_t offset = 0;
    for (size_t si = 0; si < shards.size(); ++si) {
      const DType dtype = m.shards(si).dtype() == v1::BF16 ? DType::kBf16 : DType::kFp32;
      const uint64_t array = checkpoint::ArrayBytes(m, static_cast<int>(si));
      for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
        if (auto st = state->WriteState(static_cast<uint32_t>(si), kind, 0, dtype, part.data.data() + offset,
                                        shards[si].length);
            !st.ok()) {
          return st;
        }
        offset += array;
      }
      adam_steps[si] = m.shards(si).adam_step();
      init_cover[si].Add(0, shards[si].length);
    }
    uninitialized_shards = 0;
    step = m.step();
    applied = {m.applied().lr(), m.applied().gscale(), m.applied().skip(),
               {m.applied().group_lr().begin(), m.applied().group_lr().end()}};
    sealed_step = m.sealed_step();
    sealed_stats = {m.sealed_sum_squares(), m.sealed_nonfinite()};
    return absl::OkStatus();
  }

  absl::Status CheckStepToPush(uint64_t t) const {
    if (t == 0 || t + 1 <= step) {
      return absl::FailedPreconditionError(absl::StrCat("job '", name(), "' is at step ", step, "; step ", t,
                                                        " is stale; push step ", step + 1));
    }
    if (t > step + 1) {
      return absl::OutOfRangeError(absl::StrCat("job '", name(), "' is at step ", step, "; step ", t,
                                                " is in the future; push step ", step + 1));
    }
    return absl::OkStatus();
  }
};

JobStore::JobStore(Backend* backend, JobStoreOptions options) : backend_(backend), options_(options) {
  // A commit applies the update one streamed piece at a time; pieces must
  // start where a partial update may.
  const uint64_t a = kApplyAlignment;
  options_.stream_chunk_elements = std::max(a, (options_.stream_chunk_elements + a - 1) / a * a);
}

JobStore::~JobStore() = default;

absl::StatusOr<std::shared_ptr<Job>> JobStore::Find(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(name);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job ", Quote(name), " on this server"));
  return it->second;
}

namespace {

// Fills in defaults and checks every field, so that two requests for the same
// job compare equal exactly when they mean the same job.
absl::StatusOr<v1::CreateJobRequest> Normalize(const v1::CreateJobRequest& in, absl::Duration default_barrier) {
  v1::CreateJobRequest r = in;
  if (r.job().empty()) return absl::InvalidArgumentError("job name is empty");
  if (r.job().size() > kMaxNameBytes || checkpoint::JobDirectoryName(r.job()).size() > checkpoint::kMaxFileNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("job name ", Quote(r.job()), " is ", r.job().size(), " bytes; at most ",
                                                   kMaxNameBytes, ", and ", checkpoint::kMaxFileNameBytes,
                                                   " once %-escaped for its checkpoint directory"));
  }
  if (r.world_size() < 1 || r.world_size() > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat("world_size must be in [1, ", kMaxWorldSize, "], got ", r.world_size()));
  }
  if (r.groups_size() == 0) return absl::InvalidArgumentError("a job needs at least one group");
  for (int i = 0; i < r.groups_size(); ++i) {
    v1::Group& g = *r.mutable_groups(i);
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
      return absl::InvalidArgumentError(absl::StrCat(what, "lr_multiplier must be finite and > 0"));
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

}  // namespace

absl::StatusOr<v1::CreateJobResponse> JobStore::Attach(const Job& job, const v1::CreateJobRequest& spec) const {
  std::string diff;
  google::protobuf::util::MessageDifferencer differ;
  differ.ReportDifferencesToString(&diff);
  // A group's name is for messages only: the same job under other names is the same job.
  differ.IgnoreField(v1::Group::descriptor()->FindFieldByName("name"));
  if (!differ.Compare(job.spec, spec)) {
    return absl::AlreadyExistsError(absl::StrCat("job '", spec.job(), "' exists with a different configuration (",
                                                 diff, "); drop it or use another name"));
  }
  std::lock_guard<std::mutex> job_lock(job.mu);
  v1::CreateJobResponse response;
  response.set_created(false);
  response.set_step(job.step);
  return response;
}

absl::StatusOr<v1::CreateJobResponse> JobStore::CreateJob(const v1::CreateJobRequest& request) {
  auto spec = Normalize(request, options_.default_barrier_timeout);
  if (!spec.ok()) return spec.status();
  const uint64_t restore_step = spec->restore_step();
  spec->clear_restore_step();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = jobs_.find(spec->job()); it != jobs_.end()) return Attach(*it->second, *spec);
  }
  if (restore_step > 0 && options_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("restore_step ", restore_step,
                                                      " asked for, but this server has no --checkpoint_dir"));
  }

  auto job = std::make_shared<Job>();
  job->spec = *spec;
  job->barrier_timeout = absl::Milliseconds(spec->barrier_timeout_ms());
  for (const v1::Group& g : spec->groups()) {
    job->hypers.push_back({g.beta1(), g.beta2(), g.eps(), g.weight_decay(), g.lr_multiplier()});
  }
  job->shard_of_tensor.assign(spec->tensors_size(), -1);
  for (int i = 0; i < spec->tensors_size(); ++i) job->tensor_index[spec->tensors(i).name()] = i;
  JobLayout layout;
  layout.world_size = spec->world_size();
  // One slot dtype per job: fp32 as soon as any tensor pushes fp32, with
  // bf16 pushes widened exactly into it (JobState::WriteGrad).
  layout.grad_dtype = *FromProto(spec->grad_dtype());
  for (const v1::TensorSpec& t : spec->tensors()) {
    if (t.param_dtype() == v1::FP32) layout.grad_dtype = DType::kFp32;
  }
  for (const v1::ShardRange& s : spec->shards()) {
    const uint32_t t = job->tensor_index[s.tensor()];
    job->shard_of_tensor[t] = static_cast<int64_t>(job->shards.size());
    job->shards.push_back({t, s.offset(), s.length()});
    const bool bf16 = spec->groups(spec->tensors(t).group()).precision() == v1::PRECISION_BF16;
    layout.shards.push_back({s.length(), bf16 ? Precision::kBf16 : Precision::kFp32});
  }
  auto state = backend_->Allocate(layout);
  if (!state.ok()) return state.status();
  job->state = *std::move(state);
  job->adam_steps.assign(job->shards.size(), 0);
  job->init_cover.resize(job->shards.size());
  job->uninitialized_shards = job->shards.size();

  // Outside the store's lock: reading a checkpoint must not stall other jobs.
  bool restored = false;
  if (!options_.checkpoint_dir.empty()) {
    auto part = checkpoint::Load(options_.checkpoint_dir, *spec, restore_step, options_.checkpoint_log);
    if (part.ok()) {
      if (auto st = job->Restore(*part); !st.ok()) return st;
      restored = true;
      options_.checkpoint_log(absl::StrCat("restored job '", spec->job(), "' at step ", job->step, " from ",
                                           checkpoint::StepDirectory(options_.checkpoint_dir, spec->job(), job->step)));
    } else if (part.status().code() != absl::StatusCode::kNotFound || restore_step > 0) {
      return part.status();
    }
  }

  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = jobs_.find(spec->job()); it != jobs_.end()) return Attach(*it->second, *spec);
  jobs_.emplace(spec->job(), job);
  v1::CreateJobResponse response;
  response.set_created(true);
  response.set_step(job->step);
  response.set_restored(restored);
  return response;
}

absl::StatusOr<v1::CheckpointResponse> JobStore::Checkpoint(const v1::CheckpointRequest& request) {
  if (options_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError("this server has no --checkpoint_dir");
  }
  auto found = Find(request.job());
  if (!found.ok()) return found.status();
  Job& job = **found;
  absl::StatusOr<checkpoint::Part> part;
  {
    std::unique_lock<std::mutex> lock(job.mu);
    job.cv.wait(lock, [&] { return !job.applying || job.dropped; });  // whole steps only
    if (job.dropped) return absl::NotFoundError(absl::StrCat("job '", job.name(), "' was dropped"));
    if (!job.failed.ok()) return job.failed;
    if (request.step() != job.step) {
      return absl::FailedPreconditionError(absl::StrCat("job '", job.name(), "' is at step ", job.step,
                                                        "; cannot checkpoint step ", request.step()));
    }
    part = job.Snapshot();
  }
  if (!part.ok()) return part.status();
  auto written = checkpoint::WritePart(options_.checkpoint_dir, *part);
  if (!written.ok()) return written.status();
  v1::CheckpointResponse response;
  response.set_step(request.step());
  response.set_directory(written->directory);
  response.set_part_bytes(written->part_bytes);
  response.set_complete(written->complete);
  return response;
}

std::vector<std::pair<std::string, absl::StatusOr<v1::CheckpointResponse>>> JobStore::DrainAndCheckpoint() {
  draining_ = true;
  std::vector<std::pair<std::string, std::shared_ptr<Job>>> jobs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [name, job] : jobs_) jobs.emplace_back(name, job);
  }
  // No commit starts a step any more; one already applying finishes first.
  std::vector<std::pair<std::string, uint64_t>> at;
  for (const auto& [name, job] : jobs) {
    std::unique_lock<std::mutex> job_lock(job->mu);
    job->cv.wait(job_lock, [&] { return !job->applying || job->dropped; });
    if (!job->dropped && job->uninitialized_shards == 0) at.emplace_back(name, job->step);
  }
  std::vector<std::pair<std::string, absl::StatusOr<v1::CheckpointResponse>>> results;
  for (const auto& [name, step] : at) {
    v1::CheckpointRequest request;
    request.set_job(name);
    request.set_step(step);
    results.emplace_back(name, Checkpoint(request));
  }
  return results;
}

absl::Status JobStore::DropJob(const std::string& name) {
  std::shared_ptr<Job> job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = jobs_.find(name);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job ", Quote(name), " on this server"));
    job = it->second;
    jobs_.erase(it);
  }
  std::lock_guard<std::mutex> lock(job->mu);
  job->dropped = true;
  job->cv.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<v1::DescribeResponse> JobStore::Describe(const std::string& name) const {
  auto found = Find(name);
  if (!found.ok()) return found.status();
  Job& job = **found;
  std::lock_guard<std::mutex> lock(job.mu);
  v1::DescribeResponse r;
  r.set_job(job.name());
  r.set_step(job.step);
  r.set_world_size(job.world_size());
  r.set_grad_dtype(job.spec.grad_dtype());
  for (int g = 0; g < job.spec.groups_size(); ++g) {
    v1::GroupState* gs = r.add_groups();
    *gs->mutable_config() = job.spec.groups(g);
    // What the backend holds, not what was asked for: VerifyState compares the two.
    bool any = false;
    Precision held = Precision::kFp32;
    for (size_t s = 0; s < job.shards.size(); ++s) {
      if (job.spec.tensors(job.shards[s].tensor).group() != static_cast<uint32_t>(g)) continue;
      const Precision p = job.state->held_precision(static_cast<uint32_t>(s));
      if (!any || p == Precision::kBf16) held = p;
      any = true;
    }
    gs->set_state_dtype(!any ? v1::DTYPE_UNSPECIFIED : held == Precision::kFp32 ? v1::FP32 : v1::BF16);
  }
  for (size_t si = 0; si < job.shards.size(); ++si) {
    const OwnedShard& s = job.shards[si];
    v1::TensorState* ts = r.add_tensors();
    const v1::TensorSpec& spec = job.spec.tensors(s.tensor);
    ts->set_name(spec.name());
    ts->set_numel(spec.numel());
    ts->set_group(spec.group());
    ts->mutable_shard()->set_tensor(spec.name());
    ts->mutable_shard()->set_offset(s.offset);
    ts->mutable_shard()->set_length(s.length);
    ts->set_adam_step(job.adam_steps[si]);
  }
  const MemoryUse use = job.state->memory_use();
  r.set_state_bytes(use.state_bytes);
  r.set_staging_bytes(use.staging_bytes);
  r.set_device(backend_->Describe());
  return r;
}

absl::StatusOr<uint64_t> JobStore::Init(const v1::InitChunk& chunk) {
  auto found = Find(chunk.job());
  if (!found.ok()) return found.status();
  Job& job = **found;
  auto dtype = FromProto(chunk.dtype());
  if (!dtype.ok()) return dtype.status();
  StateKind kind = StateKind::kMaster;
  switch (chunk.kind()) {
    case v1::STATE_KIND_UNSPECIFIED:
    case v1::MASTER: break;
    case v1::EXP_AVG: kind = StateKind::kExpAvg; break;
    case v1::EXP_AVG_SQ: kind = StateKind::kExpAvgSq; break;
    default: return absl::InvalidArgumentError("Init sets MASTER, EXP_AVG or EXP_AVG_SQ; params follow the master");
  }
  if (auto st = CheckDataLength(chunk.data(), *dtype, "init chunk"); !st.ok()) return st;
  const uint64_t count = chunk.data().size() / DTypeSize(*dtype);
  for (uint64_t i = 0; i < count; ++i) {
    float x;
    if (*dtype == DType::kFp32) {
      std::memcpy(&x, chunk.data().data() + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, chunk.data().data() + 2 * i, 2);
      x = math::bf16_to_float(h);
    }
    if (!std::isfinite(x)) {
      return absl::InvalidArgumentError(absl::StrCat("initial ", StateKindName(kind), " of tensor ", Quote(chunk.tensor()),
                                                     " element ", chunk.offset() + i, " is not finite"));
    }
    if (kind == StateKind::kExpAvgSq && x < 0) {  // its square root is taken
      return absl::InvalidArgumentError(absl::StrCat("initial exp_avg_sq of tensor ", Quote(chunk.tensor()), " element ",
                                                     chunk.offset() + i, " is negative"));
    }
  }
  std::lock_guard<std::mutex> lock(job.mu);
  if (job.dropped) return absl::NotFoundError(absl::StrCat("job '", job.name(), "' was dropped"));
  if (job.step != 0 || job.applying) {
    return absl::FailedPreconditionError(absl::StrCat("job '", job.name(), "' is at step ", job.step,
                                                      "; initial values are taken only at step 0"));
  }
  auto shard = job.LocateRange(chunk.tensor(), chunk.offset(), count);
  if (!shard.ok()) return shard.status();
  const OwnedShard& s = job.shards[*shard];
  const uint64_t local = chunk.offset() - s.offset;
  if (auto st = job.state->WriteState(*shard, kind, local, *dtype, chunk.data().data(), count); !st.ok()) {
    return st;
  }
  if (chunk.adam_step() != 0) job.adam_steps[*shard] = chunk.adam_step();
  // Only the master makes a shard ready to step: moments default to zero.
  if (kind != StateKind::kMaster) return count;
  const bool was_covered = job.init_cover[*shard].Covers(0, s.length);
  job.init_cover[*shard].Add(local, local + count);
  if (!was_covered && job.init_cover[*shard].Covers(0, s.length)) --job.uninitialized_shards;
  return count;
}

absl::StatusOr<std::unique_ptr<JobStore::PushSession>> JobStore::BeginPush(const v1::GradChunk& first) {
  auto found = Find(first.job());
  if (!found.ok()) return found.status();
  std::shared_ptr<Job> job = *found;
  std::lock_guard<std::mutex> lock(job->mu);
  if (first.rank() >= job->world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", first.rank(), " is out of range: job '", job->name(),
                                                   "' has world_size ", job->world_size()));
  }
  const bool resealed = first.step() == job->step && job->sealed_step == job->step && job->step > 0;
  if (!resealed) {
    if (auto st = job->CheckStepToPush(first.step()); !st.ok()) return st;
  }
  if (job->uninitialized_shards > 0) {
    for (size_t s = 0; s < job->shards.size(); ++s) {
      if (auto gap = job->init_cover[s].FirstGap(0, job->shards[s].length)) {
        return absl::FailedPreconditionError(
            absl::StrCat("tensor '", job->tensor_name(job->shards[s]), "' elements ",
                         Range(job->shards[s].offset + gap->first, job->shards[s].offset + gap->second),
                         " have no initial value; stream them with Init before step 1"));
      }
    }
  }
  return std::unique_ptr<PushSession>(new PushSession(job, first.step(), first.rank()));
}

JobStore::PushSession::PushSession(std::shared_ptr<Job> job, uint64_t step, uint32_t rank)
    : job_(std::move(job)), step_(step), rank_(rank) {}

void JobStore::PushSession::Start(std::chrono::steady_clock::time_point now) {
  Job& job = *job_;
  if (!job.round.active) job.StartRound(now);
  epoch_ = job.round.epoch;
  session_ = ++job.round.sessions[rank_];
  started_ = true;
}

// A stream that ends without an answer (refused, cancelled, broken) leaves
// the round as if it never came: what it covered is uncovered again, so the
// rank's next stream starts afresh. Not once the rank has finished, nor when
// a newer stream of the rank (a retry) is under way.
JobStore::PushSession::~PushSession() {
  if (!started_ || answered_) return;
  Job& job = *job_;
  std::lock_guard<std::mutex> lock(job.mu);
  if (!job.round.active || job.round.epoch != epoch_ || job.round.sealed || job.round.finished[rank_] ||
      job.round.sessions[rank_] != session_) {
    return;
  }
  job.round.covered[rank_].assign(job.shards.size(), IntervalSet());
}

absl::Status JobStore::PushSession::Add(const v1::GradChunk& chunk) {
  Job& job = *job_;
  if ((!chunk.job().empty() && chunk.job() != job.name()) || (chunk.step() != 0 && chunk.step() != step_) ||
      (chunk.rank() != 0 && chunk.rank() != rank_)) {
    return absl::InvalidArgumentError("job, step and rank must not change within one push stream");
  }
  for (const std::string& t : chunk.no_grad()) no_grad_.push_back(t);
  const bool has_data = !chunk.tensor().empty() || !chunk.data().empty();
  std::lock_guard<std::mutex> lock(job.mu);
  if (job.dropped) return absl::NotFoundError(absl::StrCat("job '", job.name(), "' was dropped"));
  const auto now = std::chrono::steady_clock::now();
  job.ExpireIfLate(now);
  if (started_ && job.step < step_ && (job.round.epoch != epoch_ || !job.round.active)) {
    return absl::DeadlineExceededError(absl::StrCat("the barrier of step ", step_, " expired before rank ", rank_,
                                                    "'s push ended; its gradients were discarded: push step ",
                                                    step_, " again"));
  }
  if (!has_data) return absl::OkStatus();
  auto dtype = FromProto(chunk.dtype());
  if (!dtype.ok()) return dtype.status();
  if (auto st = CheckDataLength(chunk.data(), *dtype, "gradient chunk"); !st.ok()) return st;
  const uint64_t count = chunk.data().size() / DTypeSize(*dtype);
  auto shard = job.LocateRange(chunk.tensor(), chunk.offset(), count);
  if (!shard.ok()) return shard.status();
  if (const v1::DType want = job.grad_dtype(job.shards[*shard].tensor); ToProto(*dtype) != want) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", chunk.tensor(), "' of job '", job.name(), "' takes ",
                                                   v1::DType_Name(want), " gradients; this chunk is ",
                                                   v1::DType_Name(chunk.dtype())));
  }
  if (job.step >= step_) return absl::OkStatus();  // a retry of a committed step: already counted
  if (!started_) Start(now);
  if (job.round.sealed) return absl::OkStatus();  // a retry after the barrier: already counted
  const uint64_t local = chunk.offset() - job.shards[*shard].offset;
  if (auto st = job.state->WriteGrad(*shard, rank_, local, *dtype, chunk.data().data(), count); !st.ok()) return st;
  job.round.covered[rank_][*shard].Add(local, local + count);
  return absl::OkStatus();
}

absl::StatusOr<v1::PushResponse> JobStore::PushSession::Finish() {
  absl::StatusOr<v1::PushResponse> answer = Seal();
  answered_ = answer.ok();
  return answer;
}

absl::StatusOr<v1::PushResponse> JobStore::PushSession::Seal() {
  Job& job = *job_;
  std::unique_lock<std::mutex> lock(job.mu);
  auto answer = [&]() {
    v1::PushResponse r;
    r.set_step(step_);
    r.set_sum_squares(job.sealed_stats.sum_squares);
    r.set_nonfinite(job.sealed_stats.nonfinite);
    return r;
  };
  if (job.dropped) return absl::NotFoundError(absl::StrCat("job '", job.name(), "' was dropped"));
  if (job.step >= step_) {  // a retry of a committed step: its answer, if still kept
    if (job.sealed_step == step_) return answer();
    return absl::FailedPreconditionError(absl::StrCat("step ", step_, " is stale: job '", job.name(), "' is at step ", job.step));
  }
  const auto now = std::chrono::steady_clock::now();
  job.ExpireIfLate(now);
  if (!started_) Start(now);
  if (job.round.epoch != epoch_) {
    return absl::DeadlineExceededError(absl::StrCat("the barrier of step ", step_, " expired before rank ", rank_,
                                                    "'s push ended; push step ", step_, " again"));
  }
  if (job.round.sealed) return answer();

  // Validate the whole declaration before changing anything.
  std::vector<uint32_t> no_grad_shards;
  for (const std::string& t : no_grad_) {
    auto it = job.tensor_index.find(t);
    if (it == job.tensor_index.end()) {
      return absl::NotFoundError(absl::StrCat("no_grad names tensor ", Quote(t), ", which job '", job.name(), "' lacks"));
    }
    const int64_t s = job.shard_of_tensor[it->second];
    if (s < 0) continue;
    if (job.round.covered[rank_][s].FirstGap(0, job.shards[s].length) !=
        std::make_optional(std::make_pair(uint64_t{0}, job.shards[s].length))) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", rank_, " both pushed tensor '", t, "' and declared it no_grad"));
    }
    no_grad_shards.push_back(static_cast<uint32_t>(s));
  }
  std::vector<bool> no_grad(job.shards.size(), false);
  for (uint32_t s : no_grad_shards) no_grad[s] = true;
  for (size_t s = 0; s < job.shards.size(); ++s) {
    if (no_grad[s]) continue;
    if (auto gap = job.round.covered[rank_][s].FirstGap(0, job.shards[s].length)) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", rank_, "'s push of step ", step_, " ended without tensor '",
                       job.tensor_name(job.shards[s]), "' elements ",
                       Range(job.shards[s].offset + gap->first, job.shards[s].offset + gap->second),
                       "; push them or list the tensor in no_grad"));
    }
  }
  job.round.no_grad[rank_] = std::move(no_grad);
  if (!job.round.finished[rank_]) {
    job.round.finished[rank_] = true;
    ++job.round.finished_count;
  }

  if (job.round.finished_count == job.world_size()) {
    std::vector<ShardGrads> contributions;
    for (size_t s = 0; s < job.shards.size(); ++s) {
      ShardGrads sg;
      sg.shard = static_cast<uint32_t>(s);
      for (uint32_t r = 0; r < job.world_size(); ++r) {
        if (!job.round.no_grad[r][s]) sg.ranks.push_back(r);
      }
      if (!sg.ranks.empty()) contributions.push_back(std::move(sg));
    }
    auto stats = job.state->ReduceGrads(contributions);
    if (!stats.ok()) return stats.status();
    job.round.contributions = std::move(contributions);
    job.round.sealed = true;
    job.sealed_step = step_;
    job.sealed_stats = *stats;
    job.cv.notify_all();
    return answer();
  }

  const auto deadline = job.round.deadline;
  job.cv.wait_until(lock, deadline, [&] { return job.dropped || job.round.epoch != epoch_ || job.round.sealed; });
  if (job.dropped) return absl::NotFoundError(absl::StrCat("job '", job.name(), "' was dropped"));
  if (job.sealed_step == step_ && (job.round.sealed || job.step >= step_)) return answer();
  if (job.round.epoch == epoch_) {  // our own deadline: end the round for everyone
    const std::string missing = job.MissingSummary();
    job.EndRound();
    return absl::DeadlineExceededError(absl::StrCat("barrier of step ", step_, " timed out after ",
                                                    absl::FormatDuration(job.barrier_timeout), ": ", missing,
                                                    "; nothing was applied: push step ", step_, " again"));
  }
  return absl::DeadlineExceededError(absl::StrCat("the barrier of step ", step_,
                                                  " timed out; nothing was applied: push step ", step_, " again"));
}

absl::Status JobStore::Commit(const v1::CommitRequest& req,
                              const std::function<bool(const v1::ParamChunk&)>& emit) {
  auto found = Find(req.job());
  if (!found.ok()) return found.status();
  Job& job = **found;
  const uint64_t t = req.step();
  if (!std::isfinite(req.lr()) || req.lr() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("lr must be finite and >= 0, got ", req.lr()));
  }
  if (!std::isfinite(req.gscale())) {
    return absl::InvalidArgumentError(absl::StrCat("gscale must be finite, got ", req.gscale()));
  }
  if (req.group_lr_size() != 0 && req.group_lr_size() != job.spec.groups_size()) {
    return absl::InvalidArgumentError(absl::StrCat("group_lr has ", req.group_lr_size(), " entries; job '", job.name(),
                                                   "' has ", job.spec.groups_size(), " groups"));
  }
  for (double lr : req.group_lr()) {
    if (!std::isfinite(lr) || lr < 0) {
      return absl::InvalidArgumentError(absl::StrCat("every group_lr must be finite and >= 0, got ", lr));
    }
  }
  const Job::Applied args{req.lr(), req.gscale(), req.skip(), {req.group_lr().begin(), req.group_lr().end()}};
  std::unique_lock<std::mutex> lock(job.mu);
  if (job.dropped) return absl::NotFoundError(absl::StrCat("job '", job.name(), "' was dropped"));
  if (!job.failed.ok()) return job.failed;
  if (t > job.step + 1) {
    return absl::OutOfRangeError(absl::StrCat("job '", job.name(), "' is at step ", job.step, "; commit of step ", t,
                                              " is in the future"));
  }
  if (t == 0 || t < job.step) {
    return absl::FailedPreconditionError(absl::StrCat("job '", job.name(), "' is at step ", job.step,
                                                      "; commit of step ", t, " is stale; Read PARAM_BF16 for the current params"));
  }
  if (t == job.step + 1 && !job.applying) {  // the first commit of the next step starts applying it
    if (draining_) {
      return absl::UnavailableError(absl::StrCat("the server is shutting down (SIGTERM) and checkpointing job '",
                                                 job.name(), "' at step ", job.step, "; commit step ", t,
                                                 " on the restarted server"));
    }
    job.ExpireIfLate(std::chrono::steady_clock::now());
    if (!job.round.sealed) {
      return absl::FailedPreconditionError(absl::StrCat("cannot commit step ", t, ": its push is incomplete: ",
                                                        job.MissingSummary()));
    }
    job.applying = true;
    job.apply_args = args;
    job.apply_progress = 0;
  } else {
    const Job::Applied& a = t == job.step ? job.applied : job.apply_args;
    if (!(a == args)) {
      return absl::AbortedError(absl::StrCat("step ", t, " was applied with lr=", a.lr, " gscale=", a.gscale,
                                             " skip=", a.skip, "; this commit asks lr=", req.lr(), " gscale=",
                                             req.gscale(), " skip=", req.skip(), ": ranks disagree"));
    }
  }

  // The update runs piece by piece in stream order, so that a piece's params
  // go out while the next piece is computed. Every commit of the step applies
  // the next piece if nobody has yet, so no rank waits on another's reader.
  // Pieces start on kApplyAlignment boundaries: the bits equal one
  // whole-shard update.
  struct Piece {
    uint32_t shard;
    uint64_t offset;
    uint64_t length;
  };
  std::vector<Piece> pieces;
  for (uint32_t si = 0; si < job.shards.size(); ++si) {
    for (uint64_t off = 0; off < job.shards[si].length; off += options_.stream_chunk_elements) {
      pieces.push_back({si, off, std::min(options_.stream_chunk_elements, job.shards[si].length - off)});
    }
  }
  std::vector<int64_t> contribution(job.shards.size(), -1);
  std::vector<math::AdamWScalars> scalars;
  if (t == job.step + 1 && !req.skip()) {
    for (const ShardGrads& sg : job.round.contributions) {
      const OwnedShard& s = job.shards[sg.shard];
      contribution[sg.shard] = static_cast<int64_t>(scalars.size());
      const uint32_t group = job.spec.tensors(s.tensor).group();
      scalars.push_back(ComputeAdamWScalars(job.hypers[group], args.lr_of(group), req.gscale(), job.adam_steps[sg.shard] + 1));
    }
  }
  // Applies piece `k` of step t, which must be the next one; the last one
  // completes the step in the same critical section, so no rank ever sees
  // the job's step between two pieces.
  auto apply_piece = [&](uint64_t k) -> absl::Status {
    const Piece& p = pieces[k];
    if (contribution[p.shard] >= 0) {
      ShardStep step{job.round.contributions[contribution[p.shard]], scalars[contribution[p.shard]], p.offset,
                     p.length};
      if (auto st = job.state->Apply({&step, 1}); !st.ok()) {
        // Part of the step is applied: the job's state is no step's state.
        job.failed = absl::Status(st.code(), absl::StrCat("job '", job.name(), "' failed while applying step ", t,
                                                          ": ", st.message()));
        job.applying = false;
        job.cv.notify_all();
        return job.failed;
      }
    }
    job.apply_progress = k + 1;
    if (k + 1 == pieces.size()) {
      for (size_t c = 0; c < contribution.size(); ++c) {
        if (contribution[c] >= 0) ++job.adam_steps[c];
      }
      job.step = t;
      job.applied = job.apply_args;
      job.applying = false;
      job.EndRound();
    }
    job.cv.notify_all();
    return absl::OkStatus();
  };
  // Applies what is left of step t, for a commit whose caller went away.
  auto finish_step = [&]() -> absl::Status {
    while (job.step + 1 == t && job.applying) {
      if (auto st = apply_piece(job.apply_progress); !st.ok()) return st;
    }
    return absl::OkStatus();
  };

  v1::ParamChunk chunk;
  chunk.set_step(t);
  for (uint64_t k = 0; k < pieces.size(); ++k) {
    if (job.dropped) return absl::NotFoundError(absl::StrCat("job '", job.name(), "' was dropped"));
    if (!job.failed.ok()) return job.failed;
    if (job.step + 1 == t && job.applying && job.apply_progress == k) {
      if (auto st = apply_piece(k); !st.ok()) return st;
    }
    // Piece k holds step t once t is done and the next step has not reached
    // it, or while t is being applied and has passed it.
    const bool applying_past_k = job.applying && job.apply_progress > k;
    if (!(job.step == t && !applying_past_k) && !(job.step + 1 == t && applying_past_k)) {
      return absl::AbortedError(absl::StrCat("step ", t, " was superseded while streaming its params"));
    }
    const Piece& p = pieces[k];
    chunk.set_tensor(job.tensor_name(job.shards[p.shard]));
    chunk.set_offset(job.shards[p.shard].offset + p.offset);
    // FP32 params are the master itself; bf16 ones its rounding.
    const bool fp32 = job.fp32_params(job.shards[p.shard].tensor);
    if (fp32) {
      chunk.set_dtype(v1::FP32);
    } else {
      chunk.clear_dtype();  // BF16, as servers sent it before param_dtype existed
    }
    std::string* data = chunk.mutable_data();
    data->resize(p.length * (fp32 ? 4 : 2));
    absl::Status read = job.state->ReadState(p.shard, fp32 ? StateKind::kMaster : StateKind::kParamBf16, p.offset,
                                             p.length, fp32 ? DType::kFp32 : DType::kBf16, data->data());
    if (!read.ok()) {
      if (auto st = finish_step(); !st.ok()) return st;
      return read;
    }
    lock.unlock();
    const bool sent = emit(chunk);
    lock.lock();
    if (!sent) {
      if (auto st = finish_step(); !st.ok()) return st;
      return absl::CancelledError("the caller stopped reading the params");
    }
  }
  return absl::OkStatus();
}

absl::Status JobStore::Read(const v1::ReadRequest& req, const std::function<bool(const v1::StateChunk&)>& emit) const {
  auto found = Find(req.job());
  if (!found.ok()) return found.status();
  Job& job = **found;
  StateKind kind;
  switch (req.kind()) {
    case v1::MASTER: kind = StateKind::kMaster; break;
    case v1::EXP_AVG: kind = StateKind::kExpAvg; break;
    case v1::EXP_AVG_SQ: kind = StateKind::kExpAvgSq; break;
    case v1::PARAM_BF16: kind = StateKind::kParamBf16; break;
    default: return absl::InvalidArgumentError("read kind must be MASTER, EXP_AVG, EXP_AVG_SQ or PARAM_BF16");
  }
  const DType dtype = kind == StateKind::kParamBf16 ? DType::kBf16 : DType::kFp32;
  uint32_t shard;
  uint64_t length = req.length();
  {
    std::lock_guard<std::mutex> lock(job.mu);
    if (length == 0) {
      auto it = job.tensor_index.find(req.tensor());
      if (it != job.tensor_index.end() && job.shard_of_tensor[it->second] >= 0) {
        const OwnedShard& s = job.shards[job.shard_of_tensor[it->second]];
        if (req.offset() < s.offset + s.length) length = s.offset + s.length - req.offset();
      }
    }
    auto located = job.LocateRange(req.tensor(), req.offset(), length);
    if (!located.ok()) return located.status();
    shard = *located;
    if (length == 0) {  // the offset is at the shard's end: no element of it is asked for
      const OwnedShard& s = job.shards[shard];
      return absl::OutOfRangeError(absl::StrCat("offset ", req.offset(), " of tensor '", req.tensor(),
                                                "' is at the end of this server's shard ",
                                                Range(s.offset, s.offset + s.length), "; nothing to read"));
    }
  }
  const uint64_t base = job.shards[shard].offset;
  const uint64_t per_chunk = options_.stream_chunk_elements * 2 / DTypeSize(dtype);  // ~1 MiB
  v1::StateChunk chunk;
  chunk.set_tensor(req.tensor());
  chunk.set_dtype(ToProto(dtype));
  for (uint64_t off = req.offset(); off < req.offset() + length; off += per_chunk) {
    const uint64_t n = std::min(per_chunk, req.offset() + length - off);
    chunk.set_offset(off);
    chunk.mutable_data()->resize(n * DTypeSize(dtype));
    {
      std::unique_lock<std::mutex> lock(job.mu);
      // Never between two pieces of an update: a read sees whole steps only.
      job.cv.wait(lock, [&] { return !job.applying || job.dropped; });
      if (job.dropped) return absl::NotFoundError(absl::StrCat("job '", job.name(), "' was dropped"));
      if (!job.failed.ok()) return job.failed;
      if (auto st = job.state->ReadState(shard, kind, off - base, n, dtype, chunk.mutable_data()->data()); !st.ok()) {
        return st;
      }
      chunk.set_step(job.step);
    }
    if (!emit(chunk)) return absl::CancelledError("the caller stopped reading");
  }
  return absl::OkStatus();
}

}  // namespace shardopt
