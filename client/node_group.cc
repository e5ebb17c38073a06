#include "shardopt/node_group.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "client/after_step.h"
#include "client/option_checks.h"
#include "client/proto_convert.h"

namespace shardopt {
namespace {

uint32_t FirstOwnedServer(uint32_t local_rank, uint32_t local_ranks, uint32_t servers) {
  return static_cast<uint32_t>(uint64_t{local_rank} * servers / local_ranks);
}

// A view of tensor t for the client, which reads and writes only inside the
// owned servers' shards, all of which lie in `owned`. The pointer is formed
// through uintptr_t: for a tensor that starts before the owned range it
// points before the buffer, and is never dereferenced there.
template <typename T>
T* TensorBase(T* owned_data, uint64_t owned_begin, uint64_t tensor_begin) {
  return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(owned_data) -
                              (owned_begin - tensor_begin) * sizeof(T));
}

// What a Step that failed after its push needs: the servers count a step's
// push once, so new gradients for it would be ignored.
constexpr char kRetry[] = "; call Step again with the same gradients";
// What a call refused before it reached a server says.
constexpr char kNothingSent[] = "; nothing was sent";

// FNV-1a over what a local rank was given, folded below 2^53: as a double
// it passes an all-reduce whose other terms are zeros exactly, so the local
// ranks can compare theirs (SameOnEveryLocalRank).
class Fingerprint {
 public:
  Fingerprint& Add(const void* data, size_t bytes) {
    for (size_t i = 0; i < bytes; ++i) h_ = (h_ ^ static_cast<const unsigned char*>(data)[i]) * 1099511628211ull;
    return *this;
  }
  Fingerprint& Add(double v) { return Add(&v, sizeof v); }
  Fingerprint& Add(const std::string& s) { return Add(static_cast<double>(s.size())).Add(s.data(), s.size()); }
  double value() const { return static_cast<double>(h_ >> 11); }

 private:
  uint64_t h_ = 14695981039346656037ull;
};

}  // namespace

absl::StatusOr<std::unique_ptr<NodeGroup>> NodeGroup::Create(const NodeGroupOptions& options,
                                                              Collective* collective) {
  if (collective == nullptr || collective->size() == 0) return absl::InvalidArgumentError("a node group needs a collective");
  ClientOptions client_options = options.client;
  client_options.rank = options.node;
  client_options.push_servers.clear();
  const uint32_t servers = static_cast<uint32_t>(client_options.servers.size());
  const uint32_t g = collective->size(), j = collective->rank();
  for (uint32_t s = FirstOwnedServer(j, g, servers); s < FirstOwnedServer(j + 1, g, servers); ++s) {
    client_options.push_servers.push_back(s);
  }
  SHARDOPT_ASSIGN_OR_RETURN(auto client, Client::Connect(client_options));
  return std::unique_ptr<NodeGroup>(new NodeGroup(std::move(client), collective, options));
}

absl::StatusOr<uint64_t> NodeGroup::CreateOrAttach(const JobOptions& job) {
  offsets_.clear();  // attached to nothing unless this succeeds
  ranges_.clear();
  absl::StatusOr<uint64_t> step = 0;
  if (job.grad_type != GradType::kFp32) {
    step = absl::InvalidArgumentError("a node group pushes its nodes' fp32 sums: set JobOptions::grad_type to kFp32");
  }
  // The servers refuse another node's attach that says another G.
  JobOptions as_group = job;
  as_group.trainers_per_rank = collective_->size();
  if (step.ok() && job.trainers_per_rank != 0 && job.trainers_per_rank != as_group.trainers_per_rank) {
    step = absl::InvalidArgumentError(absl::StrCat("JobOptions::trainers_per_rank is ", job.trainers_per_rank,
                                                   ", but this node group has ", as_group.trainers_per_rank,
                                                   " local ranks: leave it 0, and the group says its own"));
  }
  for (const TensorOptions& t : job.tensors) {
    // A commit returns such a tensor's params as fp32, which the bf16 flat
    // buffers have no room for.
    if (step.ok() && t.param_type != ParamType::kBf16) {
      step = absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' has fp32 params; a node group returns "
                                                     "every tensor's params in one bf16 buffer: make it kBf16"));
    }
  }
  // The group's settings, which each local rank took from its own options:
  // local ranks of other nodes, servers or jobs, or another checkpoint_every,
  // would call the collectives apart (the servers tell none of it). The job
  // whole, as its servers are asked for it, and its resume: local ranks
  // given other restore_steps each restored their own servers' part (an
  // outside probe's job came out torn, or rewound, from run to run), and
  // other settings came back as the servers' refusal on some local ranks.
  Fingerprint settings;
  settings.Add(options_.node).Add(options_.client.checkpoint_every).Add(static_cast<double>(job.resume));
  settings.Add(ToCreateJobRequest(as_group, {}, 0).SerializeAsString());
  for (const std::string& server : options_.client.servers) settings.Add(server);
  const std::string what = absl::StrCat("CreateOrAttach of job '", job.name, "'");
  SHARDOPT_RETURN_IF_ERROR(
      AgreeAlike(step.status(), settings.value(), "node, servers, checkpoint_every or JobOptions", what, kNothingSent));
  step = client_->CreateOrAttach(as_group);
  // A local rank refused alone (another job's settings) would leave the
  // others waiting in their first Step's collective.
  SHARDOPT_RETURN_IF_ERROR(Agree(step.status(), what));
  job_ = as_group;
  offsets_ = FlatOffsets(job.tensors);
  const std::vector<uint64_t> bounds = ServerBounds(job.tensors, servers());
  const uint32_t g = collective_->size();
  ranges_.clear();
  for (uint32_t j = 0; j < g; ++j) {
    ranges_.push_back({bounds[FirstOwnedServer(j, g, servers())], bounds[FirstOwnedServer(j + 1, g, servers())]});
  }
  grads_.assign(owned().size(), 0.f);
  params_.assign(owned().size(), 0);
  step_ = *step;
  return step_;
}

absl::Status NodeGroup::Agree(const absl::Status& mine, const std::string& what, const std::string& then) {
  return AgreeAlike(mine, /*fingerprint=*/0, "", what, then);  // every fingerprint 0: alike
}

absl::Status NodeGroup::CheckStep(const uint16_t* flat_grads, const uint16_t* flat_params,
                                  const StepOptions& options) {
  // Before anything is sent: a local rank refused alone would leave its
  // servers without the step that the others' servers applied, and local
  // ranks with different options would each apply theirs on the servers
  // they own.
  absl::Status checked = CheckStepOptions(options, Trainers(job_));
  if (checked.ok()) checked = CheckJobLearningRates(job_, options.lr, options.group_lr);
  if (checked.ok() && (flat_grads == nullptr || flat_params == nullptr)) {
    checked = absl::InvalidArgumentError("NodeGroup::Step needs flat_grads and flat_params");
  }
  Fingerprint given;
  given.Add(options.lr).Add(options.max_grad_norm).Add(options.loss_scale).Add(options.group_lr.size());
  for (double lr : options.group_lr) given.Add(lr);
  return AgreeAlike(checked, given.value(), "StepOptions (lr, group_lr, max_grad_norm, loss_scale)",
                    absl::StrCat("the check of step ", step_ + 1, "'s arguments"), kNothingSent);
}

absl::Status NodeGroup::AgreeAlike(const absl::Status& mine, double fingerprint, const std::string& given,
                                   const std::string& what, const std::string& then) {
  // One all-reduce: [0] how many local ranks failed, [1 + r] local rank r's
  // fingerprint alone.
  const uint32_t g = collective_->size(), j = collective_->rank();
  std::vector<double> votes(1 + g, 0.0);
  votes[0] = mine.ok() ? 0 : 1;
  votes[1 + j] = fingerprint;
  SHARDOPT_RETURN_IF_ERROR(collective_->AllReduceSum(votes.data(), votes.size()));
  if (!mine.ok()) return mine;
  if (votes[0] > 0) return absl::AbortedError(absl::StrCat(what, " failed on ", votes[0], " other local rank(s)", then));
  for (uint32_t r = 0; r < g; ++r) {
    if (votes[1 + r] != fingerprint) {
      return absl::InvalidArgumentError(absl::StrCat("local ranks ", j, " and ", r, " were given different ", given,
                                                     ": every local rank of a node group takes the same, bit for "
                                                     "bit; nothing was sent"));
    }
  }
  return absl::OkStatus();
}

absl::Status NodeGroup::Checkpoint() {
  if (offsets_.empty()) return absl::FailedPreconditionError("call CreateOrAttach first");
  // The first local rank that pushes part of the model: its client commits,
  // so it is at the job's step, where one that pushes nothing is not.
  uint32_t writer = 0;
  while (ranges_[writer].size() == 0) ++writer;
  absl::Status mine = collective_->rank() == writer ? client_->Checkpoint() : absl::OkStatus();
  return Agree(mine, absl::StrCat("the checkpoint of step ", step_));
}

absl::StatusOr<StepResult> NodeGroup::Step(const uint16_t* flat_grads, uint16_t* flat_params,
                                           const StepOptions& options) {
  if (offsets_.empty()) return absl::FailedPreconditionError("call CreateOrAttach first");
  SHARDOPT_RETURN_IF_ERROR(CheckStep(flat_grads, flat_params, options));
  const FlatRange mine = owned();
  SHARDOPT_RETURN_IF_ERROR(collective_->ReduceScatter(flat_grads, grads_.data(), ranges_));

  // Only tensors that reach into the owned range: the others have no shard
  // on the owned servers.
  std::vector<GradView> grad_views;
  std::vector<ParamView> param_views;
  for (size_t t = 0; t < job_.tensors.size(); ++t) {
    const uint64_t begin = offsets_[t], end = begin + job_.tensors[t].numel;
    if (end <= mine.begin || begin >= mine.end) continue;
    grad_views.push_back({job_.tensors[t].name, TensorBase(grads_.data(), mine.begin, begin)});
    param_views.push_back({job_.tensors[t].name, TensorBase(params_.data(), mine.begin, begin)});
  }
  const uint64_t t = step_ + 1;
  absl::StatusOr<PushResult> pushed = PushResult{};
  if (mine.size() > 0) pushed = client_->Push(t, grad_views, &options);
  SHARDOPT_RETURN_IF_ERROR(Agree(pushed.status(), absl::StrCat("the push of step ", t), kRetry));

  // Each server's partial comes from exactly one local rank and is zero on
  // the others, so the all-reduce's sums are exact whatever its order.
  std::vector<double> partials(2 * servers(), 0.0);
  for (uint32_t s = 0; s < pushed->partials.size(); ++s) {
    partials[2 * s] = pushed->partials[s].sum_squares;
    partials[2 * s + 1] = pushed->partials[s].nonfinite ? 1 : 0;
  }
  SHARDOPT_RETURN_IF_ERROR(collective_->AllReduceSum(partials.data(), partials.size()));
  std::vector<PushPartial> combined(servers());
  for (uint32_t s = 0; s < servers(); ++s) combined[s] = {partials[2 * s], partials[2 * s + 1] > 0};
  StepResult result;
  result.step = t;
  result.decision = Decide(CombinePartials(std::move(combined)), Trainers(job_), options);

  absl::Status committed;
  if (mine.size() > 0) {  // a local rank with no range has nothing to commit or copy
    committed = client_->Commit(t, options.lr, result.decision.gscale, result.decision.skip, param_views,
                                options.group_lr);
    if (committed.ok()) committed = collective_->FromHost(params_.data(), flat_params + mine.begin, mine.size() * 2);
  }
  SHARDOPT_RETURN_IF_ERROR(Agree(committed, absl::StrCat("the commit of step ", t), kRetry));
  SHARDOPT_RETURN_IF_ERROR(collective_->AllGather(flat_params, ranges_));
  step_ = t;
  if (const uint64_t every = options_.client.checkpoint_every; every > 0 && options_.node == 0 && t % every == 0) {
    if (absl::Status st = Checkpoint(); !st.ok()) return CheckpointAfterStepFailed(t, st);
  }
  return result;
}

}  // namespace shardopt
