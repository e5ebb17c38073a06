// Node groups over the CPU collective (threads) against real server
// processes: G = 1, 2 and 4 local ranks of one node train as one rank.
#include <thread>

#include "gtest/gtest.h"
#include "shardopt/node_group.h"
#include "tests/scale/scale_job.h"
#include "tests/testing/reference.h"
#include "tests/testing/server_process.h"

namespace shardopt::scale {
namespace {

using testing::ServerProcess;

class NodeGroupTest : public ::testing::TestWithParam<uint32_t> {};

// Runs fn(local_rank) on one thread per local rank.
template <typename Fn>
void OnEveryLocalRank(uint32_t g, const Fn& fn) {
  std::vector<std::thread> threads;
  for (uint32_t j = 0; j < g; ++j) threads.emplace_back([&, j] { fn(j); });
  for (auto& t : threads) t.join();
}

TEST_P(NodeGroupTest, OneNodeOfGRanksIsBitwiseThePlainAggregationOfGRanks) {
  const uint32_t g = GetParam();
  constexpr uint32_t kServers = 3;
  constexpr uint64_t kSteps = 30, kSeed = 7;
  std::vector<std::unique_ptr<ServerProcess>> servers;
  NodeGroupOptions options;
  for (uint32_t s = 0; s < kServers; ++s) {
    servers.push_back(ServerProcess::Start({"--threads=1"}));
    ASSERT_NE(servers.back(), nullptr);
    options.client.servers.push_back(servers.back()->address());
  }
  JobOptions job = MakeJob("node", /*world_size=*/1, 10000);  // one node
  job.grad_type = GradType::kFp32;
  const std::vector<uint64_t> offsets = FlatOffsets(job.tensors);
  const uint64_t flat = offsets.back();

  auto collectives = MakeCpuCollectives(g);
  std::vector<std::unique_ptr<NodeGroup>> groups(g);
  std::vector<absl::Status> attached(g);
  OnEveryLocalRank(g, [&](uint32_t j) {
    auto group = NodeGroup::Create(options, collectives[j].get());
    attached[j] = group.status();
    if (!group.ok()) return;
    groups[j] = *std::move(group);
    attached[j] = groups[j]->CreateOrAttach(job).status();
  });
  uint64_t owned = 0;
  for (uint32_t j = 0; j < g; ++j) {
    ASSERT_TRUE(attached[j].ok()) << attached[j];
    owned += groups[j]->owned().size();
  }
  EXPECT_EQ(owned, flat);  // the local ranks' parts tile the model
  for (uint32_t t = 0; t < job.tensors.size(); ++t) {
    const auto init = InitialValues(kSeed, t, job.tensors[t].numel);
    ASSERT_TRUE(groups[0]->client().InitFp32(job.tensors[t].name, init.data()).ok());
  }

  StepOptions step_options;
  step_options.lr = kLr;
  step_options.max_grad_norm = 20;  // clipping on: every local rank must decide alike
  std::vector<std::vector<uint16_t>> params(g, std::vector<uint16_t>(flat));
  std::vector<std::vector<float>> gscales(g);
  std::vector<absl::Status> failed(g);
  OnEveryLocalRank(g, [&](uint32_t j) {
    std::vector<uint16_t> grads(flat, 0);
    for (uint64_t step = 1; step <= kSteps; ++step) {
      for (uint32_t t = 0; t < job.tensors.size(); ++t) {
        const auto grad = Gradient(kSeed, step, j, t, job.tensors[t].numel);
        std::copy(grad.begin(), grad.end(), grads.begin() + offsets[t]);
      }
      std::fill(params[j].begin(), params[j].end(), 0xFFFF);  // poisoned
      auto result = groups[j]->Step(grads.data(), params[j].data(), step_options);
      if (!result.ok()) {
        failed[j] = result.status();
        return;
      }
      gscales[j].push_back(result->decision.gscale);
    }
  });
  for (uint32_t j = 0; j < g; ++j) {
    ASSERT_TRUE(failed[j].ok()) << "local rank " << j << ": " << failed[j];
    EXPECT_EQ(gscales[j], gscales[0]) << "local rank " << j;
  }
  EXPECT_LT(*std::min_element(gscales[0].begin(), gscales[0].end()), 1.0f / g);  // clipping was active

  // The reference is plain aggregation of G ranks, each pushing apart.
  const std::vector<float> expected = ReferenceMasters(MakeJob("node", g, 10000), kSeed, gscales[0]);
  std::vector<float> masters;
  std::vector<uint16_t> expected_params(flat, 0xFFFF);
  uint64_t at = 0;
  for (uint32_t t = 0; t < job.tensors.size(); ++t) {
    std::vector<float> m(job.tensors[t].numel);
    ASSERT_TRUE(groups[0]->client().Read(job.tensors[t].name, StateToRead::kMaster, 0, m.size(), m.data()).ok());
    masters.insert(masters.end(), m.begin(), m.end());
    const auto bf16 = testing::ToBf16(std::vector<float>(expected.begin() + at, expected.begin() + at + m.size()));
    std::copy(bf16.begin(), bf16.end(), expected_params.begin() + offsets[t]);
    at += m.size();
  }
  EXPECT_EQ(masters, expected);
  for (uint32_t j = 0; j < g; ++j) {
    for (uint32_t t = 0; t < job.tensors.size(); ++t) {
      const auto begin = params[j].begin() + offsets[t];
      EXPECT_TRUE(std::equal(begin, begin + job.tensors[t].numel, expected_params.begin() + offsets[t]))
          << "local rank " << j << " tensor " << job.tensors[t].name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(LocalRanks, NodeGroupTest, ::testing::Values(1u, 2u, 4u));

TEST(NodeGroup, RefusesBf16GradientsWithAClearError) {
  auto server = ServerProcess::Start({"--threads=1"});
  ASSERT_NE(server, nullptr);
  auto collectives = MakeCpuCollectives(1);
  NodeGroupOptions options;
  options.client.servers = {server->address()};
  auto group = NodeGroup::Create(options, collectives[0].get()).value();
  auto st = group->CreateOrAttach(MakeJob("bf16", 1, 1000));
  EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardopt::scale
