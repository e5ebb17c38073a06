// A trainer whose every input is a function of (tensor, step), so that a run
// resumed from a checkpoint at step t replays exactly the steps an
// uninterrupted run takes: the durability tests compare the two bitwise.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "shardopt/client.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/server_process.h"

namespace shardopt::testing {

// Group 0 is FP32, group 1 BF16. Tensor "gain" (64 elements) is in group 1;
// the others, with the sizes given, in group 0.
JobOptions DurableJob(const std::string& name, const std::vector<std::pair<std::string, uint64_t>>& fp32_tensors);

class ScriptedTrainer {
 public:
  explicit ScriptedTrainer(JobOptions job);
  const JobOptions& job() const { return job_; }

  absl::Status Init(Client& client) const;
  enum class Phase { kPush, kCommit, kIdle };
  // Pushes and commits step client.step() + 1. Tensor i has no gradient in
  // steps t with (t + i) % 5 == 0, so the tensors' Adam steps drift apart.
  // Without `on_phase` this is Client::Step, with its checkpoint_every;
  // with it, Push and Commit are called apart and `on_phase` is told which
  // one runs.
  absl::StatusOr<StepResult> Step(Client& client, const std::function<void(Phase)>& on_phase = nullptr);
  // Pushes step t's gradients: a retry, once t is committed.
  absl::StatusOr<PushResult> Push(Client& client, uint64_t t) const;
  // The params the last Step's commit returned, per tensor.
  const std::vector<std::vector<uint16_t>>& params() const { return params_; }

 private:
  // Step t's gradients: `storage` holds them, the views point into it.
  std::vector<GradView> Gradients(uint64_t t, std::vector<std::vector<uint16_t>>& storage) const;
  JobOptions job_;
  std::vector<std::vector<uint16_t>> params_;
};

// Every bit of the job's state as the servers hold it: master, m and v of
// each tensor as fp32 bits, then the params as bf16 bits; of one step, read
// in one Client::ReadMany.
absl::StatusOr<std::vector<uint32_t>> Fingerprint(Client& client, const JobOptions& job);

std::vector<std::unique_ptr<ServerProcess>> StartServers(int n, const std::string& checkpoint_dir);
std::unique_ptr<Client> Connect(const std::vector<std::unique_ptr<ServerProcess>>& servers,
                                ClientOptions options = {});
// Creates the job, initializes it and runs `steps` steps; returns the trainer.
ScriptedTrainer Train(Client& client, const JobOptions& job, uint64_t steps);
// The fingerprints one uninterrupted run on one server reaches after each of
// `steps` (ascending).
std::vector<std::vector<uint32_t>> Uninterrupted(const JobOptions& job, const std::vector<uint64_t>& steps);

}  // namespace shardopt::testing
