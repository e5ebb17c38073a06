#include "tests/testing/scripted_trainer.h"

#include <cstdlib>
#include <filesystem>
#include <random>

#include "gtest/gtest.h"

#include "tests/testing/reference.h"

namespace shardopt::testing {

JobOptions DurableJob(const std::string& name, const std::vector<std::pair<std::string, uint64_t>>& fp32_tensors) {
  JobOptions job;
  job.name = name;
  GroupOptions fp32;
  fp32.name = "fp32";
  GroupOptions bf16 = fp32;
  bf16.name = "bf16";
  bf16.precision = StatePrecision::kBf16;
  job.groups = {fp32, bf16};
  for (const auto& [tensor, numel] : fp32_tensors) job.tensors.push_back({tensor, numel, 0});
  job.tensors.push_back({"gain", 64, 1});
  job.barrier_timeout_ms = 10000;
  return job;
}

ScriptedTrainer::ScriptedTrainer(JobOptions job) : job_(std::move(job)) {
  for (const TensorOptions& t : job_.tensors) params_.emplace_back(t.numel);
}

absl::Status ScriptedTrainer::Init(Client& client) const {
  for (size_t i = 0; i < job_.tensors.size(); ++i) {
    std::mt19937_64 rng(1000 + i);
    const std::vector<float> init = RandomFloats(rng, job_.tensors[i].numel, -1, 1);
    if (auto st = client.InitFp32(job_.tensors[i].name, init.data()); !st.ok()) return st;
  }
  return absl::OkStatus();
}

std::vector<GradView> ScriptedTrainer::Gradients(uint64_t t, std::vector<std::vector<uint16_t>>& storage) const {
  storage.resize(job_.tensors.size());
  std::vector<GradView> views;
  for (size_t i = 0; i < job_.tensors.size(); ++i) {
    std::mt19937_64 rng(t * 7919 + i);
    storage[i] = RandomBf16(rng, job_.tensors[i].numel, 0.3f);
    const bool no_grad = (t + i) % 5 == 0;
    views.push_back({job_.tensors[i].name, no_grad ? nullptr : storage[i].data()});
  }
  return views;
}

absl::StatusOr<PushResult> ScriptedTrainer::Push(Client& client, uint64_t t) const {
  std::vector<std::vector<uint16_t>> storage;
  return client.Push(t, Gradients(t, storage));
}

absl::StatusOr<StepResult> ScriptedTrainer::Step(Client& client, const std::function<void(Phase)>& on_phase) {
  const uint64_t t = client.step() + 1;
  std::vector<ParamView> pv;
  for (size_t i = 0; i < job_.tensors.size(); ++i) pv.push_back({job_.tensors[i].name, params_[i].data()});
  StepOptions so;
  so.lr = 1e-2;
  if (!on_phase) {
    std::vector<std::vector<uint16_t>> storage;
    return client.Step(Gradients(t, storage), so, pv);
  }
  on_phase(Phase::kPush);
  auto push = Push(client, t);
  if (!push.ok()) return push.status();
  StepResult result{t, Decide(*push, job_.world_size, so)};
  on_phase(Phase::kCommit);
  auto st = client.Commit(t, so.lr, result.decision.gscale, result.decision.skip, pv);
  on_phase(Phase::kIdle);
  if (!st.ok()) return st;
  return result;
}

absl::StatusOr<std::vector<uint32_t>> Fingerprint(Client& client, const JobOptions& job) {
  // One ReadMany of everything, so that every fingerprint is of one step.
  std::vector<std::vector<uint32_t>> fp32;
  std::vector<std::vector<uint16_t>> params;
  std::vector<StateRead> reads;
  fp32.reserve(3 * job.tensors.size());
  params.reserve(job.tensors.size());
  for (const TensorOptions& t : job.tensors) {
    for (StateToRead k : {StateToRead::kMaster, StateToRead::kExpAvg, StateToRead::kExpAvgSq}) {
      fp32.emplace_back(t.numel);
      reads.push_back({t.name, k, 0, t.numel, fp32.back().data()});
    }
    params.emplace_back(t.numel);
    reads.push_back({t.name, StateToRead::kParamBf16, 0, t.numel, params.back().data()});
  }
  if (auto st = client.ReadMany(reads); !st.ok()) return st;
  std::vector<uint32_t> out;
  for (size_t t = 0; t < job.tensors.size(); ++t) {
    for (size_t k = 0; k < 3; ++k) out.insert(out.end(), fp32[3 * t + k].begin(), fp32[3 * t + k].end());
    out.insert(out.end(), params[t].begin(), params[t].end());
  }
  return out;
}

std::vector<std::unique_ptr<ServerProcess>> StartServers(int n, const std::string& checkpoint_dir) {
  std::vector<std::unique_ptr<ServerProcess>> out;
  for (int i = 0; i < n; ++i) {
    std::vector<std::string> args = {"--threads=1"};
    if (!checkpoint_dir.empty()) args.push_back("--checkpoint_dir=" + checkpoint_dir);
    out.push_back(ServerProcess::Start(args));
    // Every caller goes on to use the server: stop here, saying why, rather
    // than at a null pointer further on.
    if (out.back() == nullptr) {
      ADD_FAILURE() << "shardopt-server " << i << " of " << n << " did not start (the failure above says why)";
      std::abort();
    }
  }
  return out;
}

std::unique_ptr<Client> Connect(const std::vector<std::unique_ptr<ServerProcess>>& servers, ClientOptions options) {
  for (const auto& s : servers) options.servers.push_back(s->address());
  return Client::Connect(options).value();
}

ScriptedTrainer Train(Client& client, const JobOptions& job, uint64_t steps) {
  ScriptedTrainer trainer(job);
  EXPECT_EQ(client.CreateOrAttach(job).value(), 0u);
  EXPECT_TRUE(trainer.Init(client).ok());
  for (uint64_t t = 0; t < steps; ++t) EXPECT_TRUE(trainer.Step(client).ok());
  return trainer;
}

std::vector<std::vector<uint32_t>> Uninterrupted(const JobOptions& job, const std::vector<uint64_t>& steps) {
  auto servers = StartServers(1, "");
  auto client = Connect(servers);
  ScriptedTrainer trainer = Train(*client, job, 0);
  std::vector<std::vector<uint32_t>> out;
  for (uint64_t at : steps) {
    while (client->step() < at) EXPECT_TRUE(trainer.Step(*client).ok());
    out.push_back(Fingerprint(*client, job).value());
  }
  return out;
}

}  // namespace shardopt::testing
