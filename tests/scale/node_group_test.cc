// Node groups over the CPU collective (threads) against real server
// processes: G = 1, 2 and 4 local ranks of one node, and two nodes of 2.
#include <thread>

#include "gtest/gtest.h"
#include "kernels/adamw_math.h"
#include "shardopt/node_group.h"
#include "tests/scale/scale_job.h"
#include "tests/testing/reference.h"
#include "tests/testing/server_process.h"

namespace shardopt::scale {
namespace {

using testing::ServerProcess;

// (nodes, local ranks per node)
class NodeGroupTest : public ::testing::TestWithParam<std::pair<uint32_t, uint32_t>> {};

// Runs fn(node, local_rank) on one thread per local rank of every node.
template <typename Fn>
void OnEveryLocalRank(uint32_t nodes, uint32_t g, const Fn& fn) {
  std::vector<std::thread> threads;
  for (uint32_t k = 0; k < nodes; ++k) {
    for (uint32_t j = 0; j < g; ++j) threads.emplace_back([&, k, j] { fn(k, j); });
  }
  for (auto& t : threads) t.join();
}

// What the servers compute for node groups: each node's fp32 sum of its
// local ranks in local-rank order, then the nodes' sums in node order.
std::vector<float> NodeReferenceMasters(const JobOptions& job, uint64_t seed, uint32_t nodes, uint32_t g,
                                        const std::vector<float>& gscales) {
  std::vector<float> out;
  for (uint32_t t = 0; t < job.tensors.size(); ++t) {
    const uint64_t numel = job.tensors[t].numel;
    testing::ReferenceTensor ref(kHyper, InitialValues(seed, t, numel), false);
    for (uint64_t step = 1; step <= gscales.size(); ++step) {
      std::vector<float> total(numel);
      for (uint32_t k = 0; k < nodes; ++k) {
        std::vector<float> node(numel, 0.f);
        for (uint32_t j = 0; j < g; ++j) {
          const auto grad = Gradient(seed, step, k * g + j, t, numel);
          for (uint64_t i = 0; i < numel; ++i) {
            const float x = math::bf16_to_float(grad[i]);
            node[i] = j == 0 ? x : node[i] + x;
          }
        }
        for (uint64_t i = 0; i < numel; ++i) total[i] = k == 0 ? node[i] : total[i] + node[i];
      }
      ref.StepAggregated(total, kLr, gscales[step - 1]);
    }
    out.insert(out.end(), ref.p.begin(), ref.p.end());
  }
  return out;
}

TEST_P(NodeGroupTest, NodesOfLocalRanksMatchTheirReferenceBitwise) {
  const auto [nodes, g] = GetParam();
  constexpr uint32_t kServers = 3;
  constexpr uint64_t kSteps = 30, kSeed = 7;
  std::vector<std::unique_ptr<ServerProcess>> servers;
  NodeGroupOptions options;
  for (uint32_t s = 0; s < kServers; ++s) {
    servers.push_back(ServerProcess::Start({"--threads=1"}));
    ASSERT_NE(servers.back(), nullptr);
    options.client.servers.push_back(servers.back()->address());
  }
  JobOptions job = MakeJob("node", nodes, 10000);
  job.grad_type = GradType::kFp32;
  const std::vector<uint64_t> offsets = FlatOffsets(job.tensors);
  const uint64_t flat = offsets.back();

  std::vector<std::vector<std::unique_ptr<Collective>>> collectives;
  for (uint32_t k = 0; k < nodes; ++k) collectives.push_back(MakeCpuCollectives(g));
  const uint32_t ranks = nodes * g;
  std::vector<std::unique_ptr<NodeGroup>> groups(ranks);
  std::vector<absl::Status> attached(ranks);
  OnEveryLocalRank(nodes, g, [&](uint32_t k, uint32_t j) {
    NodeGroupOptions mine = options;
    mine.node = k;
    auto group = NodeGroup::Create(mine, collectives[k][j].get());
    attached[k * g + j] = group.status();
    if (!group.ok()) return;
    groups[k * g + j] = *std::move(group);
    attached[k * g + j] = groups[k * g + j]->CreateOrAttach(job).status();
  });
  uint64_t owned = 0;
  for (uint32_t r = 0; r < ranks; ++r) {
    ASSERT_TRUE(attached[r].ok()) << attached[r];
    if (r < g) owned += groups[r]->owned().size();
  }
  EXPECT_EQ(owned, flat);  // one node's local ranks tile the model
  for (uint32_t t = 0; t < job.tensors.size(); ++t) {
    const auto init = InitialValues(kSeed, t, job.tensors[t].numel);
    ASSERT_TRUE(groups[0]->client().InitFp32(job.tensors[t].name, init.data()).ok());
  }

  StepOptions step_options;
  step_options.lr = kLr;
  step_options.max_grad_norm = 20;  // clipping on: every local rank must decide alike
  std::vector<std::vector<uint16_t>> params(ranks, std::vector<uint16_t>(flat));
  std::vector<std::vector<float>> gscales(ranks);
  std::vector<absl::Status> failed(ranks);
  OnEveryLocalRank(nodes, g, [&](uint32_t k, uint32_t j) {
    const uint32_t r = k * g + j;
    std::vector<uint16_t> grads(flat, 0);
    for (uint64_t step = 1; step <= kSteps; ++step) {
      for (uint32_t t = 0; t < job.tensors.size(); ++t) {
        const auto grad = Gradient(kSeed, step, r, t, job.tensors[t].numel);
        std::copy(grad.begin(), grad.end(), grads.begin() + offsets[t]);
      }
      std::fill(params[r].begin(), params[r].end(), 0xFFFF);  // poisoned
      auto result = groups[r]->Step(grads.data(), params[r].data(), step_options);
      if (!result.ok()) {
        failed[r] = result.status();
        return;
      }
      gscales[r].push_back(result->decision.gscale);
    }
  });
  for (uint32_t r = 0; r < ranks; ++r) {
    ASSERT_TRUE(failed[r].ok()) << "rank " << r << ": " << failed[r];
    EXPECT_EQ(gscales[r], gscales[0]) << "rank " << r;
  }
  EXPECT_LT(*std::min_element(gscales[0].begin(), gscales[0].end()), 1.0f / ranks);  // clipping was active

  const std::vector<float> expected = NodeReferenceMasters(job, kSeed, nodes, g, gscales[0]);
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
  // Plain aggregation of all ranks, each pushing apart: the same bits with
  // one node; with more, the nodes' partial sums associate differently.
  const std::vector<float> plain = ReferenceMasters(MakeJob("node", ranks, 10000), kSeed, gscales[0]);
  if (nodes == 1) {
    EXPECT_EQ(masters, plain);
  } else {
    EXPECT_NE(masters, plain);
  }
  for (uint32_t r = 0; r < ranks; ++r) {
    for (uint32_t t = 0; t < job.tensors.size(); ++t) {
      const auto begin = params[r].begin() + offsets[t];
      EXPECT_TRUE(std::equal(begin, begin + job.tensors[t].numel, expected_params.begin() + offsets[t]))
          << "rank " << r << " tensor " << job.tensors[t].name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, NodeGroupTest,
                         ::testing::Values(std::make_pair(1u, 1u), std::make_pair(1u, 2u), std::make_pair(1u, 4u),
                                           std::make_pair(2u, 2u)));

TEST(CpuCollective, ARankThatNeverArrivesFailsTheOthersInBoundedTime) {
  auto collectives = MakeCpuCollectives(2, std::chrono::milliseconds(200));
  double x = 1;
  const auto start = std::chrono::steady_clock::now();
  const absl::Status st = collectives[0]->AllReduceSum(&x, 1);  // rank 1 never comes
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(collectives[1]->AllReduceSum(&x, 1).code(), absl::StatusCode::kDeadlineExceeded);  // stays failed
}

// One server and a node of one local rank.
struct LoneNode {
  LoneNode() : server(ServerProcess::Start({"--threads=1"})), collectives(MakeCpuCollectives(1)) {
    if (server == nullptr) return;
    NodeGroupOptions options;
    options.client.servers = {server->address()};
    group = NodeGroup::Create(options, collectives[0].get()).value();
  }
  std::unique_ptr<ServerProcess> server;
  std::vector<std::unique_ptr<Collective>> collectives;
  std::unique_ptr<NodeGroup> group;
};

// Each group's lr reaches the servers, as with a plain Client: a group at lr
// 0 keeps its masters (AdamW's whole update, decay included, is scaled by lr)
// while the other moves.
TEST(NodeGroup, EachGroupStepsAtItsOwnLr) {
  LoneNode node;
  ASSERT_NE(node.group, nullptr);
  NodeGroup* group = node.group.get();
  JobOptions job = MakeJob("lrs", 1, 10000);
  job.grad_type = GradType::kFp32;
  job.groups.push_back(job.groups[0]);
  job.groups.back().name = "frozen";
  job.tensors.back().group = 1;
  ASSERT_TRUE(group->CreateOrAttach(job).ok());
  const std::vector<uint64_t> offsets = FlatOffsets(job.tensors);
  std::vector<std::vector<float>> init(job.tensors.size());
  for (uint32_t t = 0; t < job.tensors.size(); ++t) {
    init[t] = InitialValues(3, t, job.tensors[t].numel);
    ASSERT_TRUE(group->client().InitFp32(job.tensors[t].name, init[t].data()).ok());
  }
  std::vector<uint16_t> grads(offsets.back(), 0);
  for (uint32_t t = 0; t < job.tensors.size(); ++t) {
    const auto g = Gradient(3, 1, 0, t, job.tensors[t].numel);
    std::copy(g.begin(), g.end(), grads.begin() + offsets[t]);
  }
  std::vector<uint16_t> params(offsets.back(), 0xFFFF);
  StepOptions step;
  step.lr = kLr;
  step.group_lr = {kLr, 0.0};
  ASSERT_TRUE(group->Step(grads.data(), params.data(), step).ok());
  for (uint32_t t = 0; t < job.tensors.size(); ++t) {
    std::vector<float> m(job.tensors[t].numel);
    ASSERT_TRUE(group->client().Read(job.tensors[t].name, StateToRead::kMaster, 0, m.size(), m.data()).ok());
    if (job.tensors[t].group == 1) {
      EXPECT_EQ(m, init[t]) << job.tensors[t].name;
    } else {
      EXPECT_NE(m, init[t]) << job.tensors[t].name;
    }
  }
}

TEST(NodeGroup, RefusesBf16GradientsWithAClearError) {
  LoneNode node;
  ASSERT_NE(node.group, nullptr);
  auto st = node.group->CreateOrAttach(MakeJob("bf16", 1, 1000));
  EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardopt::scale
