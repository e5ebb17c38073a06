// A node's G local ranks (one per GPU) acting as one rank of the job. They
// reduce-scatter their bf16 gradients through a Collective, so that local
// rank j holds the node's fp32 sum for the servers it owns and pushes only
// that: 1/G of the model when G divides the server count. The servers'
// partial norms meet in an all-reduce, so every local rank decides alike;
// each commits to its own servers, and the params are all-gathered.
//
// Owned servers: local rank j owns servers [j*S/G, (j+1)*S/G), so each
// (node, server) pair has exactly one pusher, as the step protocol needs.
// With S < G some local ranks push nothing.
//
// Numerics: a server's aggregate for N nodes is ((node 0's sum) + node 1's
// sum) + ..., each node's sum being, with CpuCollective, the fp32 sum of its
// local ranks in local-rank order. With one node that is exactly what a
// server computes for G ranks pushing apart; with several nodes the
// association differs from plain aggregation over N*G ranks, so results
// agree to fp32 rounding, not bitwise. NCCL's reduction order is its own.
//
// Failures: every call that reaches the servers (CreateOrAttach, Step,
// Checkpoint) is agreed among the local ranks through the Collective, so a
// call that fails on one fails on all (ABORTED on the others, naming how
// many failed). A Step's own arguments are checked on every local rank
// before anything is sent, and must be the same, bit for bit, on every
// local rank, as must each one's node, servers, checkpoint_every and job at
// CreateOrAttach (the whole JobOptions, restore_step and resume included). A Step that failed after its push is called again with the
// same gradients, as Client::Step is (the servers count a step's push
// once), unless step() advanced: then the step was applied and only its
// checkpoint_every checkpoint failed. A CpuCollective fails a local rank
// that does not come within its timeout, and then every later call: make
// new collectives and node groups, and CreateOrAttach again; keep that
// timeout above max_attempts x (barrier + rpc timeout), the longest a push
// may retry. The NCCL collective has no timeout.
//
// Thread safety: one NodeGroup per local rank, each used from one thread; the
// local ranks' NodeGroups run at once and meet in their Collective.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "shardopt/client.h"
#include "shardopt/collective.h"

namespace shardopt {

// Every node of the job has the same G and the same server list: the
// gradient is averaged over nodes x G ranks. The servers hold each node to
// both at CreateOrAttach: the group's attach says its G
// (JobOptions::trainers_per_rank) and its part of the placement, and one
// that differs from the job's is refused, ALREADY_EXISTS (FAILED_PRECONDITION
// where the attach restores the job from a checkpoint).
struct NodeGroupOptions {
  // Servers and tuning; the group sets rank and push_servers. Its
  // checkpoint_every is the group's: node 0 checkpoints after every step
  // that is a multiple of it, as Checkpoint() does.
  ClientOptions client;
  uint32_t node = 0;     // this node's index: its rank in the job
};

class NodeGroup {
 public:
  // Each local rank creates its own, with its own Collective.
  static absl::StatusOr<std::unique_ptr<NodeGroup>> Create(const NodeGroupOptions& options, Collective* collective);

  // job.world_size is the number of nodes, and job.grad_type must be kFp32:
  // a node pushes fp32 partial sums. Every tensor's param_type must be
  // kBf16 (INVALID_ARGUMENT otherwise): the params come back in one bf16
  // flat buffer.
  absl::StatusOr<uint64_t> CreateOrAttach(const JobOptions& job);

  // One step over flat buffers in the collective's memory, each
  // FlatOffsets(job.tensors).back() elements with tensor t at FlatOffsets[t]:
  // every tensor has a gradient. `flat_params` receives every tensor's
  // params, and zeros in the gaps between tensors. Both buffers are needed,
  // and `options` are checked as Client::Step checks them and must be equal
  // on every local rank (INVALID_ARGUMENT, nothing sent, on every local
  // rank; ABORTED on those whose own were fine but another's were not).
  // With NCCL, the gradients must be written by the time the device's legacy
  // default stream (PyTorch's default stream) reaches this call: work queued
  // on another stream must be synchronized with it first.
  absl::StatusOr<StepResult> Step(const uint16_t* flat_grads, uint16_t* flat_params, const StepOptions& options);
  // Writes a checkpoint of the job's step on every server (as
  // Client::Checkpoint), from the first local rank that pushes part of the
  // model; every local rank calls it and gets the outcome.
  absl::Status Checkpoint();

  // The job's step, the last one this group stepped or attached at.
  // (client().step() of a local rank that pushes nothing stays at the step
  // it attached at: its client never commits.)
  uint64_t step() const { return step_; }
  // For Init, Read and Describe, which go to every server.
  Client& client() { return *client_; }
  // The flat range this local rank pushes and commits (empty before
  // CreateOrAttach).
  FlatRange owned() const { return ranges_.empty() ? FlatRange{} : ranges_[collective_->rank()]; }

 private:
  NodeGroup(std::unique_ptr<Client> client, Collective* collective, const NodeGroupOptions& options)
      : client_(std::move(client)), collective_(collective), options_(options) {}
  uint32_t servers() const { return static_cast<uint32_t>(options_.client.servers.size()); }
  // Every local rank learns whether any failed, so none waits in a collective
  // that another has left. The others' ABORTED says that `what` failed on
  // how many, then `then`.
  absl::Status Agree(const absl::Status& mine, const std::string& what, const std::string& then = "");
  // Step's arguments, checked on every local rank and compared among them.
  absl::Status CheckStep(const uint16_t* flat_grads, const uint16_t* flat_params, const StepOptions& options);
  // Agree, and then INVALID_ARGUMENT on every local rank unless each passed
  // the same `fingerprint` of what it was `given` (named in the message):
  // one collective for both, as a Step's arguments need.
  absl::Status AgreeAlike(const absl::Status& mine, double fingerprint, const std::string& given,
                          const std::string& what, const std::string& then);

  std::unique_ptr<Client> client_;
  Collective* collective_;
  const NodeGroupOptions options_;
  JobOptions job_;
  std::vector<uint64_t> offsets_;
  std::vector<FlatRange> ranges_;  // [local rank]
  uint64_t step_ = 0;
  std::vector<float> grads_;       // host: the node's sums for the owned range
  std::vector<uint16_t> params_;   // host: the owned range's params
};

}  // namespace shardopt
