// Node groups over the CPU collective (threads) against real server
// processes: G = 1, 2 and 4 local ranks of one node, and two nodes of 2.
#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/adamw_math.h"
#include "shardopt/node_group.h"
#include "tests/scale/scale_job.h"
#include "tests/testing/reference.h"
#include "tests/testing/server_process.h"

namespace shardopt::scale {
namespace {

using testing::ServerProcess;
using ::testing::HasSubstr;

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
  // Plain variables, not a structured binding, which C++17 lambdas may not capture (clang refuses).
  const uint32_t nodes = GetParam().first, g = GetParam().second;
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

// Two local ranks of one node over `servers` servers, their collectives
// failing a rank that does not come within 5 s (a test that hangs fails).
struct TwoLocalRanks {
  // `tweak`: a local rank's options made to differ from the other's.
  explicit TwoLocalRanks(uint32_t servers, const std::vector<std::string>& flags = {}, uint64_t checkpoint_every = 0,
                         const std::function<void(uint32_t, NodeGroupOptions&)>& tweak = nullptr)
      : collectives(MakeCpuCollectives(2, std::chrono::seconds(5))) {
    NodeGroupOptions options;
    options.client.checkpoint_every = checkpoint_every;
    for (uint32_t s = 0; s < servers; ++s) {
      std::vector<std::string> args = {"--threads=1"};
      args.insert(args.end(), flags.begin(), flags.end());
      processes.push_back(ServerProcess::Start(args));
      if (processes.back() == nullptr) return;
      options.client.servers.push_back(processes.back()->address());
    }
    for (uint32_t j = 0; j < 2; ++j) {
      NodeGroupOptions mine = options;
      if (tweak) tweak(j, mine);
      auto group = NodeGroup::Create(mine, collectives[j].get());
      EXPECT_TRUE(group.ok()) << group.status();
      if (!group.ok()) return;
      groups.push_back(*std::move(group));
    }
  }
  bool ok() const { return groups.size() == 2; }
  // fn(local rank) on a thread each; their results.
  template <typename Fn>
  auto OnBoth(const Fn& fn) {
    std::vector<decltype(fn(0u))> out(2);
    std::thread one([&] { out[1] = fn(1u); });
    out[0] = fn(0u);
    one.join();
    return out;
  }
  std::vector<std::unique_ptr<ServerProcess>> processes;
  std::vector<std::unique_ptr<Collective>> collectives;
  std::vector<std::unique_ptr<NodeGroup>> groups;
};

// Whether the local ranks made job `name` (world_size 2) on the servers: a
// job of world_size 1 under the name is then ALREADY_EXISTS.
bool JobMade(const TwoLocalRanks& node, const std::string& name) {
  ClientOptions plain;
  for (const auto& server : node.processes) plain.servers.push_back(server->address());
  auto client = Client::Connect(plain);
  return client.ok() && absl::IsAlreadyExists((*client)->CreateOrAttach(MakeJob(name, 1, 10000)).status());
}

JobOptions Fp32GradJob(const std::string& name) {
  JobOptions job = MakeJob(name, 1, 10000);
  job.grad_type = GradType::kFp32;
  return job;
}

// Local rank r's gradients of `step`, drawn from `seed`, as one flat buffer.
std::vector<uint16_t> FlatGradients(const JobOptions& job, uint64_t seed, uint64_t step, uint32_t r) {
  const std::vector<uint64_t> offsets = FlatOffsets(job.tensors);
  std::vector<uint16_t> flat(offsets.back(), 0);
  for (uint32_t t = 0; t < job.tensors.size(); ++t) {
    const auto g = Gradient(seed, step, r, t, job.tensors[t].numel);
    std::copy(g.begin(), g.end(), flat.begin() + offsets[t]);
  }
  return flat;
}

// A Step refused on one local rank for its own arguments, or with options
// that differ between the local ranks, is refused on both before anything is
// sent: then a Step with other gradients applies those. (Before, the other
// local rank pushed and committed: its servers applied the step, the
// refused rank's did not, and the next Step's new gradients were answered
// as a retry of the old push on the servers that held it.)
TEST(NodeGroup, ArgumentsRefusedOnOneLocalRankOrDifferingBetweenThemAreRefusedOnBothBeforeAnythingIsSent) {
  TwoLocalRanks node(2);
  ASSERT_TRUE(node.ok());
  const JobOptions job = Fp32GradJob("args");
  for (const auto& st : node.OnBoth([&](uint32_t j) { return node.groups[j]->CreateOrAttach(job).status(); })) {
    ASSERT_TRUE(st.ok()) << st;
  }
  for (uint32_t t = 0; t < job.tensors.size(); ++t) {
    const auto init = InitialValues(5, t, job.tensors[t].numel);
    ASSERT_TRUE(node.groups[0]->client().InitFp32(job.tensors[t].name, init.data()).ok());
  }
  const uint64_t flat = FlatOffsets(job.tensors).back();
  std::vector<std::vector<uint16_t>> params(2, std::vector<uint16_t>(flat, 0xFFFF));
  const auto step_with = [&](uint64_t seed, const std::function<StepOptions(uint32_t)>& options,
                             bool null_params_on_1 = false) {
    return node.OnBoth([&](uint32_t j) {
      const auto grads = FlatGradients(job, seed, node.groups[j]->step() + 1, j);
      uint16_t* out = null_params_on_1 && j == 1 ? nullptr : params[j].data();
      return node.groups[j]->Step(grads.data(), out, options(j)).status();
    });
  };
  StepOptions good;
  good.lr = kLr;
  struct Case {
    const char* what;
    std::function<StepOptions(uint32_t)> options;
    bool null_params = false;
    absl::StatusCode rank0, rank1;
    const char* says;  // in rank 1's message
  };
  const auto on_1 = [&](const std::function<void(StepOptions&)>& change) {
    return [=](uint32_t j) {
      StepOptions o = good;
      if (j == 1) change(o);
      return o;
    };
  };
  const Case cases[] = {
      {"NaN lr on rank 1", on_1([](StepOptions& o) { o.lr = NAN; }), false, absl::StatusCode::kAborted,
       absl::StatusCode::kInvalidArgument, "lr must be finite"},
      {"a group_lr of the wrong size on rank 1", on_1([](StepOptions& o) { o.group_lr = {kLr, kLr}; }), false,
       absl::StatusCode::kAborted, absl::StatusCode::kInvalidArgument, "group_lr has 2 entries"},
      {"loss_scale 0 on both", [&](uint32_t) { StepOptions o = good; o.loss_scale = 0; return o; }, false,
       absl::StatusCode::kInvalidArgument, absl::StatusCode::kInvalidArgument, "loss_scale"},
      {"max_grad_norm -1 on both", [&](uint32_t) { StepOptions o = good; o.max_grad_norm = -1; return o; }, false,
       absl::StatusCode::kInvalidArgument, absl::StatusCode::kInvalidArgument, "max_grad_norm"},
      {"another lr on rank 1", on_1([](StepOptions& o) { o.lr = 2 * kLr; }), false,
       absl::StatusCode::kInvalidArgument, absl::StatusCode::kInvalidArgument, "were given different StepOptions"},
      {"no params buffer on rank 1", [&](uint32_t) { return good; }, true, absl::StatusCode::kAborted,
       absl::StatusCode::kInvalidArgument, "flat_params"},
  };
  std::vector<float> gscales;  // each step's, as every local rank decided it
  const auto first = node.OnBoth([&](uint32_t j) -> absl::StatusOr<StepResult> {
    const auto grads = FlatGradients(job, 5, 1, j);
    return node.groups[j]->Step(grads.data(), params[j].data(), good);
  });
  ASSERT_TRUE(first[0].ok() && first[1].ok()) << first[0].status() << " / " << first[1].status();
  gscales.push_back(first[0]->decision.gscale);
  for (const Case& c : cases) {
    const auto refused = step_with(99, c.options, c.null_params);  // gradients the servers must never see
    EXPECT_EQ(refused[0].code(), c.rank0) << c.what << ": " << refused[0];
    EXPECT_EQ(refused[1].code(), c.rank1) << c.what << ": " << refused[1];
    EXPECT_THAT(std::string(refused[1].message()), HasSubstr(c.says)) << c.what;
  }
  for (uint32_t j = 0; j < 2; ++j) EXPECT_EQ(node.groups[j]->step(), 1u);
  const auto second = node.OnBoth([&](uint32_t j) -> absl::StatusOr<StepResult> {
    const auto grads = FlatGradients(job, 5, 2, j);
    return node.groups[j]->Step(grads.data(), params[j].data(), good);
  });
  ASSERT_TRUE(second[0].ok() && second[1].ok()) << second[0].status() << " / " << second[1].status();
  gscales.push_back(second[0]->decision.gscale);
  std::vector<float> masters;
  for (const TensorOptions& t : job.tensors) {
    std::vector<float> m(t.numel);
    ASSERT_TRUE(node.groups[0]->client().Read(t.name, StateToRead::kMaster, 0, m.size(), m.data()).ok());
    masters.insert(masters.end(), m.begin(), m.end());
  }
  EXPECT_EQ(masters, ReferenceMasters(MakeJob("args", 2, 10000), 5, gscales));
}

// A CreateOrAttach refused on one local rank is refused on the other too
// (ABORTED), at once: before, the other attached and its first Step waited
// in the collective for the whole timeout (11 minutes by default). So is a
// job with fp32 params, whose params the bf16 flat buffer cannot take
// (before, the commit wrote them past its end).
TEST(NodeGroup, ACreateOrAttachRefusedOnOneLocalRankIsRefusedOnBothAtOnce) {
  TwoLocalRanks node(2);
  ASSERT_TRUE(node.ok());
  EXPECT_EQ(node.groups[0]->owned().size(), 0u);  // nothing yet, and no read past the ranges
  const JobOptions job = Fp32GradJob("attach");
  // Local rank 1 asks for larger messages than the servers take: its attach
  // is refused once they have answered (INVALID_ARGUMENT), local rank 0's
  // is not. (A client option: the local ranks' JobOptions are the same.)
  TwoLocalRanks refused(2, {}, 0, [](uint32_t j, NodeGroupOptions& o) {
    if (j == 1) o.client.chunk_bytes = uint64_t{64} << 20;
  });
  ASSERT_TRUE(refused.ok());
  const auto began = std::chrono::steady_clock::now();
  const auto attached = refused.OnBoth([&](uint32_t j) { return refused.groups[j]->CreateOrAttach(job).status(); });
  EXPECT_EQ(attached[0].code(), absl::StatusCode::kAborted) << attached[0];
  EXPECT_EQ(attached[1].code(), absl::StatusCode::kInvalidArgument) << attached[1];
  EXPECT_THAT(std::string(attached[1].message()), HasSubstr("ClientOptions::chunk_bytes"));
  const std::vector<uint16_t> grads(FlatOffsets(job.tensors).back(), 0);
  std::vector<uint16_t> params(grads.size());
  for (const auto& st : refused.OnBoth([&](uint32_t j) {
         return refused.groups[j]->Step(grads.data(), params.data(), StepOptions{}).status();
       })) {
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - began, std::chrono::seconds(4));

  // Local ranks given other nodes, or another checkpoint_every, would call
  // the collectives apart: refused before anything is sent.
  for (const auto& tweak : std::vector<std::function<void(uint32_t, NodeGroupOptions&)>>{
           [](uint32_t j, NodeGroupOptions& o) { o.node = j; },
           [](uint32_t j, NodeGroupOptions& o) { o.client.checkpoint_every = j; }}) {
    TwoLocalRanks apart(1, {}, 0, tweak);
    ASSERT_TRUE(apart.ok());
    const JobOptions two_nodes = [&] {
      JobOptions j = Fp32GradJob("apart");
      j.world_size = 2;
      return j;
    }();
    for (const auto& st : apart.OnBoth([&](uint32_t j) { return apart.groups[j]->CreateOrAttach(two_nodes).status(); })) {
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_THAT(std::string(st.message()), HasSubstr("were given different node, servers, checkpoint_every"));
    }
    EXPECT_FALSE(JobMade(apart, "apart"));
  }
  // So are local ranks given other JobOptions, whatever differs: before,
  // only the name, world_size and total size were compared, and local ranks
  // of other restore_steps each restored their own servers' part (an
  // outside probe's job came out torn, or rewound, from run to run).
  // Each under a name of its own and of world_size 2, so that JobMade's
  // world_size-1 job of the name is ALREADY_EXISTS if the group made it.
  const std::vector<std::function<void(JobOptions&)>> tweaks = {
      [](JobOptions& j) { j.restore_step = 2; },
      [](JobOptions& j) { j.resume = Resume::kOnly; },
      [](JobOptions& j) { j.barrier_timeout_ms += 1; },
      [](JobOptions& j) { j.groups[0].weight_decay += 0.5f; },
      [](JobOptions& j) { j.tensors[0].shape = {j.tensors[0].numel}; }};
  for (size_t i = 0; i < tweaks.size(); ++i) {
    SCOPED_TRACE(i);
    const std::string name = absl::StrCat("unlike-", i);
    for (const auto& st : node.OnBoth([&](uint32_t j) {
           JobOptions mine = Fp32GradJob(name);
           mine.world_size = 2;
           if (j == 1) tweaks[i](mine);
           return node.groups[j]->CreateOrAttach(mine).status();
         })) {
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_THAT(std::string(st.message()), HasSubstr("were given different node, servers, checkpoint_every or JobOptions"));
    }
    EXPECT_FALSE(JobMade(node, name));
  }

  JobOptions fp32_params = Fp32GradJob("fp32-params");
  fp32_params.tensors[0].param_type = ParamType::kFp32;
  for (const auto& st : node.OnBoth([&](uint32_t j) { return node.groups[j]->CreateOrAttach(fp32_params).status(); })) {
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr("fp32 params"));
  }
}

// Nodes of different G cannot step one job: each averages over world_size
// times its own G, and the servers applied the first commit's gscale (a
// probe's nodes of 2 and 4 local ranks: 1/4 applied where the 6 ranks'
// average needs 1/6). A node of another G is refused at its attach, before
// any step; a node of the same G attaches.
TEST(NodeGroup, ANodeOfAnotherNumberOfLocalRanksIsRefusedAtItsAttach) {
  TwoLocalRanks node(2);
  ASSERT_TRUE(node.ok());
  JobOptions job = Fp32GradJob("nodes");
  job.world_size = 2;
  for (const auto& st : node.OnBoth([&](uint32_t j) { return node.groups[j]->CreateOrAttach(job).status(); })) {
    ASSERT_TRUE(st.ok()) << st;
  }
  NodeGroupOptions second;
  second.node = 1;
  for (const auto& server : node.processes) second.client.servers.push_back(server->address());
  const auto one = MakeCpuCollectives(1, std::chrono::seconds(5));
  auto lone = NodeGroup::Create(second, one[0].get());
  ASSERT_TRUE(lone.ok()) << lone.status();
  const auto refused = (*lone)->CreateOrAttach(job);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAlreadyExists) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("same number of local ranks"));
  // A count given that is not the group's own is refused before anything is sent.
  JobOptions says_two = job;
  says_two.trainers_per_rank = 2;
  const auto mismatched = (*lone)->CreateOrAttach(says_two);
  EXPECT_EQ(mismatched.status().code(), absl::StatusCode::kInvalidArgument) << mismatched.status();
  EXPECT_THAT(std::string(mismatched.status().message()), HasSubstr("this node group has 1 local ranks"));

  const auto two = MakeCpuCollectives(2, std::chrono::seconds(5));
  std::vector<std::unique_ptr<NodeGroup>> pair;
  for (uint32_t j = 0; j < 2; ++j) pair.push_back(NodeGroup::Create(second, two[j].get()).value());
  std::vector<absl::Status> attached(2);
  std::thread other([&] { attached[1] = pair[1]->CreateOrAttach(job).status(); });
  attached[0] = pair[0]->CreateOrAttach(job).status();
  other.join();
  for (const absl::Status& st : attached) EXPECT_TRUE(st.ok()) << st;
}

// checkpoint_every is the group's: after steps 1 and 2, two complete
// checkpoints, written by the local rank that pushes (with one server, local
// rank 0 pushes nothing, and its client stays at step 0). Before, node
// groups ignored it.
TEST(NodeGroup, CheckpointEveryIsWrittenByTheLocalRankThatPushes) {
  char dir_template[] = "/tmp/shardopt-node-ckpt-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  const absl::Cleanup removed = [&] { std::filesystem::remove_all(dir); };  // also when an ASSERT returns
  {
    TwoLocalRanks node(1, {"--checkpoint_dir=" + dir}, /*checkpoint_every=*/1);
    ASSERT_TRUE(node.ok());
    const JobOptions job = Fp32GradJob("every");
    for (const auto& st : node.OnBoth([&](uint32_t j) { return node.groups[j]->CreateOrAttach(job).status(); })) {
      ASSERT_TRUE(st.ok()) << st;
    }
    EXPECT_EQ(node.groups[0]->owned().size(), 0u);
    for (uint32_t t = 0; t < job.tensors.size(); ++t) {
      const auto init = InitialValues(5, t, job.tensors[t].numel);
      ASSERT_TRUE(node.groups[0]->client().InitFp32(job.tensors[t].name, init.data()).ok());
    }
    for (uint64_t step = 1; step <= 2; ++step) {
      for (const auto& st : node.OnBoth([&](uint32_t j) {
             const auto grads = FlatGradients(job, 5, step, j);
             std::vector<uint16_t> params(grads.size());
             return node.groups[j]->Step(grads.data(), params.data(), StepOptions{}).status();
           })) {
        ASSERT_TRUE(st.ok()) << st;
      }
    }
    EXPECT_EQ(node.groups[0]->step(), 2u);
    EXPECT_EQ(node.groups[0]->client().step(), 0u);
    for (const auto& st : node.OnBoth([&](uint32_t j) { return node.groups[j]->Checkpoint(); })) {
      EXPECT_TRUE(st.ok()) << st;  // step 2 again: written already
    }
  }
  int complete = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) complete += e.path().filename() == "COMMIT";
  EXPECT_EQ(complete, 2);
}

TEST(NodeGroup, RefusesBf16GradientsWithAClearError) {
  LoneNode node;
  ASSERT_NE(node.group, nullptr);
  auto st = node.group->CreateOrAttach(MakeJob("bf16", 1, 1000));
  EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardopt::scale
