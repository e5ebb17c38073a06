#include "shardopt/node_group.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

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
  return std::unique_ptr<NodeGroup>(new NodeGroup(std::move(client), collective, servers));
}

absl::StatusOr<uint64_t> NodeGroup::CreateOrAttach(const JobOptions& job) {
  if (job.grad_type != GradType::kFp32) {
    return absl::InvalidArgumentError("a node group pushes its nodes' fp32 sums: set JobOptions::grad_type to kFp32");
  }
  SHARDOPT_ASSIGN_OR_RETURN(auto step, client_->CreateOrAttach(job));
  job_ = job;
  offsets_ = FlatOffsets(job.tensors);
  const std::vector<uint64_t> bounds = ServerBounds(job.tensors, servers_);
  const uint32_t g = collective_->size();
  ranges_.clear();
  for (uint32_t j = 0; j < g; ++j) {
    ranges_.push_back({bounds[FirstOwnedServer(j, g, servers_)], bounds[FirstOwnedServer(j + 1, g, servers_)]});
  }
  grads_.assign(owned().size(), 0.f);
  params_.assign(owned().size(), 0);
  step_ = step;
  return step_;
}

absl::Status NodeGroup::Agree(const absl::Status& mine, const char* phase) {
  double failed = mine.ok() ? 0 : 1;
  SHARDOPT_RETURN_IF_ERROR(collective_->AllReduceSum(&failed, 1));
  if (!mine.ok()) return mine;
  if (failed > 0) {
    return absl::AbortedError(absl::StrCat(phase, " of step ", step_ + 1, " failed on ", failed,
                                           " other local rank(s); the step can be retried"));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepResult> NodeGroup::Step(const uint16_t* flat_grads, uint16_t* flat_params,
                                           const StepOptions& options) {
  if (offsets_.empty()) return absl::FailedPreconditionError("call CreateOrAttach first");
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
  if (mine.size() > 0) pushed = client_->Push(t, grad_views);
  SHARDOPT_RETURN_IF_ERROR(Agree(pushed.status(), "push"));

  // Each server's partial comes from exactly one local rank and is zero on
  // the others, so the all-reduce's sums are exact whatever its order.
  std::vector<double> partials(2 * servers_, 0.0);
  for (uint32_t s = 0; s < pushed->partials.size(); ++s) {
    partials[2 * s] = pushed->partials[s].sum_squares;
    partials[2 * s + 1] = pushed->partials[s].nonfinite ? 1 : 0;
  }
  SHARDOPT_RETURN_IF_ERROR(collective_->AllReduceSum(partials.data(), partials.size()));
  std::vector<PushPartial> combined(servers_);
  for (uint32_t s = 0; s < servers_; ++s) combined[s] = {partials[2 * s], partials[2 * s + 1] > 0};
  StepResult result;
  result.step = t;
  result.decision = Decide(CombinePartials(std::move(combined)), job_.world_size * collective_->size(), options);

  absl::Status committed;
  if (mine.size() > 0) {
    committed = client_->Commit(t, options.lr, result.decision.gscale, result.decision.skip, param_views,
                                options.group_lr);
  }
  if (committed.ok()) committed = collective_->FromHost(params_.data(), flat_params + mine.begin, mine.size() * 2);
  SHARDOPT_RETURN_IF_ERROR(Agree(committed, "commit"));
  SHARDOPT_RETURN_IF_ERROR(collective_->AllGather(flat_params, ranges_));
  step_ = t;
  return result;
}

}  // namespace shardopt
