// The step protocol core, without a network: aggregation, barrier, retries,
// skips, per-tensor steps, idempotent commits, and every refusal leaving the
// state as it was.
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "checkpoint/directory_id.h"
#include "checkpoint/format.h"
#include "checkpoint/job_directory.h"
#include "gtest/gtest.h"
#include "server/metrics.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/job.h"
#include "server/job_store.h"
#include "server/messages.h"
#include "server/step_intents.h"
#include "rpc/job_limits.h"
#include "tests/testing/reference.h"
#include "tests/testing/checkpoint_dir_fixture.h"
#include "tests/testing/store_fixture.h"
#include "tests/testing/wrapped_cpu_backend.h"

namespace shardopt {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::CheckpointDirTest;
using testing::RandomBf16;
using testing::RandomFloats;
using testing::ReferenceTensor;

constexpr AdamWHyper kHyper = testing::kDefaultHyper;
using testing::StoreTest;
using testing::TensorDef;

TEST_F(StoreTest, AggregationIsIndependentOfRankAndChunkOrder) {
  const std::vector<TensorDef> tensors = {{"w", 9001}, {"b", 77}};
  constexpr uint32_t kWorld = 3;
  constexpr int kSteps = 4;
  std::vector<std::vector<std::map<std::string, std::vector<uint16_t>>>> grads(kSteps);  // [step][rank]
  for (auto& step : grads) {
    for (uint32_t r = 0; r < kWorld; ++r) {
      std::map<std::string, std::vector<uint16_t>> g;
      for (const auto& t : tensors) g[t.name] = RandomBf16(rng_, t.numel, 1.0f);
      step.push_back(std::move(g));
    }
  }
  std::vector<std::vector<float>> finals;
  std::map<std::string, std::vector<float>> init;
  for (uint64_t variant = 0; variant < 3; ++variant) {
    const std::string job = "order" + std::to_string(variant);
    auto this_init = Create(JobRequest(job, kWorld, tensors));
    for (auto& [name, values] : this_init) {  // same start for every variant
      if (variant == 0) init[name] = values;
      v1::InitChunk c;
      c.set_job(job);
      c.set_tensor(name);
      c.set_dtype(v1::FP32);
      c.set_data(init[name].data(), init[name].size() * 4);
      ASSERT_TRUE(store_.Init(c).ok());
    }
    for (int t = 0; t < kSteps; ++t) {
      std::vector<uint32_t> ranks = {0, 1, 2};
      std::shuffle(ranks.begin(), ranks.end(), std::mt19937_64(variant * 10 + t));
      std::vector<std::thread> threads;
      std::vector<absl::Status> results(kWorld);
      for (uint32_t r : ranks) {
        threads.emplace_back([&, r] {
          auto resp = Push(job, t + 1, r, grads[t][r], /*chunk=*/300 + 700 * variant, /*order=*/variant * 31 + r);
          results[r] = resp.status();
        });
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      for (auto& th : threads) th.join();
      for (const auto& st : results) ASSERT_TRUE(st.ok()) << st;
      ASSERT_TRUE(Commit(job, t + 1, 1e-2).ok());
    }
    std::vector<float> all;
    for (const auto& t : tensors) {
      for (v1::StateKind k : {v1::MASTER, v1::EXP_AVG, v1::EXP_AVG_SQ}) {
        auto v = ReadFloats(job, t.name, k);
        all.insert(all.end(), v.begin(), v.end());
      }
    }
    finals.push_back(std::move(all));
  }
  EXPECT_EQ(finals[0], finals[1]);
  EXPECT_EQ(finals[0], finals[2]);
  // And the sum is in rank order, as the scalar reference does it.
  for (const auto& t : tensors) {
    ReferenceTensor ref(kHyper, init[t.name], false);
    for (int s = 0; s < kSteps; ++s) {
      ref.Step({grads[s][0][t.name].data(), grads[s][1][t.name].data(), grads[s][2][t.name].data()}, 1e-2, 1.0f);
    }
    EXPECT_EQ(ReadFloats("order0", t.name, v1::MASTER), ref.p) << t.name;
  }
}

TEST_F(StoreTest, RetriedChunksAndPushesCountOnce) {
  auto init = Create(JobRequest("retry", 1, {{"w", 5000}}));
  auto g = RandomBf16(rng_, 5000, 1.0f);
  // Every chunk twice in one stream, then the whole push again.
  auto session = StartPush("retry", 1, 0);
  ASSERT_TRUE(session.ok());
  for (int rep = 0; rep < 2; ++rep) {
    for (uint64_t off = 0; off < 5000; off += 999) {
      ASSERT_TRUE((*session)->Add(Chunk("w", off, g.data() + off, std::min<uint64_t>(999, 5000 - off))).ok());
    }
  }
  auto first = (*session)->Finish();
  ASSERT_TRUE(first.ok());
  auto again = Push("retry", 1, 0, {{"w", g}}, 2500);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->sum_squares(), first->sum_squares());
  auto params = Commit("retry", 1, 1e-3);
  ASSERT_TRUE(params.ok());
  // A push retried after the commit answers the same and changes nothing.
  auto late = Push("retry", 1, 0, {{"w", g}});
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(late->sum_squares(), first->sum_squares());
  ReferenceTensor ref(kHyper, init["w"], false);
  ref.Step({g.data()}, 1e-3, 1.0f);
  EXPECT_EQ(ReadFloats("retry", "w", v1::MASTER), ref.p);
  EXPECT_EQ((*params)["w"], ref.Params());
}

TEST_F(StoreTest, CommitIsIdempotentAndRefusesDifferentArguments) {
  Create(JobRequest("idem", 1, {{"w", 3000}}));
  auto g = RandomBf16(rng_, 3000, 1.0f);
  ASSERT_TRUE(Push("idem", 1, 0, {{"w", g}}).ok());
  auto first = Commit("idem", 1, 1e-3, 0.5f);
  ASSERT_TRUE(first.ok());
  const std::string before = Snapshot("idem");
  auto second = Commit("idem", 1, 1e-3, 0.5f);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(*first, *second);
  EXPECT_EQ(Snapshot("idem"), before);
  auto differs = Commit("idem", 1, 2e-3, 0.5f);
  EXPECT_EQ(differs.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(differs.status().message()), HasSubstr("ranks disagree"));
  // The difference, named with every bit of its numbers: six digits made
  // these two lrs, and two gscales, read the same.
  EXPECT_THAT(std::string(differs.status().message()), HasSubstr("(lr: 0.001 -> 0.002)"));
  auto ulp = Commit("idem", 1, std::nextafter(1e-3, 1.0), 0.5f);
  EXPECT_EQ(ulp.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(ulp.status().message()), HasSubstr("(lr: 0.001 -> 0.0010000000000000002)"));
  auto gscale = Commit("idem", 1, 1e-3, std::nextafter(0.5f, 1.0f));
  EXPECT_EQ(gscale.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(gscale.status().message()), HasSubstr("(gscale: 0.5 -> 0.50000006)"));
  auto skip = Commit("idem", 1, 1e-3, 0.5f, true);
  EXPECT_EQ(skip.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(skip.status().message()), HasSubstr("(applied -> skipped)"));
  EXPECT_EQ(Snapshot("idem"), before);
}

// Ranks that push a step meaning to commit it differently (here with other
// lrs) had each commit applied by whichever servers it reached first, the
// step torn across servers for good. Now a commit that applies it is
// refused while their latest pushes disagree, and applies nothing; a rank
// that pushes the step again says its settings anew.
TEST_F(StoreTest, ACommitOfAStepWhoseRanksMeantToApplyItDifferentlyIsRefusedAndAppliesNothing) {
  Create(JobRequest("intent", 2, {{"w", 3000}}));
  const std::vector<uint16_t> g = RandomBf16(rng_, 3000, 1.0f);
  v1::StepIntent meant;
  meant.set_lr(1e-2);
  meant.set_loss_scale(1);
  v1::StepIntent other = meant;
  other.set_lr(2e-2);
  std::vector<absl::Status> pushed(2);
  {
    std::thread rank1([&] { pushed[1] = Push("intent", 1, 1, {{"w", g}}, 1000, 0, {}, 0, &other).status(); });
    pushed[0] = Push("intent", 1, 0, {{"w", g}}, 1000, 0, {}, 0, &meant).status();
    rank1.join();
  }
  ASSERT_TRUE(pushed[0].ok() && pushed[1].ok()) << pushed[0] << pushed[1];
  const std::string before = Snapshot("intent");
  for (double lr : {1e-2, 2e-2}) {
    auto refused = Commit("intent", 1, lr);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
    EXPECT_THAT(std::string(refused.status().message()),
                HasSubstr("pushed step 1 to be applied differently (rank 0 pushed it with lr 0.01, rank 1 with lr "
                          "0.02); nothing was applied"));
  }
  EXPECT_EQ(Snapshot("intent"), before);
  ASSERT_TRUE(Push("intent", 1, 1, {{"w", g}}, 1000, 0, {}, 0, &meant).ok());
  ASSERT_TRUE(Commit("intent", 1, 1e-2).ok());
  EXPECT_NE(Snapshot("intent"), before);
}

TEST(StepIntentsTest, TheFirstDifferenceNamesBothRanksAndOnlyThatStepsPushesCount) {
  StepIntents intents(3);
  v1::StepIntent a;
  a.set_lr(1e-3);
  a.add_group_lr(1e-3);
  a.add_group_lr(2e-3);
  a.set_max_grad_norm(1.0);
  a.set_loss_scale(1.0);
  intents.Note(0, 5, &a);
  intents.Note(2, 5, &a);
  v1::StepIntent b = a;
  b.set_lr(7.0);
  intents.Note(1, 4, &b);  // a push of another step
  EXPECT_EQ(intents.Disagreement(5), "");
  b = a;
  b.set_group_lr(1, std::nextafter(2e-3, 0.0));
  intents.Note(2, 5, &b);
  EXPECT_EQ(intents.Disagreement(5),
            "rank 0 pushed it with group lrs [0.001, 0.002], rank 2 with group lrs [0.001, 0.0019999999999999996]");
  b = a;
  b.set_max_grad_norm(0.0);
  intents.Note(2, 5, &b);
  EXPECT_EQ(intents.Disagreement(5), "rank 0 pushed it with max_grad_norm 1, rank 2 with max_grad_norm 0");
  b = a;
  b.set_loss_scale(1024);
  intents.Note(2, 5, &b);
  EXPECT_EQ(intents.Disagreement(5), "rank 0 pushed it with loss_scale 1, rank 2 with loss_scale 1024");
  intents.Note(2, 5, nullptr);  // a push that said none: not compared
  EXPECT_EQ(intents.Disagreement(5), "");
  intents.Note(2, 5, &a);
  EXPECT_EQ(intents.Disagreement(5), "");
}

// Group lrs are told apart by group, as lr is.
TEST(CommitArgsTest, TheFirstDifferenceNamesTheGroupWhoseLrDiffers) {
  const CommitArgs applied{1e-3, 1.0f, false, {1e-3, 2e-3}};
  CommitArgs asked = applied;
  EXPECT_EQ(applied.FirstDifference(asked), "");
  asked.group_lr[1] = std::nextafter(2e-3, 0.0);
  EXPECT_EQ(applied.FirstDifference(asked), "group 1's lr: 0.002 -> 0.0019999999999999996");
  asked.group_lr.pop_back();
  EXPECT_EQ(applied.FirstDifference(asked), "number of group lrs: 2 -> 1");
}

// A commit refused while another commit of the same step is applying it
// piece by piece (the ranks disagree) applies nothing: the step is left to
// the commit that began it, whose stream completes it. (The refused one
// once tried to finish the step itself, with none of its scalars.)
class PiecewiseStoreTest : public StoreTest {
 protected:
  PiecewiseStoreTest() : StoreTest(Options()) {}
  static JobStoreOptions Options() {
    JobStoreOptions o;
    o.stream_chunk_elements = kApplyAlignment;  // several pieces per tensor
    return o;
  }
};

TEST_F(PiecewiseStoreTest, ACommitRefusedWhileTheStepIsMidApplyLeavesItToItsCommitter) {
  auto init = Create(JobRequest("mid", 1, {{"w", 4 * kApplyAlignment + 3}}));
  const auto g = RandomBf16(rng_, 4 * kApplyAlignment + 3, 1.0f);
  ASSERT_TRUE(Push("mid", 1, 0, {{"w", g}}).ok());
  const v1::CommitRequest request = CommitRequestFor("mid", 1, 1e-2);
  auto first = store_.OpenCommit(request);
  ASSERT_TRUE(first.ok()) << first.status();
  auto piece = (*first)->Next();
  ASSERT_TRUE(piece.ok() && piece->has_value()) << piece.status();

  v1::CommitRequest other = request;
  other.set_lr(2e-2);
  auto refused = store_.OpenCommit(other);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAborted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("ranks disagree"));

  for (int pieces = 1;; ++pieces) {
    piece = (*first)->Next();
    ASSERT_TRUE(piece.ok()) << piece.status();
    if (!piece->has_value()) {
      EXPECT_EQ(pieces, 5);
      break;
    }
  }
  ReferenceTensor ref(kHyper, init["w"], false);
  ref.Step({g.data()}, 1e-2, 1.0f);
  EXPECT_EQ(ReadFloats("mid", "w", v1::MASTER), ref.p);
  EXPECT_EQ(store_.Describe("mid")->step(), 1u);
}

// Commits apply the update piece by piece while streaming; several ranks'
// commits, and a committer that goes away, still get one whole step.
TEST(PipelinedCommit, PiecesRanksAndADepartingCommitterGiveOneWholeStep) {
  auto backend = MakeCpuBackend({2, cpu::BestIsa()});
  JobStoreOptions options;
  options.stream_chunk_elements = kApplyAlignment;  // several pieces per tensor
  JobStore store(backend.get(), options);
  v1::CreateJobRequest r;
  r.set_job("pieces");
  r.set_world_size(2);
  v1::Group* g = r.add_groups();
  g->set_beta1(kHyper.beta1);
  g->set_beta2(kHyper.beta2);
  g->set_eps(kHyper.eps);
  g->set_weight_decay(kHyper.weight_decay);
  const std::vector<TensorDef> tensors = {{"a", 3 * kApplyAlignment + 5}, {"b", 1000}};
  for (const auto& t : tensors) {
    auto* spec = r.add_tensors();
    spec->set_name(t.name);
    spec->set_numel(t.numel);
  }
  ASSERT_TRUE(store.CreateJob(r).ok());
  std::mt19937_64 rng(77);
  std::map<std::string, ReferenceTensor> refs;
  for (const auto& t : tensors) {
    auto init = RandomFloats(rng, t.numel, -1, 1);
    v1::InitChunk c;
    c.set_job("pieces");
    c.set_tensor(t.name);
    c.set_dtype(v1::FP32);
    c.set_data(init.data(), init.size() * 4);
    ASSERT_TRUE(store.Init(c).ok());
    refs.emplace(t.name, ReferenceTensor(kHyper, init, false));
  }
  auto commit = [&](uint64_t step, size_t stop_after, std::map<std::string, std::vector<uint16_t>>* params) {
    v1::CommitRequest req;
    req.set_job("pieces");
    req.set_step(step);
    req.set_lr(1e-2);
    req.set_gscale(0.5f);
    size_t chunks = 0;
    return store.Commit(req, [&](const v1::ParamChunk& c) {
      auto& p = (*params)[c.tensor()];
      p.resize(std::max<size_t>(p.size(), c.offset() + c.data().size() / 2));
      std::memcpy(p.data() + c.offset(), c.data().data(), c.data().size());
      return ++chunks < stop_after;
    });
  };
  for (uint64_t step = 1; step <= 3; ++step) {
    std::vector<std::map<std::string, std::vector<uint16_t>>> grads(2);
    for (auto& rank : grads) {
      for (const auto& t : tensors) rank[t.name] = RandomBf16(rng, t.numel, 1.0f);
    }
    std::vector<std::thread> pushers;
    for (uint32_t rank : {1u, 0u}) {
      pushers.emplace_back([&, rank] {
        v1::GradChunk head;
        head.set_job("pieces");
        head.set_step(step);
        head.set_rank(rank);
        auto session = store.BeginPush(head);
        ASSERT_TRUE(session.ok());
        for (const auto& [name, data] : grads[rank]) {
          v1::GradChunk c;
          c.set_tensor(name);
          c.set_dtype(v1::BF16);
          c.set_data(data.data(), data.size() * 2);
          ASSERT_TRUE((*session)->Add(c).ok());
        }
        EXPECT_TRUE((*session)->Finish().ok());
      });
    }
    for (auto& p : pushers) p.join();
    // Steps 1 and 3: two ranks commit at once. Step 2: the only committer
    // leaves after one piece, and the step completes anyway, before anyone
    // else asks for it.
    std::map<std::string, std::vector<uint16_t>> p0, p1, p2;
    absl::Status s0, s1;
    if (step == 2) {
      s1 = commit(step, 1, &p1);
      EXPECT_EQ(store.Describe("pieces")->step(), step);
      s0 = commit(step, 1000, &p0);
    } else {
      std::thread other([&] { s1 = commit(step, 1000, &p1); });
      s0 = commit(step, 1000, &p0);
      other.join();
    }
    for (const auto& t : tensors) {
      refs.at(t.name).Step({grads[0][t.name].data(), grads[1][t.name].data()}, 1e-2, 0.5f);
    }
    ASSERT_TRUE(commit(step, 1000, &p2).ok());  // a late retry streams the finished step
    for (const auto& t : tensors) {
      EXPECT_EQ(p2[t.name], refs.at(t.name).Params()) << t.name << " step " << step;
      if (s0.ok()) {
        EXPECT_EQ(p0[t.name], p2[t.name]);
      }
      if (s1.ok()) {
        EXPECT_EQ(p1[t.name], p2[t.name]);
      }
    }
    if (step != 2) {
      EXPECT_TRUE(s0.ok() && s1.ok()) << s0 << " " << s1;
    } else {
      EXPECT_EQ(s1.code(), absl::StatusCode::kCancelled) << s1;
      EXPECT_TRUE(s0.ok()) << s0;
    }
    EXPECT_EQ(store.Describe("pieces")->step(), step);
  }
}

TEST_F(StoreTest, ACommitOfTheLastStepNeverStreamsPiecesOfTheNextOne) {
  constexpr uint64_t kN = 600000;  // two pieces of 512K
  Create(JobRequest("overlap", 1, {{"w", kN}}));
  ASSERT_TRUE(Push("overlap", 1, 0, {{"w", RandomBf16(rng_, kN, 1.0f)}}, 100000).ok());
  auto step1 = Commit("overlap", 1, 1e-3);
  ASSERT_TRUE(step1.ok());
  ASSERT_TRUE(Push("overlap", 2, 0, {{"w", RandomBf16(rng_, kN, 1.0f)}}, 100000).ok());
  // Step 2's committer holds after its first piece is applied and sent.
  std::mutex mu;
  std::condition_variable cv;
  bool holding = false, release = false;
  absl::Status applier;
  std::thread t([&] {
    v1::CommitRequest r;
    r.set_job("overlap");
    r.set_step(2);
    r.set_lr(1e-3);
    r.set_gscale(1.0f);
    applier = store_.Commit(r, [&](const v1::ParamChunk&) {
      std::unique_lock<std::mutex> lock(mu);
      holding = true;
      cv.notify_all();
      cv.wait(lock, [&] { return release; });
      return true;
    });
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return holding; });
  }
  // Piece 0 already holds step 2: a retried commit of step 1 must not send it as step 1's.
  auto late = Commit("overlap", 1, 1e-3);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kAborted) << late.status();
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  t.join();
  EXPECT_TRUE(applier.ok()) << applier;
  EXPECT_EQ(store_.Describe("overlap")->step(), 2u);
  EXPECT_NE(*Commit("overlap", 2, 1e-3), *step1);
}

TEST_F(StoreTest, CommitWithIncompletePushIsRefusedNamingWhatIsMissing) {
  Create(JobRequest("incomplete", 2, {{"w", 3000}}));
  const std::string before = Snapshot("incomplete");
  auto none = Commit("incomplete", 1, 1e-3);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("no rank has pushed step 1"));
  // Rank 1 sends half of its gradient and waits in the background.
  auto g = RandomBf16(rng_, 3000, 1.0f);
  auto session = StartPush("incomplete", 1, 1);
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)->Add(Chunk("w", 0, g.data(), 1500)).ok());
  auto partial = Commit("incomplete", 1, 1e-3);
  EXPECT_EQ(partial.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(partial.status().message()), HasSubstr("ranks {0, 1} of 2"));
  EXPECT_THAT(std::string(partial.status().message()), HasSubstr("rank 0 lacks tensor 'w' elements [0, 3000)"));
  // A push that ends without covering its shards is refused too.
  auto finish = (*session)->Finish();
  EXPECT_EQ(finish.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(finish.status().message()), HasSubstr("elements [1500, 3000)"));
  EXPECT_EQ(Snapshot("incomplete"), before);
}

// A retry that sends no chunk and ends short of its gradient is refused,
// and changes nothing: it does not end the round in which an earlier, cut
// stream of the rank had chunks summed, so the rank's next retry completes
// it and the rank already waiting at the barrier is answered.
TEST_F(StoreTest, ARefusedRetryWithoutChunksLeavesTheRoundItsCutStreamJoined) {
  auto init = Create(JobRequest("retried", 2, {{"w", 3000}}, v1::PRECISION_FP32, /*barrier_ms=*/5000));
  auto g0 = RandomBf16(rng_, 3000, 1.0f), g1 = RandomBf16(rng_, 3000, 1.0f);
  // Rank 1's whole gradient is in (waiting in the window), then it waits at the barrier.
  auto one = StartPush("retried", 1, 1);
  ASSERT_TRUE(one.ok());
  ASSERT_TRUE((*one)->Add(Chunk("w", 0, g1.data(), 3000)).ok());
  auto waiting = std::async(std::launch::async, [&] { return (*one)->Finish(); });
  {
    auto cut = StartPush("retried", 1, 0);  // summed, then cut off: dropped unanswered
    ASSERT_TRUE(cut.ok());
    ASSERT_TRUE((*cut)->Add(Chunk("w", 0, g0.data(), 1500)).ok());
  }
  auto empty = StartPush("retried", 1, 0);
  ASSERT_TRUE(empty.ok());
  auto refused = (*empty)->Finish();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("elements [1500, 3000)"));
  empty->reset();
  ASSERT_TRUE(Push("retried", 1, 0, {{"w", g0}}).ok());
  const auto answered = waiting.get();
  ASSERT_TRUE(answered.ok()) << answered.status();
  ASSERT_TRUE(Commit("retried", 1, 1e-3).ok());
  ReferenceTensor ref(kHyper, init["w"], false);
  ref.Step({g0.data(), g1.data()}, 1e-3, 1.0f);
  EXPECT_EQ(ReadFloats("retried", "w", v1::MASTER), ref.p);
}

TEST_F(StoreTest, BarrierDeadlineDiscardsTheRoundAndAFreshPushSucceeds) {
  auto init = Create(JobRequest("deadline", 2, {{"w", 2000}}, v1::PRECISION_FP32, /*barrier_ms=*/300));
  const std::string before = Snapshot("deadline");
  auto g0 = RandomBf16(rng_, 2000, 1.0f), g1 = RandomBf16(rng_, 2000, 1.0f);
  // Rank 1 starts streaming but stalls past the deadline.
  auto slow = StartPush("deadline", 1, 1);
  ASSERT_TRUE(slow.ok());
  ASSERT_TRUE((*slow)->Add(Chunk("w", 0, g1.data(), 1000)).ok());
  const absl::Time start = absl::Now();
  auto waited = Push("deadline", 1, 0, {{"w", g0}});
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(waited.status().message()), HasSubstr("ranks {1} of 2"));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));
  // The stalled rank's later chunk belongs to a round that is gone.
  EXPECT_EQ((*slow)->Add(Chunk("w", 1000, g1.data() + 1000, 1000)).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(Commit("deadline", 1, 1e-3).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Snapshot("deadline"), before);
  // Both ranks push again: the step goes through as if nothing happened.
  std::thread other([&] { EXPECT_TRUE(Push("deadline", 1, 1, {{"w", g1}}).ok()); });
  EXPECT_TRUE(Push("deadline", 1, 0, {{"w", g0}}).ok());
  other.join();
  ASSERT_TRUE(Commit("deadline", 1, 1e-3).ok());
  ReferenceTensor ref(kHyper, init["w"], false);
  ref.Step({g0.data(), g1.data()}, 1e-3, 1.0f);
  EXPECT_EQ(ReadFloats("deadline", "w", v1::MASTER), ref.p);
}

TEST_F(StoreTest, EveryRankAtAnExpiredBarrierIsToldWhichRanksAreMissing) {
  // Long enough for both pushes to be in before it, on a loaded machine.
  Create(JobRequest("missing", 3, {{"w", 2000}}, v1::PRECISION_FP32, /*barrier_ms=*/1500));
  const std::string before = Snapshot("missing");
  auto g0 = RandomBf16(rng_, 2000, 1.0f), g1 = RandomBf16(rng_, 2000, 1.0f);
  // Ranks 0 and 1 push whole and wait; rank 2 never comes. Whichever of the
  // two sees the deadline first ends the round; the other learns it from
  // the ended round, and must be told the same cause, not its own rank.
  std::vector<absl::StatusOr<v1::PushResponse>> answers(2, absl::UnknownError("not answered"));
  std::thread other([&] { answers[1] = Push("missing", 1, 1, {{"w", g1}}); });
  answers[0] = Push("missing", 1, 0, {{"w", g0}});
  other.join();
  for (const auto& answer : answers) {
    EXPECT_EQ(answer.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_THAT(std::string(answer.status().message()), HasSubstr("ranks {2} of 3 have not finished pushing step 1"));
    // And the job: the refused line in the log is all an operator sees of
    // it, and it named none (an outside probe).
    EXPECT_THAT(std::string(answer.status().message()), ::testing::StartsWith("job 'missing': "));
  }
  EXPECT_EQ(Snapshot("missing"), before);
}

// Describe says which ranks an open round waits for, and how long until its
// deadline, for an operator looking for a stuck step's missing rank; at most
// 16 ranks are named (at 65536 ranks the list would outgrow a message).
TEST_F(StoreTest, DescribeSaysWhichRanksTheOpenRoundWaitsFor) {
  Create(JobRequest("waits", 40, {{"w", 2000}}, v1::PRECISION_FP32, /*barrier_ms=*/30000));
  EXPECT_EQ(store_.Describe("waits")->waiting_for(), "");
  auto g = RandomBf16(rng_, 2000, 1.0f);
  auto first = StartPush("waits", 1, 3);  // rank 3 pushes whole and waits at the barrier
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE((*first)->Add(Chunk("w", 0, g.data(), 2000)).ok());
  std::thread waiting([&] { (void)(*first)->Finish(); });
  // Until rank 3 has finished (its chunk alone opens the round).
  const std::string expected =
      "ranks {0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, and 23 more} of 40 have not finished pushing "
      "step 1; rank 0 lacks tensor 'w' elements [0, 2000)";
  std::string waiting_for;
  for (int k = 0; k < 400 && waiting_for != expected; ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    waiting_for = store_.Describe("waits")->waiting_for();
  }
  EXPECT_EQ(waiting_for, expected);
  const double left = store_.Describe("waits")->barrier_seconds_left();
  EXPECT_GT(left, 20.0);
  EXPECT_LE(left, 30.0);
  ASSERT_TRUE(store_.DropJob("waits").ok());  // ends the wait
  waiting.join();
}

// A commit that is the first to see a round's deadline ends the round and
// names the missing ranks, as the round's pushes are told (it used to say
// "no rank has pushed"); nothing is applied. A Describe before it says the
// deadline passed (it reported the round as waiting), and leaves the round
// for the commit to end.
TEST_F(StoreTest, ACommitThatFirstSeesTheDeadlineNamesTheMissingRanks) {
  Create(JobRequest("late-commit", 2, {{"w", 2000}}, v1::PRECISION_FP32, /*barrier_ms=*/200));
  const std::string before = Snapshot("late-commit");
  auto g = RandomBf16(rng_, 2000, 1.0f);
  auto partial = StartPush("late-commit", 1, 1);
  ASSERT_TRUE(partial.ok());
  ASSERT_TRUE((*partial)->Add(Chunk("w", 0, g.data(), 1000)).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto late = store_.Describe("late-commit");
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(late->waiting_for(),
            "its barrier deadline passed: ranks {0, 1} of 2 have not finished pushing step 1; rank 0 lacks tensor "
            "'w' elements [0, 2000); the step's next push or commit ends the round, and nothing of it is applied");
  EXPECT_EQ(late->barrier_seconds_left(), 0.0);
  const auto refused = Commit("late-commit", 1, 1e-3);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("the round ended, ranks {0, 1} of 2 have not finished pushing step 1"));
  EXPECT_EQ(Snapshot("late-commit"), before);
}

TEST_F(StoreTest, SkippedStepAdvancesTheJobAndChangesNoState) {
  auto init = Create(JobRequest("skip", 1, {{"w", 4000}}));
  auto bad = RandomBf16(rng_, 4000, 1.0f);
  bad[123] = 0x7FC0;  // NaN
  auto resp = Push("skip", 1, 0, {{"w", bad}});
  ASSERT_TRUE(resp.ok());
  EXPECT_TRUE(resp->nonfinite());
  const std::string before_state = Snapshot("skip").substr(store_.Describe("skip")->ByteSizeLong());
  // Applying it is refused, and changes nothing: an outside client that
  // committed such a step without skip made the masters NaN.
  const auto applied = Commit("skip", 1, 1e-3);
  EXPECT_EQ(applied.status().code(), absl::StatusCode::kFailedPrecondition) << applied.status();
  EXPECT_THAT(std::string(applied.status().message()), HasSubstr("commits the step with skip"));
  EXPECT_EQ(Snapshot("skip").substr(store_.Describe("skip")->ByteSizeLong()), before_state);
  EXPECT_EQ(store_.Describe("skip")->step(), 0u);
  ASSERT_TRUE(Commit("skip", 1, 1e-3, 1.0f, /*skip=*/true).ok());
  auto d = store_.Describe("skip");
  EXPECT_EQ(d->step(), 1u);
  EXPECT_EQ(d->tensors(0).adam_step(), 0u);
  EXPECT_EQ(Snapshot("skip").substr(d->ByteSizeLong()), before_state);
  // The next update is the tensor's first Adam step.
  auto g = RandomBf16(rng_, 4000, 1.0f);
  ASSERT_TRUE(Push("skip", 2, 0, {{"w", g}}).ok());
  ASSERT_TRUE(Commit("skip", 2, 1e-3).ok());
  ReferenceTensor ref(kHyper, init["w"], false);
  ref.Step({g.data()}, 1e-3, 1.0f);
  EXPECT_EQ(ReadFloats("skip", "w", v1::MASTER), ref.p);
  EXPECT_EQ(store_.Describe("skip")->tensors(0).adam_step(), 1u);
}

TEST_F(StoreTest, TensorsWithoutGradientKeepStateAndTheirOwnAdamStep) {
  auto init = Create(JobRequest("nograd", 2, {{"a", 3000}, {"b", 500}}));
  ReferenceTensor ra(kHyper, init["a"], false), rb(kHyper, init["b"], false);
  for (uint64_t t = 1; t <= 4; ++t) {
    auto a0 = RandomBf16(rng_, 3000, 1.0f), a1 = RandomBf16(rng_, 3000, 1.0f);
    auto b0 = RandomBf16(rng_, 500, 1.0f), b1 = RandomBf16(rng_, 500, 1.0f);
    // b: both ranks on odd steps, only rank 1 on step 2, nobody on step 4.
    std::map<std::string, std::vector<uint16_t>> g0 = {{"a", a0}}, g1 = {{"a", a1}};
    std::vector<std::string> ng0 = {"b"}, ng1 = {"b"};
    if (t % 2 == 1) {
      g0["b"] = b0;
      ng0.clear();
    }
    if (t != 4) {
      g1["b"] = b1;
      ng1.clear();
    }
    std::thread r1([&] { EXPECT_TRUE(Push("nograd", t, 1, g1, 1000, 0, ng1).ok()); });
    ASSERT_TRUE(Push("nograd", t, 0, g0, 1000, 0, ng0).ok());
    r1.join();
    ASSERT_TRUE(Commit("nograd", t, 1e-2).ok());
    ra.Step({a0.data(), a1.data()}, 1e-2, 1.0f);
    if (t % 2 == 1) rb.Step({b0.data(), b1.data()}, 1e-2, 1.0f);
    if (t == 2) rb.Step({b1.data()}, 1e-2, 1.0f);
  }
  EXPECT_EQ(ReadFloats("nograd", "a", v1::MASTER), ra.p);
  EXPECT_EQ(ReadFloats("nograd", "b", v1::MASTER), rb.p);
  EXPECT_EQ(ReadFloats("nograd", "b", v1::EXP_AVG_SQ), rb.v);
  auto d = store_.Describe("nograd");
  EXPECT_EQ(d->tensors(0).adam_step(), 4u);
  EXPECT_EQ(d->tensors(1).adam_step(), 3u);
}

// A retried push of the step just done is answered from the sums kept for
// it, until the next step is sealed; then it is stale, said at its first
// message rather than after the whole gradient was sent for nothing.
TEST_F(StoreTest, APushOfTheDoneStepWhoseAnswerIsGoneIsRefusedAtItsFirstMessage) {
  Create(JobRequest("gone", 1, {{"w", 1000}}));
  const auto g = RandomBf16(rng_, 1000, 1.0f);
  ASSERT_TRUE(Push("gone", 1, 0, {{"w", g}}).ok());
  ASSERT_TRUE(Commit("gone", 1, 1e-3).ok());
  EXPECT_TRUE(Push("gone", 1, 0, {{"w", g}}).ok());  // its answer is kept
  ASSERT_TRUE(Push("gone", 2, 0, {{"w", g}}).ok());  // sealed: step 1's sums are gone
  const auto old = StartPush("gone", 1, 0);
  EXPECT_EQ(old.status().code(), absl::StatusCode::kFailedPrecondition) << old.status();
  EXPECT_THAT(old.status().message(), HasSubstr("no longer kept"));
  EXPECT_TRUE(Commit("gone", 2, 1e-3).ok());
}

// A commit of a step two behind (its trainer was replaced by another of its
// rank, which went on) is stale; it says that the step was applied, since
// its trainer's own gradients may be in it, rather than only "stale".
TEST_F(StoreTest, AStaleCommitSaysItsStepWasAppliedAndTheJobWentOn) {
  Create(JobRequest("went-on", 1, {{"w", 1000}}));
  for (uint64_t t = 1; t <= 2; ++t) {
    ASSERT_TRUE(Push("went-on", t, 0, {{"w", RandomBf16(rng_, 1000, 1.0f)}}).ok());
    ASSERT_TRUE(Commit("went-on", t, 1e-3).ok());
  }
  const std::string before = Snapshot("went-on");
  const auto stale = Commit("went-on", 1, 1e-3);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition) << stale.status();
  EXPECT_THAT(std::string(stale.status().message()),
              HasSubstr("commit of step 1 is stale (it was applied, and the job has gone on since"));
  EXPECT_EQ(Snapshot("went-on"), before);
}

// An fp32 initial value finite as sent but Inf once rounded to bf16, in a
// BF16 group (which keeps bf16), is refused as not finite, and nothing of
// its chunk is written.
TEST_F(StoreTest, AnInitialValueThatRoundsToInfInABf16GroupIsRefused) {
  ASSERT_TRUE(store_.CreateJob(JobRequest("b16", 1, {{"w", 10}}, v1::PRECISION_BF16)).ok());
  v1::InitChunk c;
  c.set_job("b16");
  c.set_tensor("w");
  c.set_dtype(v1::FP32);
  std::vector<float> v(10, 1.0f);
  v[3] = std::numeric_limits<float>::max();  // rounds up to bf16 Inf
  c.set_data(v.data(), 40);
  const auto refused = store_.Init(c);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("element 3 (3.40282e+38) rounds to infinity in its group's bf16 state"));
  EXPECT_EQ(store_.Describe("b16")->uninitialized_tensors(), 1u);
  v[3] = 3.0e38f;  // rounds to a finite bf16
  c.set_data(v.data(), 40);
  EXPECT_TRUE(store_.Init(c).ok());
}

// A job of the name with another configuration is refused naming what
// differs, on one line, and not the group names, which are for messages
// only and were reported as an "ignored" difference.
TEST_F(StoreTest, ADifferentConfigurationIsNamedOnOneLineWithoutTheIgnoredGroupName) {
  v1::CreateJobRequest first = JobRequest("differs", 1, {{"w", 100}});
  first.mutable_groups(0)->set_name("g");
  ASSERT_TRUE(store_.CreateJob(first).ok());
  v1::CreateJobRequest second = JobRequest("differs", 2, {{"w", 100}});
  second.mutable_groups(0)->set_name("g");
  const auto refused = store_.CreateJob(second);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kAlreadyExists);
  const std::string message(refused.status().message());
  // Which side each value is: the server's first.
  EXPECT_THAT(message, HasSubstr("(this server's -> this call's: modified: world_size: 1 -> 2)"));
  EXPECT_THAT(message, Not(HasSubstr("ignored")));
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  // A value at proto3's default (weight decay 0, absent on the wire) is
  // shown as one side's value too, not as "deleted" with the other's alone.
  v1::CreateJobRequest decayed = JobRequest("differs", 1, {{"w", 100}});
  decayed.mutable_groups(0)->set_name("g");
  ASSERT_NE(first.groups(0).weight_decay(), 0.05);
  first.mutable_groups(0)->set_weight_decay(0);
  ASSERT_TRUE(store_.DropJob("differs").ok());
  ASSERT_TRUE(store_.CreateJob(first).ok());
  decayed.mutable_groups(0)->set_weight_decay(0.05);
  const std::string other(store_.CreateJob(decayed).status().message());
  EXPECT_THAT(other, HasSubstr("modified: groups[0].weight_decay: 0 -> 0.05")) << other;
  // A bf16 tensor's param_dtype, kept unspecified (what servers before the
  // field stored), is named BF16, not DTYPE_UNSPECIFIED, which no caller
  // sent; either way round.
  v1::CreateJobRequest fp32 = first;
  fp32.mutable_tensors(0)->set_param_dtype(v1::FP32);
  for (const auto& [held, asked, says] :
       {std::make_tuple(first, fp32, "param_dtype: BF16 -> FP32"), std::make_tuple(fp32, first, "param_dtype: FP32 -> BF16")}) {
    ASSERT_TRUE(store_.DropJob("differs").ok());
    ASSERT_TRUE(store_.CreateJob(held).ok());
    const std::string dtypes(store_.CreateJob(asked).status().message());
    EXPECT_THAT(dtypes, HasSubstr(says)) << dtypes;
    EXPECT_THAT(dtypes, Not(HasSubstr("UNSPECIFIED"))) << dtypes;
    EXPECT_THAT(dtypes, Not(HasSubstr("same servers"))) << dtypes;
  }
  // Another part of the tensor on this server, and nothing else: a rank
  // listing the servers in another order is told so.
  ASSERT_TRUE(store_.DropJob("differs").ok());
  ASSERT_TRUE(store_.CreateJob(first).ok());
  v1::CreateJobRequest placed = first;
  placed.add_shards()->set_tensor("w");
  placed.mutable_shards(0)->set_length(50);
  const std::string shards(store_.CreateJob(placed).status().message());
  EXPECT_THAT(shards, HasSubstr("every rank must list the same servers, in the same order")) << shards;
  EXPECT_THAT(shards, HasSubstr("\"Scaling\"")) << shards;
  // A tensor of another size moves the shards too, but the servers listed
  // are not why: the message names the size alone (an outside probe's rank
  // with a layer one wider was told to list the same servers).
  v1::CreateJobRequest wider = first;
  wider.mutable_tensors(0)->set_numel(101);  // its one shard, the whole tensor, follows
  const std::string sized(store_.CreateJob(wider).status().message());
  EXPECT_THAT(sized, HasSubstr("numel: 100 -> 101")) << sized;
  EXPECT_THAT(sized, Not(HasSubstr("same servers"))) << sized;
}

// A tensor's shape is part of the job where both the job and the caller
// give one: a transposed weight of the same numel (a relaunch of a changed
// model) is refused, naming the shape; a caller without shapes (a client
// before the field) attaches to a job with them, and the other way round.
// A shape that is not the numel's, or of more than 32 dimensions, is
// INVALID_ARGUMENT.
TEST_F(StoreTest, AShapeIsPartOfTheJobWhereBothSidesGiveOne) {
  const auto shaped = [this](std::initializer_list<uint64_t> shape) {
    v1::CreateJobRequest r = JobRequest("shaped", 1, {{"w", 8192}});
    for (uint64_t d : shape) r.mutable_tensors(0)->add_shape(d);
    return r;
  };
  ASSERT_TRUE(store_.CreateJob(shaped({64, 128})).ok());
  EXPECT_TRUE(store_.CreateJob(shaped({64, 128})).ok());
  EXPECT_TRUE(store_.CreateJob(shaped({})).ok());
  const auto transposed = store_.CreateJob(shaped({128, 64}));
  EXPECT_EQ(transposed.status().code(), absl::StatusCode::kAlreadyExists) << transposed.status();
  EXPECT_THAT(std::string(transposed.status().message()), HasSubstr("shape")) << transposed.status();
  // A tensor added to a job without shapes by a caller with them: the
  // difference named is the tensor, not the shapes one side lacks.
  v1::CreateJobRequest wider = shaped({64, 128});
  *wider.add_tensors() = wider.tensors(0);
  wider.mutable_tensors(1)->set_name("v");
  ASSERT_TRUE(store_.DropJob("shaped").ok());
  ASSERT_TRUE(store_.CreateJob(shaped({})).ok());
  const std::string added(store_.CreateJob(wider).status().message());
  EXPECT_THAT(added, HasSubstr("added: tensors[1]")) << added;
  EXPECT_THAT(added, Not(HasSubstr("tensors[0].shape"))) << added;
  EXPECT_TRUE(store_.CreateJob(shaped({128, 64})).ok());
  ASSERT_TRUE(store_.DropJob("shaped").ok());
  for (const auto& shape : {std::initializer_list<uint64_t>{64, 64}, {8192, 0}, {2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
                            {uint64_t{1} << 32, uint64_t{1} << 32, 2}}) {
    const auto refused = store_.CreateJob(shaped(shape));
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("not one of its numel 8192 elements"));
  }
  EXPECT_TRUE(store_.CreateJob(shaped({2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                      1, 1, 1, 1})).ok());  // 32 dimensions
}

// A long name is quoted cut short, between UTF-8 characters: cut inside
// one, the message itself was not valid UTF-8.
TEST(QuoteTest, CutsALongNameBetweenCharacters) {
  EXPECT_EQ(Quote("short"), "'short'");
  const std::string euros = std::string(62, 'a') + "\xE2\x82\xAC\xE2\x82\xAC";  // 62 bytes, then two 3-byte euros
  EXPECT_EQ(Quote(euros), "'" + std::string(62, 'a') + "...' (68 bytes)");
  const std::string exact = std::string(61, 'a') + "\xE2\x82\xAC" + "b";  // a euro ending at byte 64
  EXPECT_EQ(Quote(exact), "'" + std::string(61, 'a') + "\xE2\x82\xAC...' (65 bytes)");
}

TEST_F(StoreTest, BadInputGetsASpecificCodeAndChangesNothing) {
  auto init = Create(JobRequest("bad", 2, {{"w", 3000}}));
  const std::string before = Snapshot("bad");
  auto g = RandomBf16(rng_, 3000, 1.0f);
  auto begin_push_of = [&](const std::string& job) {  // the first message of a push of step 1 of `job`
    v1::GradChunk h = Chunk("w", 0, g.data(), 100);
    h.set_job(job);
    h.set_step(1);
    return store_.BeginPush(h).status();
  };
  auto push_status = [&](uint64_t step, uint32_t rank, v1::GradChunk chunk) {
    auto s = StartPush("bad", step, rank);
    if (!s.ok()) return s.status();
    return (*s)->Add(chunk);
  };
  const v1::GradChunk ok = Chunk("w", 0, g.data(), 100);
  v1::GradChunk past = Chunk("w", 2950, g.data(), 100);
  v1::GradChunk unknown = Chunk("nope", 0, g.data(), 100);
  v1::GradChunk ragged = ok;
  ragged.mutable_data()->push_back('x');
  v1::GradChunk fp32 = ok;
  fp32.set_dtype(v1::FP32);
  struct Case {
    const char* what;
    absl::Status status;
    absl::StatusCode code;
    const char* says;
  } cases[] = {
      {"past the tensor", push_status(1, 0, past), absl::StatusCode::kOutOfRange, "past its end"},
      {"unknown tensor", push_status(1, 0, unknown), absl::StatusCode::kNotFound, "no tensor 'nope'"},
      {"ragged data", push_status(1, 0, ragged), absl::StatusCode::kInvalidArgument, "whole number"},
      {"wrong dtype", push_status(1, 0, fp32), absl::StatusCode::kInvalidArgument, "takes BF16"},
      {"rank out of range", push_status(1, 2, ok), absl::StatusCode::kInvalidArgument, "world_size 2"},
      {"stale step", push_status(0, 0, ok), absl::StatusCode::kFailedPrecondition, "stale"},
      {"future step", push_status(2, 0, ok), absl::StatusCode::kOutOfRange, "future"},
      {"last step of all", push_status(UINT64_MAX, 0, ok), absl::StatusCode::kOutOfRange, "future"},
      {"unknown job", begin_push_of("nobody"), absl::StatusCode::kNotFound, "no job 'nobody'"},
      // As CreateJob refuses one: no job has it ("no job ''" read as a failed lookup).
      {"no job named (push)", begin_push_of(""), absl::StatusCode::kInvalidArgument, "names no job"},
      {"no job named (commit)", Commit("", 1, 1e-3).status(), absl::StatusCode::kInvalidArgument, "names no job"},
      {"no job named (describe)", store_.Describe("").status(), absl::StatusCode::kInvalidArgument, "names no job"},
      {"no job named (drop)", store_.DropJob(""), absl::StatusCode::kInvalidArgument, "names no job"},
      {"future commit", Commit("bad", 2, 1e-3).status(), absl::StatusCode::kOutOfRange, "future"},
      {"stale commit", Commit("bad", 0, 1e-3).status(), absl::StatusCode::kFailedPrecondition, "stale"},
      {"NaN lr", Commit("bad", 1, std::nan("")).status(), absl::StatusCode::kInvalidArgument, "lr"},
      {"Inf gscale", Commit("bad", 1, 1e-3, INFINITY).status(), absl::StatusCode::kInvalidArgument, "gscale"},
      {"negative gscale", Commit("bad", 1, 1e-3, -0.5f).status(), absl::StatusCode::kInvalidArgument, ">= 0"},
      {"numel past 2^40", store_.CreateJob(JobRequest("huge", 1, {{"w", (uint64_t{1} << 62) + 1000}})).status(),
       absl::StatusCode::kInvalidArgument, "2^40"},
      {"more than the machine's memory", store_.CreateJob(JobRequest("big", 1, {{"w", uint64_t{1} << 40}})).status(),
       absl::StatusCode::kResourceExhausted, "this server's memory budget (--memory_limit"},
      {"different shapes", store_.CreateJob(JobRequest("bad", 2, {{"w", 3001}})).status(),
       absl::StatusCode::kAlreadyExists, "different configuration"},
      {"NaN initial value", [&] {
         v1::InitChunk c;
         c.set_job("bad");
         c.set_tensor("w");
         c.set_dtype(v1::FP32);
         std::vector<float> v(10, 1.0f);
         v[3] = NAN;
         c.set_data(v.data(), 40);
         return store_.Init(c).status();
       }(), absl::StatusCode::kInvalidArgument, "not finite"},
      {"bad read kind", store_.Read([] {
         v1::ReadRequest r;
         r.set_job("bad");
         r.set_tensor("w");
         return r;
       }(), [](const v1::StateChunk&) { return true; }), absl::StatusCode::kInvalidArgument, "read kind"},
      // offset + count past 2^64: the message says the count, not a wrapped end.
      {"read past 2^64", store_.Read([] {
         v1::ReadRequest r;
         r.set_job("bad");
         r.set_tensor("w");
         r.set_kind(v1::MASTER);
         r.set_offset(100);
         r.set_length(UINT64_MAX - 49);
         return r;
       }(), [](const v1::StateChunk&) { return true; }), absl::StatusCode::kOutOfRange,
       "18446744073709551566 from offset 100 go past its end"},
      // With no length (to the shard's end), the offset alone is past it:
      // "0 from offset 3001 go past its end" read as if zero elements could.
      {"read from past the end", store_.Read([] {
         v1::ReadRequest r;
         r.set_job("bad");
         r.set_tensor("w");
         r.set_kind(v1::MASTER);
         r.set_offset(3001);
         return r;
       }(), [](const v1::StateChunk&) { return true; }), absl::StatusCode::kOutOfRange,
       "has 3000 elements; offset 3001 is past its end"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(c.status.code(), c.code) << c.what << ": " << c.status;
    EXPECT_THAT(std::string(c.status.message()), HasSubstr(c.says)) << c.what;
  }
  EXPECT_EQ(Snapshot("bad"), before);
  // An identical CreateJob attaches.
  auto attach = store_.CreateJob(JobRequest("bad", 2, {{"w", 3000}}));
  ASSERT_TRUE(attach.ok());
  EXPECT_FALSE(attach->created());
  EXPECT_EQ(Snapshot("bad"), before);
}

// trainers_per_rank is part of a job's identity where both sides say it:
// nodes of different G average over different counts, so their commits
// would apply different gscales (the first one's applied, a probe saw).
// A side that says nothing (0: plain ranks, readers, older clients)
// attaches to a job of any, and is attached to by any.
TEST_F(StoreTest, AnAttachThatSaysOtherTrainersPerRankIsRefused) {
  auto with_trainers = [&](const std::string& job, uint32_t trainers) {
    v1::CreateJobRequest r = JobRequest(job, 2, {{"w", 1000}});
    r.set_trainers_per_rank(trainers);
    return r;
  };
  Create(with_trainers("g2", 2));
  const std::string before = Snapshot("g2");
  const auto other = store_.CreateJob(with_trainers("g2", 4));
  EXPECT_EQ(other.status().code(), absl::StatusCode::kAlreadyExists) << other.status();
  EXPECT_THAT(std::string(other.status().message()), HasSubstr("trainers_per_rank"));
  EXPECT_THAT(std::string(other.status().message()), HasSubstr("same number of local ranks"));
  EXPECT_THAT(std::string(other.status().message()), ::testing::Not(HasSubstr("drop it")));
  // Another G and another size: another model, which the advice to fix the G alone would not make right.
  v1::CreateJobRequest bigger = JobRequest("g2", 2, {{"w", 1001}});
  bigger.set_trainers_per_rank(4);
  EXPECT_THAT(std::string(store_.CreateJob(bigger).status().message()), HasSubstr("drop it or use another name"));
  EXPECT_EQ(Snapshot("g2"), before);
  // An operator finds the G that a refused node must attach with.
  EXPECT_EQ(store_.Describe("g2")->trainers_per_rank(), 2u);
  const v1::ListJobsResponse listed = store_.ListJobs({}, [](const std::string& name) { return name == "g2"; });
  ASSERT_EQ(listed.jobs_size(), 1);
  EXPECT_EQ(listed.jobs(0).trainers_per_rank(), 2u);
  for (uint32_t says : {0u, 2u}) {
    const auto attached = store_.CreateJob(with_trainers("g2", says));
    ASSERT_TRUE(attached.ok()) << says << ": " << attached.status();
    EXPECT_FALSE(attached->created());
  }
  Create(with_trainers("unsaid", 0));
  const auto attached = store_.CreateJob(with_trainers("unsaid", 8));
  ASSERT_TRUE(attached.ok()) << attached.status();
  EXPECT_FALSE(attached->created());
  // Any other difference keeps its own message, without the hint.
  const auto shapes = store_.CreateJob(JobRequest("g2", 2, {{"w", 1001}}));
  EXPECT_EQ(shapes.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(shapes.status().message()), ::testing::Not(HasSubstr("local ranks")));
}

// A relaunch that lists the same params in another order is told so, and
// not told to drop the job, whose state is right.
TEST_F(StoreTest, AnAttachNamingTheTensorsInAnotherOrderIsToldSo) {
  Create(JobRequest("order", 1, {{"a", 1000}, {"b", 2000}, {"c", 3000}}));
  const std::string before = Snapshot("order");
  const auto moved = store_.CreateJob(JobRequest("order", 1, {{"c", 3000}, {"a", 1000}, {"b", 2000}}));
  EXPECT_EQ(moved.status().code(), absl::StatusCode::kAlreadyExists) << moved.status();
  EXPECT_THAT(std::string(moved.status().message()), HasSubstr("in another order"));
  EXPECT_THAT(std::string(moved.status().message()), ::testing::Not(HasSubstr("drop it")));
  EXPECT_EQ(Snapshot("order"), before);
  // Other tensors, in any order, are another model: drop it or rename.
  // So are the same tensors in another order where something else differs too.
  const std::vector<v1::CreateJobRequest> others = {
      JobRequest("order", 1, {{"a", 1000}, {"b", 2000}, {"d", 3000}}),
      JobRequest("order", 1, {{"b", 2000}, {"a", 1000}}),
      JobRequest("order", 2, {{"c", 3000}, {"a", 1000}, {"b", 2000}}),
      JobRequest("order", 1, {{"c", 3001}, {"a", 1000}, {"b", 2000}})};
  for (const v1::CreateJobRequest& other : others) {
    const auto refused = store_.CreateJob(other);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kAlreadyExists) << refused.status();
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("drop it or use another name"));
  }
}

TEST_F(StoreTest, PushBeforeInitialValuesIsRefused) {
  ASSERT_TRUE(store_.CreateJob(JobRequest("noinit", 1, {{"w", 5000}})).ok());
  v1::InitChunk c;
  c.set_job("noinit");
  c.set_tensor("w");
  c.set_dtype(v1::BF16);
  std::vector<uint16_t> half(4000, 0x3F80);
  c.set_data(half.data(), half.size() * 2);
  ASSERT_TRUE(store_.Init(c).ok());
  auto s = StartPush("noinit", 1, 0);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("elements [4000, 5000) have no initial value"));
}

TEST_F(StoreTest, InitialValuesAreTakenOnlyAtStepZero) {
  Create(JobRequest("late", 1, {{"w", 100}}));
  auto g = RandomBf16(rng_, 100, 1.0f);
  ASSERT_TRUE(Push("late", 1, 0, {{"w", g}}).ok());
  ASSERT_TRUE(Commit("late", 1, 1e-3).ok());
  const std::string before = Snapshot("late");
  EXPECT_EQ(store_.Init(Fp32Init("late", "w", std::vector<float>(100, 1.0f))).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Snapshot("late"), before);
}

TEST_F(StoreTest, DescribeReportsStateBytesAndHeldPrecision) {
  Create(JobRequest("fp32", 2, {{"w", 1000}, {"b", 24}}));
  Create(JobRequest("bf16", 1, {{"w", 1000}}, v1::PRECISION_BF16));
  auto d32 = store_.Describe("fp32");
  EXPECT_EQ(d32->state_bytes(), 1024u * 12);
  // Params out, the running fp32 sum, and the window's cap: 4 MiB per rank.
  EXPECT_EQ(d32->staging_bytes(), 1024u * 2 + 1024u * 4 + 2u * (4 << 20));
  EXPECT_EQ(d32->groups(0).state_dtype(), v1::FP32);
  auto d16 = store_.Describe("bf16");
  EXPECT_EQ(d16->state_bytes(), 1000u * 6);
  EXPECT_EQ(d16->groups(0).state_dtype(), v1::BF16);
  EXPECT_THAT(d16->device(), HasSubstr("cpu"));
}

// Walks every page of ListJobs as a caller that sees `visible`, `max_jobs`
// a page, and returns the jobs' names in the order the pages gave them.
std::vector<std::string> ListAll(const JobStore& store, uint32_t max_jobs,
                                 const std::function<bool(const std::string&)>& visible, int* pages) {
  std::vector<std::string> names;
  v1::ListJobsRequest req;
  req.set_max_jobs(max_jobs);
  *pages = 0;
  for (;;) {
    const v1::ListJobsResponse page = store.ListJobs(req, visible);
    ++*pages;
    EXPECT_LE(page.ByteSizeLong(), store.max_message_bytes());
    for (const v1::JobSummary& job : page.jobs()) names.push_back(job.job());
    if (!page.more()) break;
    EXPECT_GT(page.jobs_size(), 0);
    if (page.jobs_size() == 0 || *pages > 1000) break;
    req.set_after(names.back());
  }
  return names;
}

// What a list says of a job is what Describe says of it, whatever the step
// and round; the jobs come in byte order of their names, each once, only
// those the caller may see.
TEST_F(StoreTest, ListJobsSummarizesEachJobAsDescribeDoesInNameOrder) {
  Create(JobRequest("b-waits", 3, {{"w", 2000}, {"b", 24}}, v1::PRECISION_FP32, /*barrier_ms=*/30000));
  ASSERT_TRUE(store_.CreateJob(JobRequest("a-stepped", 1, {{"w", 1000}}, v1::PRECISION_BF16), {"alice", 0}).ok());
  ASSERT_TRUE(store_.Init(Fp32Init("a-stepped", "w", RandomFloats(rng_, 1000, -1, 1))).ok());
  ASSERT_TRUE(store_.CreateJob(JobRequest("c-uninitialized", 1, {{"w", 64}})).ok());
  ASSERT_TRUE(Push("a-stepped", 1, 0, {{"w", RandomBf16(rng_, 1000, 1.0f)}}, 1 << 16).ok());
  ASSERT_TRUE(Commit("a-stepped", 1, 1e-2).ok());
  auto first = StartPush("b-waits", 1, 1);  // rank 1 pushes whole and waits at the barrier
  ASSERT_TRUE(first.ok());
  auto g = RandomBf16(rng_, 2000, 1.0f);
  ASSERT_TRUE((*first)->Add(Chunk("w", 0, g.data(), 2000)).ok());
  ASSERT_TRUE((*first)->Add(Chunk("b", 0, g.data(), 24)).ok());
  std::thread waiting([&] { (void)(*first)->Finish(); });
  // Until rank 1 has finished (its first chunk opens the round).
  for (int k = 0; k < 400 && store_.Describe("b-waits")->waiting_for().find("{0, 2}") == std::string::npos; ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }

  const v1::ListJobsResponse all = store_.ListJobs({}, [](const std::string&) { return true; });
  ASSERT_EQ(all.jobs_size(), 3);
  EXPECT_FALSE(all.more());
  EXPECT_THAT(all.device(), HasSubstr("cpu"));
  for (const v1::JobSummary& s : all.jobs()) {
    SCOPED_TRACE(s.job());
    auto d = store_.Describe(s.job());
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(s.step(), d->step());
    EXPECT_EQ(s.world_size(), d->world_size());
    EXPECT_EQ(s.tensors(), d->tensor_count());
    EXPECT_EQ(s.state_bytes(), d->state_bytes());
    EXPECT_EQ(s.staging_bytes(), d->staging_bytes());
    EXPECT_EQ(s.bookkeeping_bytes(), d->bookkeeping_bytes());
    EXPECT_EQ(s.uninitialized_tensors(), d->uninitialized_tensors());
    EXPECT_EQ(s.waiting_for(), d->waiting_for());
    EXPECT_NEAR(s.barrier_seconds_left(), d->barrier_seconds_left(), 1.0);
    EXPECT_EQ(s.owner(), d->owner());
    EXPECT_EQ(all.memory_limit_bytes(), d->memory_limit_bytes());
  }
  EXPECT_EQ(all.jobs(0).job(), "a-stepped");
  EXPECT_EQ(all.jobs(0).step(), 1u);
  EXPECT_EQ(all.jobs(0).state_bytes(), 1000u * 6);
  EXPECT_EQ(all.jobs(0).owner(), "alice");
  EXPECT_EQ(all.jobs(1).owner(), "");
  EXPECT_EQ(all.jobs(1).job(), "b-waits");
  EXPECT_EQ(all.jobs(1).world_size(), 3u);
  EXPECT_EQ(all.jobs(1).tensors(), 2u);
  EXPECT_THAT(all.jobs(1).waiting_for(), HasSubstr("ranks {0, 2} of 3 have not finished pushing step 1"));
  EXPECT_GT(all.jobs(1).barrier_seconds_left(), 20.0);
  EXPECT_EQ(all.jobs(2).job(), "c-uninitialized");
  EXPECT_EQ(all.jobs(2).uninitialized_tensors(), 1u);
  EXPECT_EQ(all.jobs(2).waiting_for(), "");

  int pages = 0;
  EXPECT_THAT(ListAll(store_, 1, [](const std::string&) { return true; }, &pages),
              ::testing::ElementsAre("a-stepped", "b-waits", "c-uninitialized"));
  EXPECT_EQ(pages, 3);
  EXPECT_THAT(ListAll(store_, 0, [](const std::string& job) { return job != "b-waits"; }, &pages),
              ::testing::ElementsAre("a-stepped", "c-uninitialized"));
  EXPECT_EQ(pages, 1);
  ASSERT_TRUE(store_.DropJob("b-waits").ok());  // ends the wait
  waiting.join();
  EXPECT_THAT(ListAll(store_, 2, [](const std::string&) { return true; }, &pages),
              ::testing::ElementsAre("a-stepped", "c-uninitialized"));
}

// A store whose jobs' window of early chunks holds 256 KiB.
class SmallWindowStoreTest : public StoreTest {
 protected:
  SmallWindowStoreTest() : StoreTest(Options()) {}
  static JobStoreOptions Options() {
    JobStoreOptions o;
    o.window_bytes = 256 << 10;
    return o;
  }
};

// Chunks packed in one message (GradChunk.more) are taken each as if it
// came alone (the rank-order sum makes their order invisible here; what is
// held while they wait is PushSessionTest's): rank 1's message of 64 tensors (512 KiB), ahead of rank
// 0, fills the window partway and waits there, the rest of it behind; the
// push of rank 0 lets it through, and the step is the rank-order
// reference's, bit for bit. Each chunk's data comes in scattered pieces.
TEST_F(SmallWindowStoreTest, PackedChunksOfARankNotNextWaitForTheWindowAndSumInRankOrder) {
  std::vector<TensorDef> tensors;
  for (int i = 0; i < 64; ++i) tensors.push_back({absl::StrCat("t", i), 4096});
  auto init = Create(JobRequest("packed", 2, tensors));
  std::vector<std::map<std::string, std::vector<uint16_t>>> grads(2);
  for (auto& rank : grads) {
    for (const TensorDef& t : tensors) rank[t.name] = RandomBf16(rng_, t.numel, 1.0f);
  }
  auto rank1 = StartPush("packed", 1, 1);
  ASSERT_TRUE(rank1.ok()) << rank1.status();
  const auto part = [&](const std::string& tensor) {
    const std::vector<uint16_t>& g = grads[1][tensor];
    v1::GradChunk head = Chunk(tensor, 0, g.data(), g.size());
    const std::string bytes = head.data();
    head.clear_data();
    return GradPart{std::move(head), Scatter(bytes, rng_)};
  };
  GradPart first = part("t0");
  std::vector<GradPart> more;
  for (int i = 1; i < 64; ++i) more.push_back(part(absl::StrCat("t", i)));
  // Shared with the wake, which may run after the test is done.
  struct Woken {
    std::mutex mu;
    std::condition_variable cv;
    int count = 0;
  };
  auto woken = std::make_shared<Woken>();
  const PushSession::Wake wake = [woken] {
    std::lock_guard<std::mutex> lock(woken->mu);
    ++woken->count;
    woken->cv.notify_all();
  };
  absl::StatusOr<bool> taken = (*rank1)->Offer(std::move(first.head), first.data, std::move(more), wake);
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_FALSE(*taken) << "512 KiB of early chunks fitted a 256 KiB window";
  std::future<absl::StatusOr<v1::PushResponse>> rank0 =
      std::async(std::launch::async, [&] { return Push("packed", 1, 0, grads[0], 4096); });
  int seen = 0;
  while (taken.ok() && !*taken) {
    {
      std::unique_lock<std::mutex> lock(woken->mu);
      woken->cv.wait(lock, [&] { return woken->count > seen; });
      seen = woken->count;
    }
    taken = (*rank1)->Resume(wake);
  }
  ASSERT_TRUE(taken.ok()) << taken.status();
  ASSERT_TRUE((*rank1)->Finish().ok());
  ASSERT_TRUE(rank0.get().ok());
  auto params = Commit("packed", 1, 1e-2);
  ASSERT_TRUE(params.ok()) << params.status();
  for (const TensorDef& t : tensors) {
    ReferenceTensor ref(kHyper, init[t.name], false);
    ref.Step({grads[0][t.name].data(), grads[1][t.name].data()}, 1e-2, 1.0f);
    EXPECT_EQ((*params)[t.name], ref.Params()) << t.name;
    EXPECT_EQ(ReadFloats("packed", t.name, v1::MASTER), ref.p) << t.name;
  }
}

// A packed chunk refused partway through its message (a tensor the job
// lacks) refuses the push as a chunk in a message of its own would: the
// chunks before it, summed already, end the round, and the step pushed
// again is the reference's, as if the refused push never came.
TEST_F(StoreTest, APackedChunkRefusedPartwayLeavesTheStepAsARefusedChunkWould) {
  const std::vector<TensorDef> tensors = {{"a", 3000}, {"b", 5000}, {"c", 700}};
  auto init = Create(JobRequest("partway", 1, tensors));
  std::map<std::string, std::vector<uint16_t>> bad, good;
  for (const TensorDef& t : tensors) {
    bad[t.name] = RandomBf16(rng_, t.numel, 1.0f);
    good[t.name] = RandomBf16(rng_, t.numel, 1.0f);
  }
  {
    auto session = StartPush("partway", 1, 0);
    ASSERT_TRUE(session.ok()) << session.status();
    const auto part = [&](const std::string& tensor, const std::vector<uint16_t>& g) {
      v1::GradChunk head = Chunk(tensor, 0, g.data(), g.size());
      Pieces data = Pieces::Own(head.data());
      head.clear_data();
      return GradPart{std::move(head), std::move(data)};
    };
    GradPart first = part("a", bad["a"]);
    std::vector<GradPart> more;
    more.push_back(part("b", bad["b"]));
    more.push_back(part("nope", bad["c"]));
    more.push_back(part("c", bad["c"]));
    const absl::StatusOr<bool> taken =
        (*session)->Offer(std::move(first.head), first.data, std::move(more), [] {});
    EXPECT_EQ(taken.status().code(), absl::StatusCode::kNotFound) << taken.status();
  }  // the stream ends refused
  ASSERT_TRUE(Push("partway", 1, 0, good).ok());
  auto params = Commit("partway", 1, 1e-2);
  ASSERT_TRUE(params.ok()) << params.status();
  for (const TensorDef& t : tensors) {
    ReferenceTensor ref(kHyper, init[t.name], false);
    ref.Step({good[t.name].data()}, 1e-2, 1.0f);
    EXPECT_EQ((*params)[t.name], ref.Params()) << t.name;
  }
}

class SmallMessageStoreTest : public StoreTest {
 protected:
  SmallMessageStoreTest() : StoreTest(Options()) {}
  static JobStoreOptions Options() {
    JobStoreOptions o;
    o.max_message_bytes = JobStore::kMinMessageBytes;
    return o;
  }
};

// Jobs of the longest names, more than one answer of the smallest message
// limit holds: the pages stop short of the limit and go on where they stopped.
TEST_F(SmallMessageStoreTest, ListJobsPagesStayUnderTheMessageLimitAndMissNoJob) {
  std::vector<std::string> made;
  for (int i = 0; i < 700; ++i) {
    std::string name = absl::StrCat("job-", 1000 + i, "-");
    name.resize(kMaxNameBytes, 'x');
    ASSERT_TRUE(store_.CreateJob(JobRequest(name, 1, {{"w", 8}})).ok());
    made.push_back(name);
  }
  int pages = 0;
  EXPECT_EQ(ListAll(store_, 0, [](const std::string&) { return true; }, &pages), made);
  EXPECT_EQ(pages, 2);  // 1000 a page, but the limit cuts the first short
}

// A job whose groups would leave a Describe page no room for a tensor is
// refused at CreateJob: every page repeats the groups, each with what it
// holds, and such a job could never be described (an outside probe's 560
// groups of 200-byte names fit a CreateJob of the smallest limit). One
// group fewer than the most that fit is made, and described.
TEST_F(SmallMessageStoreTest, AJobWhoseGroupsADescribeCannotHoldIsRefused) {
  const auto with_groups = [&](const std::string& job, int groups) {
    v1::CreateJobRequest r = JobRequest(job, 1, {{"w", 8}});
    for (int g = 1; g < groups; ++g) *r.add_groups() = r.groups(0);
    for (int g = 0; g < groups; ++g) r.mutable_groups(g)->set_name(std::string(kMaxNameBytes - 5, 'g') + absl::StrCat(10000 + g));
    return r;
  };
  const auto refused = store_.CreateJob(with_groups("too-many", 1000));  // about 230 KB of groups
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("groups take"));
  EXPECT_EQ(store_.Describe("too-many").status().code(), absl::StatusCode::kNotFound);
  int most = 1, refused_at = 1000;  // the most groups a job may have here, by bisection
  while (refused_at - most > 1) {
    const int mid = (most + refused_at) / 2;
    if (store_.CreateJob(with_groups("probe", mid)).ok()) {
      most = mid;
      ASSERT_TRUE(store_.DropJob("probe").ok());
    } else {
      refused_at = mid;
    }
  }
  ASSERT_GT(most, 100);
  ASSERT_TRUE(store_.CreateJob(with_groups("fits", most)).ok());
  const auto described = store_.Describe("fits");
  ASSERT_TRUE(described.ok()) << described.status();
  EXPECT_EQ(described->groups_size(), most);
  EXPECT_EQ(described->tensors_size(), 1);
  EXPECT_LE(described->ByteSizeLong(), JobStore::kMinMessageBytes);
}

// SIGTERM's path: what was applied is checkpointed, what comes after is refused.
class DrainTest : public CheckpointDirTest<0> {
 protected:
  // Job `name` with step 1 pushed and its commit's stream opened, one piece
  // read and then no more: the step is mid-apply until the stream goes.
  std::unique_ptr<ParamStream> StallCommit(const std::string& name) {
    const uint64_t n = 4 * JobStoreOptions{}.stream_chunk_elements + 3;  // several pieces
    Create(JobRequest(name, 1, {{"w", n}}));
    std::mt19937_64 rng(9);
    EXPECT_TRUE(Push(name, 1, 0, {{"w", RandomBf16(rng, n, 0.3f)}}, 1 << 16).ok());
    auto stream = store_.OpenCommit(CommitRequestFor(name, 1, 1e-2));
    EXPECT_TRUE(stream.ok()) << stream.status();
    if (!stream.ok()) return nullptr;
    auto piece = (*stream)->Next();
    EXPECT_TRUE(piece.ok() && piece->has_value()) << piece.status();
    return *std::move(stream);
  }
};

// A committer that stopped reading holds its step half applied: the drain
// waits for it only so long, then checkpoints every other job and reports
// that one DEADLINE_EXCEEDED, instead of waiting (and holding the exit) for
// good. The stream's end then finishes the step.
TEST_F(DrainTest, ACommitterThatStoppedReadingCostsOnlyItsOwnJobsCheckpoint) {
  auto stream = StallCommit("stalled");
  ASSERT_NE(stream, nullptr);
  Create(JobRequest("other", 1, {{"w", 100}}));

  const auto began = std::chrono::steady_clock::now();
  auto results = store_.DrainAndCheckpoint(absl::Milliseconds(300));
  EXPECT_LT(std::chrono::steady_clock::now() - began, std::chrono::seconds(20));
  std::map<std::string, absl::StatusOr<v1::CheckpointResponse>> by_job(results.begin(), results.end());
  ASSERT_EQ(by_job.size(), 2u);
  EXPECT_EQ(by_job.at("stalled").status().code(), absl::StatusCode::kDeadlineExceeded) << by_job.at("stalled").status();
  EXPECT_THAT(std::string(by_job.at("stalled").status().message()), HasSubstr("is still applying step 1 after"));
  ASSERT_TRUE(by_job.at("other").ok()) << by_job.at("other").status();
  EXPECT_TRUE(by_job.at("other")->complete());
  const auto commits = [] {
    const std::string text = metrics::Registry::Default().Render();
    const std::string key = "shardopt_commits_total{job=\"stalled\"} ";
    const size_t at = text.find(key);
    return at == std::string::npos ? 0 : std::atoi(text.c_str() + at + key.size());
  };
  const int before = commits();
  stream.reset();  // the committer goes away: its stream finishes the step
  EXPECT_EQ(store_.Describe("stalled")->step(), 1u);
  EXPECT_EQ(commits(), before + 1) << "a step applied by an abandoned stream is a commit too";
}

// A dropped job's metric series go with it (a job of the name made again
// starts from zero), and a commit whose last piece was read as the job went
// does not make them again when its stream ends.
TEST_F(DrainTest, ACommitEndingAfterItsJobsDropMakesNoSeriesOfIt) {
  auto stream = StallCommit("dropped-mid-commit");  // its 5 pieces: one read
  ASSERT_NE(stream, nullptr);
  const auto series = [] {
    const std::string text = metrics::Registry::Default().Render();
    return text.find("{job=\"dropped-mid-commit\"") != std::string::npos;
  };
  EXPECT_THAT(metrics::Registry::Default().Render(),
              HasSubstr("\nshardopt_pushes_total{job=\"dropped-mid-commit\"} 1\n"));
  for (int k = 1; k < 5; ++k) {
    auto piece = stream->Next();
    ASSERT_TRUE(piece.ok() && piece->has_value()) << k << ": " << piece.status();
  }
  ASSERT_TRUE(store_.DropJob("dropped-mid-commit").ok());
  EXPECT_FALSE(series());
  auto end = stream->Next();
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_FALSE(end->has_value());
  EXPECT_FALSE(series()) << "the stream's end counted a commit of a dropped job";
}

// Initial values while step 1 is half applied (its committer stopped
// reading) are refused, saying that the step is being applied rather than
// that the job is at step 0, where they would be taken; nothing is written.
TEST_F(DrainTest, AnInitialValueWhileStepOneIsAppliedIsRefusedSayingSo) {
  auto stream = StallCommit("applying");
  ASSERT_NE(stream, nullptr);
  std::vector<float> values(10, 7.0f);
  v1::InitChunk c;
  c.set_job("applying");
  c.set_tensor("w");
  c.set_dtype(v1::FP32);
  c.set_data(values.data(), values.size() * 4);
  const auto refused = store_.Init(c);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("is applying step 1"));
  stream.reset();  // the stream's end finishes the step
  const std::vector<float> master = ReadFloats("applying", "w", v1::MASTER);
  for (size_t i = 0; i < values.size(); ++i) EXPECT_NE(master[i], 7.0f) << i;  // none of the chunk written
}

// A Checkpoint call waits for a half-applied step only until its caller's
// deadline: DEADLINE_EXCEEDED, naming the step, instead of holding its
// thread for as long as the committer takes. Once the step is whole, the
// checkpoint is written.
TEST_F(DrainTest, ACheckpointOfAHalfAppliedStepWaitsOnlyUntilItsDeadline) {
  auto stream = StallCommit("stalled");
  ASSERT_NE(stream, nullptr);

  v1::CheckpointRequest request;
  request.set_job("stalled");
  request.set_step(1);
  auto asked = std::async(std::launch::async,
                          [&] { return store_.Checkpoint(request, absl::Now() + absl::Milliseconds(300)); });
  if (asked.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    stream.reset();  // finishes the step, so that the wait ends and the test fails rather than hangs
    FAIL() << "the checkpoint waited past its deadline";
  }
  const auto late = asked.get();
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  EXPECT_THAT(std::string(late.status().message()), HasSubstr("still applying step 1"));
  stream.reset();  // the committer goes away: its stream finishes the step
  const auto written = store_.Checkpoint(request, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_TRUE(written->complete());
}

TEST_F(DrainTest, DrainCheckpointsAppliedStepsSkipsUninitializedJobsAndRefusesNewCommitsJobsAndInitsWithUnavailable) {
  Create(JobRequest("a", 1, {{"w", 100}}));
  ASSERT_TRUE(store_.CreateJob(JobRequest("waiting for Init", 1, {{"w", 100}})).ok());
  std::mt19937_64 rng(5);
  ASSERT_TRUE(Push("a", 1, 0, {{"w", RandomBf16(rng, 100, 0.3f)}}).ok());
  auto applied = Commit("a", 1, 1e-3);
  ASSERT_TRUE(applied.ok());
  ASSERT_TRUE(Push("a", 2, 0, {{"w", RandomBf16(rng, 100, 0.3f)}}).ok());

  auto results = store_.DrainAndCheckpoint();
  ASSERT_EQ(results.size(), 1u);  // the job without initial values has nothing to keep
  EXPECT_EQ(results[0].first, "a");
  ASSERT_TRUE(results[0].second.ok()) << results[0].second.status();
  EXPECT_EQ(results[0].second->step(), 1u);
  EXPECT_TRUE(results[0].second->complete());
  EXPECT_TRUE(std::filesystem::exists(results[0].second->directory() + "/COMMIT"));

  auto refused = Commit("a", 2, 1e-3);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("shutting down"));
  EXPECT_EQ(Commit("a", 1, 1e-3).value(), *applied);  // a retry of what was applied still answers
  // What the drain's checkpoints would not keep: a job made now (a new one,
  // or one attached to), initial values written now.
  for (const char* job : {"a", "new"}) {
    auto made = store_.CreateJob(JobRequest(job, 1, {{"w", 100}}));
    EXPECT_EQ(made.status().code(), absl::StatusCode::kUnavailable) << job << ": " << made.status();
    EXPECT_THAT(std::string(made.status().message()), HasSubstr("again once it is back"));
  }
  EXPECT_EQ(store_.Describe("new").status().code(), absl::StatusCode::kNotFound);
  v1::InitChunk init;
  init.set_job("waiting for Init");
  init.set_tensor("w");
  init.set_dtype(v1::FP32);
  init.set_data(std::string(400, '\0'));
  EXPECT_EQ(store_.Init(init).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(store_.Describe("waiting for Init")->uninitialized_tensors(), 1u);
}

// --checkpoint_keep: the newest complete checkpoints stay, older steps go,
// torn or not, and a newer step still being written is never touched.
using CheckpointKeepTest = CheckpointDirTest<2>;

TEST_F(CheckpointKeepTest, KeepsTheNewestCompleteOnesAndNeverAStepInProgress) {
  const std::string& dir = dir_;
  Create(JobRequest("k", 1, {{"w", 100}}));
  // A torn step older than all (a server died writing it), and one newer
  // than all, as if another server were writing it now.
  const std::string torn_old = checkpoint::StepDirectory(dir, "k", 0);
  const std::string in_progress = checkpoint::StepDirectory(dir, "k", 99);
  for (const std::string& d : {torn_old, in_progress}) {
    std::filesystem::create_directories(d);
    std::ofstream(d + "/part-0-50.bin") << "partial";  // a peer's part
  }
  std::mt19937_64 rng(11);
  for (uint64_t step = 1; step <= 4; ++step) StepAndCheckpoint("k", step, 100, rng);
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(std::filesystem::path(in_progress).parent_path())) {
    left.push_back(e.path().string());
  }
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{checkpoint::StepDirectory(dir, "k", 3), checkpoint::StepDirectory(dir, "k", 4),
                                            in_progress}));
  EXPECT_THAT(log_, ::testing::Contains(HasSubstr("pruned checkpoint " + torn_old)));
  // What is left restores: the newest complete one, step 4.
  auto backend = MakeCpuBackend({});
  JobStore fresh(backend.get(), Options0(dir));
  auto restored = fresh.CreateJob(JobRequest("k", 1, {{"w", 100}}));
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->step(), 4u);
  // A restore of the newest leaves the newer step alone: its writer may be
  // a peer that completes it yet (a rolling upgrade's drain).
  EXPECT_TRUE(std::filesystem::exists(in_progress + "/part-0-50.bin"));
}

// A server restarted since a job was checkpointed holds no job until a
// trainer's CreateJob restores it; an operator's Describe of it is
// NOT_FOUND, and says that the checkpoints are there, waiting.
// A job restored at step 0 whose initial values are then written again
// holds a state that step 0's complete checkpoint does not: the write sets
// that checkpoint's COMMIT and this server's part aside, and the next
// checkpoint of step 0 writes the new values, which a restart restores.
// Before, that checkpoint answered "complete" having written nothing (the
// same life: a restart), or blamed "two runs" (a new life: made again after
// a drop), and later was refused; a restart brought the old values back.
TEST_F(CheckpointKeepTest, InitialValuesWrittenOverARestoredStepAreWhatItsNextCheckpointHolds) {
  for (const bool dropped : {false, true}) {
    const std::string name = dropped ? "reinit-dropped" : "reinit-restarted";
    const v1::CreateJobRequest spec = JobRequest(name, 1, {{"w", 100}});
    Create(spec);
    v1::CheckpointRequest at0;
    at0.set_job(name);
    at0.set_step(0);
    ASSERT_TRUE(store_.Checkpoint(at0).ok());
    auto backend = MakeCpuBackend({});
    JobStore restarted(backend.get(), Options0(dir_));
    if (dropped) {
      ASSERT_TRUE(store_.DropJob(name).ok());
      ASSERT_TRUE(store_.CreateJob(spec).ok());  // restores step 0 under a new life
    } else {
      ASSERT_TRUE(restarted.CreateJob(spec).ok());  // restores step 0, the same life
    }
    JobStore& store = dropped ? store_ : restarted;
    const std::vector<float> fresh = RandomFloats(rng_, 100, -1, 1);
    ASSERT_TRUE(store.Init(Fp32Init(name, "w", fresh)).ok());
    const auto written = store.Checkpoint(at0);
    ASSERT_TRUE(written.ok()) << name << ": " << written.status();
    EXPECT_TRUE(written->complete()) << name;
    EXPECT_GT(written->part_bytes(), 0u) << name;
    JobStore again(backend.get(), Options0(dir_));
    ASSERT_TRUE(again.CreateJob(spec).ok()) << name;
    EXPECT_EQ(ReadFloats(again, name, "w", v1::MASTER), fresh) << name;
  }
}

// A restore compares trainers_per_rank as an attach does, only where both
// the checkpoint and the attach say it: a job checkpointed by a plain
// client (0) restores for a node group's attach, and one checkpointed with
// G = 2 for a reader's (0); another G is refused, saying what to do, not
// to move the checkpoint away (an outside probe found both refused).
TEST_F(CheckpointKeepTest, ARestoreComparesTrainersPerRankOnlyWhereBothSayIt) {
  const auto with_trainers = [&](const std::string& job, uint32_t trainers) {
    v1::CreateJobRequest r = JobRequest(job, 2, {{"w", 100}});
    r.set_trainers_per_rank(trainers);
    return r;
  };
  for (const auto& [made, restores, refused] :
       std::vector<std::tuple<uint32_t, uint32_t, uint32_t>>{{0, 2, 0}, {2, 0, 4}, {2, 2, 4}}) {
    const std::string name = absl::StrCat("g", made, "-", restores);
    Create(with_trainers(name, made));
    v1::CheckpointRequest at0;
    at0.set_job(name);
    at0.set_step(0);
    ASSERT_TRUE(store_.Checkpoint(at0).ok());
    auto backend = MakeCpuBackend({});
    if (refused != 0) {
      JobStore restarted(backend.get(), Options0(dir_));
      const auto other = restarted.CreateJob(with_trainers(name, refused));
      EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition) << name << ": " << other.status();
      EXPECT_THAT(std::string(other.status().message()), HasSubstr("same number of local ranks")) << name;
      EXPECT_THAT(std::string(other.status().message()), ::testing::Not(HasSubstr("move the checkpoint away")));
    }
    JobStore restarted(backend.get(), Options0(dir_));
    const auto restored = restarted.CreateJob(with_trainers(name, restores));
    ASSERT_TRUE(restored.ok()) << name << ": " << restored.status();
    EXPECT_TRUE(restored->restored()) << name;
    EXPECT_EQ(ReadFloats(restarted, name, "w", v1::MASTER), ReadFloats(store_, name, "w", v1::MASTER)) << name;
    // A restore by an attach saying 0 holds the checkpoint's G, and the
    // restored job goes on refusing nodes of another.
    EXPECT_EQ(restarted.Describe(name)->trainers_per_rank(), std::max(made, restores)) << name;
    if (refused != 0) {
      const auto other = restarted.CreateJob(with_trainers(name, refused));
      EXPECT_EQ(other.status().code(), absl::StatusCode::kAlreadyExists) << name << ": " << other.status();
    }
  }
}

TEST_F(CheckpointKeepTest, ADescribeOfAJobOnlyOnDiskSaysItsCheckpointsWait) {
  Create(JobRequest("on-disk", 1, {{"w", 100}}));
  std::mt19937_64 rng(5);
  StepAndCheckpoint("on-disk", 1, 100, rng);
  // A torn step 2 (no COMMIT) is not what a restore takes, nor named.
  std::filesystem::create_directories(checkpoint::StepDirectory(dir_, "on-disk", 2));
  auto backend = MakeCpuBackend({});
  JobStore restarted(backend.get(), Options0(dir_));
  const auto described = restarted.Describe("on-disk");
  EXPECT_EQ(described.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(described.status().message()),
              HasSubstr("its checkpoint directory holds a complete checkpoint of step 1, which a trainer's CreateJob "
                        "restores (under a new life if the job was dropped) if its parts' checksums match"));
  EXPECT_THAT(std::string(restarted.Describe("never-made").status().message()), Not(HasSubstr("checkpoint")));
}

// A newest checkpoint whose COMMIT or part header is damaged is named with
// what a restore meets, where a describe named nothing (an outside probe took
// that for a directory without checkpoints, then the attach was DATA_LOSS).
TEST_F(CheckpointKeepTest, ADescribeOfAJobOnlyOnDiskSaysWhyItsNewestCheckpointCannotBeRestored) {
  for (const std::string file : {"COMMIT", "part"}) {
    const std::string name = "damaged-" + file;
    Create(JobRequest(name, 1, {{"w", 100}}));
    std::mt19937_64 rng(6);
    StepAndCheckpoint(name, 1, 100, rng);
    std::string path;
    for (const auto& entry : std::filesystem::directory_iterator(checkpoint::StepDirectory(dir_, name, 1))) {
      if (entry.path().filename().string().rfind(file, 0) == 0) path = entry.path().string();
    }
    ASSERT_FALSE(path.empty()) << file;
    {
      std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(12);  // in the frame's header: the COMMIT's manifest, or the part's
      const char byte = static_cast<char>(f.get());
      f.seekp(12);
      f.put(static_cast<char>(byte ^ 0x40));
    }
    auto backend = MakeCpuBackend({});
    JobStore restarted(backend.get(), Options0(dir_));
    const auto described = restarted.Describe(name);
    EXPECT_EQ(described.status().code(), absl::StatusCode::kNotFound) << file;
    EXPECT_THAT(std::string(described.status().message()),
                HasSubstr("its checkpoint directory holds a checkpoint that a trainer's CreateJob cannot restore: "
                          "DATA_LOSS: "))
        << file;
    const auto attached = restarted.CreateJob(JobRequest(name, 1, {{"w", 100}}));
    EXPECT_EQ(attached.status().code(), absl::StatusCode::kDataLoss) << file << ": " << attached.status();
  }
}

// A server whose --checkpoint_dir is no longer the directory it started on
// (its volume unmounted; here a symlink moved to /proc, another device)
// reads and writes nothing there: a drop, which could not be marked where
// the job's checkpoints are, is refused and keeps the job; a CreateJob is
// refused rather than making afresh a job whose checkpoints it cannot see;
// a Describe says why it did not look. Each went ahead before (an outside
// probe: the drop's mark was lost, and the dropped run's trainer restored
// after a restart; a new trainer started over at step 0). With the
// directory back, all goes on.
TEST_F(CheckpointKeepTest, AServerWhoseCheckpointDirMovedToAnotherDeviceNeitherDropsNorMakesJobs) {
  std::mt19937_64 rng(8);
  Create(JobRequest("on-disk", 1, {{"w", 100}}));
  StepAndCheckpoint("on-disk", 1, 100, rng);
  const std::string link = dir_ + "-link";
  std::filesystem::remove(link);
  std::filesystem::create_directory_symlink(dir_, link);
  JobStoreOptions options = Options0(link);
  options.checkpoint_dir_id = checkpoint::DirectoryId(link).value();
  options.checkpoint_dir_device = checkpoint::DirectoryDevice(link).value();
  auto backend = MakeCpuBackend({});
  JobStore there(backend.get(), options);
  ASSERT_TRUE(there.CreateJob(JobRequest("held", 1, {{"w", 100}})).ok());
  const auto point_to = [&](const std::string& target) {
    std::filesystem::remove(link);
    std::filesystem::create_directory_symlink(target, link);
  };
  point_to("/proc");
  const absl::Status drop = there.DropJob("held");
  EXPECT_EQ(drop.code(), absl::StatusCode::kFailedPrecondition) << drop;
  EXPECT_THAT(std::string(drop.message()), HasSubstr("is on another device than when this server started"));
  EXPECT_TRUE(there.Describe("held").ok()) << "the job stays";
  const auto made = there.CreateJob(JobRequest("on-disk", 1, {{"w", 100}}));
  EXPECT_EQ(made.status().code(), absl::StatusCode::kFailedPrecondition) << made.status();
  EXPECT_THAT(std::string(made.status().message()), HasSubstr("is on another device than when this server started"));
  const auto described = there.Describe("on-disk");
  EXPECT_EQ(described.status().code(), absl::StatusCode::kNotFound) << described.status();
  EXPECT_THAT(std::string(described.status().message()), HasSubstr("its checkpoints were not looked for"));
  point_to(dir_);
  const auto restored = there.CreateJob(JobRequest("on-disk", 1, {{"w", 100}}));
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->step(), 1u);
  EXPECT_TRUE(there.DropJob("held").ok());
  std::filesystem::remove(link);
}

// A job's life (CreateJobResponse.incarnation): the same to every attach
// and through its checkpoint's restore, so that trainers go on after a server
// restarts; new when the job is dropped and made again, where a push, commit
// or init of the old life is NOT_FOUND "was dropped" and changes nothing.
TEST_F(CheckpointKeepTest, AJobMadeAgainAfterADropIsANewLifeAndARestoreKeepsTheOld) {
  const v1::CreateJobRequest spec = JobRequest("life", 1, {{"w", 100}});
  Create(spec);
  auto first = store_.CreateJob(spec);  // attaches
  ASSERT_TRUE(first.ok());
  const uint64_t old_life = first->incarnation();
  EXPECT_NE(old_life, 0u);
  std::mt19937_64 rng(5);
  StepAndCheckpoint("life", 1, 100, rng);
  // The life a restarted server (another store on the directory) restores,
  // at `restore_step` (0: the newest), or 0 if it restores nothing.
  const auto restored_life = [&](uint64_t restore_step) -> uint64_t {
    auto backend = MakeCpuBackend({});
    JobStore restarted(backend.get(), Options0(dir_));
    v1::CreateJobRequest asked = spec;
    asked.set_restore_step(restore_step);
    auto answer = restarted.CreateJob(asked);
    EXPECT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(answer.value_or(v1::CreateJobResponse()).step(), 1u);
    return answer.ok() && answer->restored() ? answer->incarnation() : 0;
  };
  EXPECT_EQ(restored_life(0), old_life);
  ASSERT_TRUE(store_.DropJob("life").ok());
  // The drop is marked on disk: a server restarted since does not restore
  // the dropped life either.
  const uint64_t remade = restored_life(0);
  EXPECT_NE(remade, 0u);
  EXPECT_NE(remade, old_life);
  // The life after the dropped one is a function of it: another restart
  // gives the new run's trainers the same one back.
  EXPECT_EQ(restored_life(0), remade);
  auto again = store_.CreateJob(spec);  // restores step 1 from the checkpoint, as a new life
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->restored());
  EXPECT_EQ(again->incarnation(), remade);
  const auto before = Snapshot("life");
  v1::CommitRequest commit = CommitRequestFor("life", 2, 1e-3, 1.0f, false);
  commit.set_incarnation(old_life);
  v1::GradChunk push = Chunk("w", 0, RandomBf16(rng, 100, 0.3f).data(), 100);
  push.set_job("life");
  push.set_step(2);
  push.set_incarnation(old_life);
  v1::InitChunk init = Fp32Init("life", "w", std::vector<float>(100, 0.5f));
  init.set_incarnation(old_life);
  const absl::Status refused[] = {
      store_.Commit(commit, [](const v1::ParamChunk&) { return true; }),
      store_.BeginPush(push).status(),
      store_.Init(init).status(),
  };
  for (const absl::Status& st : refused) {
    EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr("was dropped on this server and made again"));
    EXPECT_THAT(std::string(st.message()), HasSubstr(absl::StrCat("(incarnation ", old_life, ")")));
  }
  EXPECT_EQ(Snapshot("life"), before);
  EXPECT_EQ(store_.DropJob("life", old_life).code(), absl::StatusCode::kNotFound);  // a stale trainer's cleanup
  // A restore_step, a run started from a step the caller chose: a new life
  // too, even at the newest checkpoint (step 1 here).
  const uint64_t back = restored_life(1);
  EXPECT_NE(back, 0u);
  EXPECT_NE(back, old_life);
  EXPECT_NE(back, again->incarnation());
  // The new life's own, and a caller that names none (0), go on.
  commit.set_step(1);  // a retried commit of the restored step: answered, nothing applied
  commit.set_incarnation(again->incarnation());
  EXPECT_TRUE(store_.Commit(commit, [](const v1::ParamChunk&) { return true; }).ok());
  commit.set_incarnation(0);
  EXPECT_TRUE(store_.Commit(commit, [](const v1::ParamChunk&) { return true; }).ok());
  EXPECT_EQ(Snapshot("life"), before);
}

// A client's undo of its own CreateJob, whose attach other servers refused
// (DropJobRequest.undo): the job goes as if never asked for, but only while
// nothing has happened to it since this server made or restored it; and its
// life is not marked dropped, so a restored job's checkpoint restores again
// under the same life (an outside probe's attach that listed one server too
// many left that server a job restored at an older step, which blocked the
// reshard the README describes).
TEST_F(CheckpointKeepTest, AnUndoneCreateTakesOnlyAnUntouchedJobAndLeavesItsLifeRestorable) {
  std::mt19937_64 rng(7);
  const v1::CreateJobRequest fresh = JobRequest("fresh", 1, {{"w", 100}});
  auto made = store_.CreateJob(fresh);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(store_.UndoCreate("fresh", 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_.UndoCreate("fresh", made->incarnation() ^ 1).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(store_.UndoCreate("fresh", made->incarnation()).ok());
  const absl::Status gone = store_.Describe("fresh").status();
  EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound) << gone;
  EXPECT_THAT(std::string(gone.message()), Not(HasSubstr("was dropped"))) << gone;
  // Each CreateJob answered OK counts, the attaches too: the job goes with
  // the last one undone, not from under a rank whose attach went through
  // (a reviewer's case: one rank's attach failed on a server that was not
  // up yet, and its undo took the job the others had attached to).
  made = store_.CreateJob(fresh);
  ASSERT_TRUE(made.ok()) << made.status();
  const auto attached = store_.CreateJob(fresh);
  ASSERT_TRUE(attached.ok() && !attached->created()) << attached.status();
  ASSERT_TRUE(store_.UndoCreate("fresh", made->incarnation()).ok());
  EXPECT_TRUE(store_.Describe("fresh").ok());
  ASSERT_TRUE(store_.UndoCreate("fresh", made->incarnation()).ok());
  EXPECT_EQ(store_.Describe("fresh").status().code(), absl::StatusCode::kNotFound);
  // Touched by an initial value, or by a step: refused, and the job as it was.
  made = store_.CreateJob(fresh);
  ASSERT_TRUE(made.ok()) << made.status();
  ASSERT_TRUE(store_.Init(Fp32Init("fresh", "w", RandomFloats(rng, 100, -1, 1))).ok());
  std::string before = Snapshot("fresh");
  const absl::Status written = store_.UndoCreate("fresh", made->incarnation());
  EXPECT_EQ(written.code(), absl::StatusCode::kPermissionDenied) << written;
  EXPECT_THAT(std::string(written.message()), HasSubstr("holds something since this server made or restored it"));
  EXPECT_EQ(Snapshot("fresh"), before);
  StepAndCheckpoint("fresh", 1, 100, rng);
  before = Snapshot("fresh");
  EXPECT_EQ(store_.UndoCreate("fresh", made->incarnation()).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Snapshot("fresh"), before);

  // Restored on a restarted server: undone, then restored again, the same life at the same step.
  auto backend = MakeCpuBackend({});
  JobStore restarted(backend.get(), Options0(dir_));
  auto restored = restarted.CreateJob(fresh);
  ASSERT_TRUE(restored.ok()) << restored.status();
  ASSERT_TRUE(restored->restored());
  ASSERT_EQ(restored->incarnation(), made->incarnation());
  const std::string at_restore = Snapshot(restarted, "fresh");
  ASSERT_TRUE(restarted.UndoCreate("fresh", made->incarnation()).ok());
  EXPECT_EQ(restarted.Describe("fresh").status().code(), absl::StatusCode::kNotFound);
  restored = restarted.CreateJob(fresh);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_TRUE(restored->restored());
  EXPECT_EQ(restored->incarnation(), made->incarnation());
  EXPECT_EQ(restored->step(), 1u);
  EXPECT_EQ(Snapshot(restarted, "fresh"), at_restore);
  // A push begun there (half of the tensor summed), then the step it
  // completes: each refused, the job kept.
  const std::vector<uint16_t> g = RandomBf16(rng, 100, 0.3f);
  auto session = StartPush(restarted, "fresh", 2, 0);
  ASSERT_TRUE(session.ok()) << session.status();
  for (uint64_t offset : {0, 50}) {
    ASSERT_TRUE((*session)->Add(Chunk("w", offset, g.data() + offset, 50)).ok());
    EXPECT_EQ(restarted.UndoCreate("fresh", made->incarnation()).code(), absl::StatusCode::kPermissionDenied);
  }
  ASSERT_TRUE((*session)->Finish().ok());
  ASSERT_TRUE(restarted.Commit(CommitRequestFor("fresh", 2, 1e-3), [](const v1::ParamChunk&) { return true; }).ok());
  EXPECT_EQ(restarted.UndoCreate("fresh", made->incarnation()).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(restarted.Describe("fresh").value().step(), 2u);

  // A restore_step's restore sets the newer steps aside, which an undo
  // would not put back (an outside probe's): it is not undone.
  ASSERT_TRUE(store_.CreateJob(fresh).ok());  // attached: the job at step 1 here
  StepAndCheckpoint("fresh", 2, 100, rng);
  JobStore again(backend.get(), Options0(dir_));
  v1::CreateJobRequest back = fresh;
  back.set_restore_step(1);
  const auto from_one = again.CreateJob(back);
  ASSERT_TRUE(from_one.ok() && from_one->restored()) << from_one.status();
  const absl::Status kept = again.UndoCreate("fresh", from_one->incarnation());
  EXPECT_EQ(kept.code(), absl::StatusCode::kPermissionDenied) << kept;
  EXPECT_THAT(std::string(kept.message()), HasSubstr("set aside"));
  EXPECT_EQ(again.Describe("fresh").value().step(), 1u);
}

// CreateJobRequest.own_part_step is a re-attach's: without the caller's
// life, or with a restore_step, INVALID_ARGUMENT; where this placement has
// no part of that step of that life (none, or another life's), NOT_FOUND
// and no job made. With one, the job is that part's state, at its step.
TEST_F(CheckpointKeepTest, AnOwnPartIsRestoredAloneOnlyForItsLifeAndStep) {
  const v1::CreateJobRequest spec = JobRequest("own", 1, {{"w", 100}});
  Create(spec);
  auto attached = store_.CreateJob(spec);
  ASSERT_TRUE(attached.ok());
  const uint64_t life = attached->incarnation();
  std::mt19937_64 rng(21);
  StepAndCheckpoint("own", 1, 100, rng);  // one server: complete; made torn here
  std::filesystem::remove(checkpoint::StepDirectory(dir_, "own", 1) + "/COMMIT");
  const std::vector<float> at_1 = ReadFloats(store_, "own", "w", v1::MASTER);
  auto backend = MakeCpuBackend({});
  JobStore restarted(backend.get(), Options0(dir_));
  const auto ask = [&](uint64_t incarnation, uint64_t step, uint64_t restore_step) {
    v1::CreateJobRequest r = spec;
    r.set_incarnation(incarnation);
    r.set_own_part_step(step);
    r.set_restore_step(restore_step);
    return restarted.CreateJob(r);
  };
  EXPECT_EQ(ask(0, 1, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ask(life, 1, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ask(life + 1, 1, 0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ask(life, 2, 0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(restarted.LastStepPhases("own").status().code(), absl::StatusCode::kNotFound) << "a refused ask made a job";
  const auto own = ask(life, 1, 0);
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_TRUE(own->restored());
  EXPECT_EQ(own->step(), 1u);
  EXPECT_EQ(own->incarnation(), life);
  EXPECT_EQ(ReadFloats(restarted, "own", "w", v1::MASTER), at_1);
}

// This server's own part of a torn step newer than its job's is another
// run's once the job goes on from its step: set aside at the job's first
// seal, when every server of the job has taken that step's push, so that
// the new run's peers' parts of the step are never tiled with it. Not at
// the restore: until then a peer may still hold that run and complete the
// step with it (a drain while its peers train on). Peers' parts stay.
TEST_F(CheckpointKeepTest, AnOwnPartOfANewerTornStepGoesAtTheFirstSealNotAtTheRestore) {
  Create(JobRequest("k", 1, {{"w", 100}}));
  std::mt19937_64 rng(12);
  StepAndCheckpoint("k", 1, 100, rng);
  ASSERT_TRUE(store_.DropJob("k").ok());
  const std::string torn = checkpoint::StepDirectory(dir_, "k", 2);
  std::filesystem::create_directories(torn);
  std::ofstream(torn + "/part-0-0.bin") << "partial";   // this placement's own, of another run
  std::ofstream(torn + "/part-0-50.bin") << "partial";  // a peer's
  // What writers of that run left when they died: this placement's is
  // removed with its part (nothing else would remove it if the new run never
  // checkpoints step 2), a peer's is the peer's.
  const std::string own_temporary = torn + "/part-0-0.bin.tmp.4242.17.1";
  const std::string peers_temporary = torn + "/part-0-50.bin.tmp.4343.18.1";
  std::ofstream(own_temporary) << "half";
  std::ofstream(peers_temporary) << "half";
  // A file named as a step is no step: passed over, not set aside.
  const std::string not_a_step = checkpoint::StepDirectory(dir_, "k", 9);
  std::ofstream(not_a_step) << "an operator's";
  auto restored = store_.CreateJob(JobRequest("k", 1, {{"w", 100}}));
  ASSERT_TRUE(restored.ok()) << restored.status();
  ASSERT_TRUE(restored->restored());
  ASSERT_EQ(restored->step(), 1u);
  EXPECT_TRUE(std::filesystem::exists(torn + "/part-0-0.bin"));
  const auto sealed = Push("k", 2, 0, {{"w", RandomBf16(rng, 100, 0.3f)}});
  ASSERT_TRUE(sealed.ok()) << sealed.status();
  EXPECT_FALSE(std::filesystem::exists(torn + "/part-0-0.bin"));
  EXPECT_TRUE(std::filesystem::exists(torn + "/part-0-50.bin"));
  EXPECT_FALSE(std::filesystem::exists(own_temporary));
  EXPECT_TRUE(std::filesystem::exists(peers_temporary));
  EXPECT_TRUE(std::filesystem::is_regular_file(not_a_step));
  EXPECT_THAT(log_, ::testing::Contains(HasSubstr("set aside " + torn + "/part-0-0.bin (a part of another run")));
}

// A checkpoint taken while the next step's round was sealed records that
// sealed step, but a restore does not bring the round back (its gradients
// are not in the part): the restored job keeps no sealed step, so that an
// attaching client never takes it for one that a commit could complete.
TEST_F(CheckpointKeepTest, ARoundSealedPastTheCheckpointsStepIsNotRestoredAsSealed) {
  Create(JobRequest("s", 1, {{"w", 100}}));
  std::mt19937_64 rng(13);
  ASSERT_TRUE(Push("s", 1, 0, {{"w", RandomBf16(rng, 100, 0.3f)}}).ok());
  ASSERT_TRUE(Commit("s", 1, 1e-3).ok());
  ASSERT_TRUE(Push("s", 2, 0, {{"w", RandomBf16(rng, 100, 0.3f)}}).ok());  // sealed, not committed
  v1::CheckpointRequest request;
  request.set_job("s");
  request.set_step(1);
  ASSERT_TRUE(store_.Checkpoint(request).ok());
  ASSERT_TRUE(store_.DropJob("s").ok());
  auto restored = store_.CreateJob(JobRequest("s", 1, {{"w", 100}}));
  ASSERT_TRUE(restored.ok()) << restored.status();
  ASSERT_TRUE(restored->restored());
  EXPECT_EQ(restored->step(), 1u);
  EXPECT_EQ(restored->sealed_step(), 0u);
  // Step 2 is pushed again and applies.
  ASSERT_TRUE(Push("s", 2, 0, {{"w", RandomBf16(rng, 100, 0.3f)}}).ok());
  EXPECT_TRUE(Commit("s", 2, 1e-3).ok());
}

// A restore_step that goes back starts a new run: the newer step
// directories, complete or torn, hold the old run's steps and are set aside
// (renamed, kept); the new run's checkpoint of step 2 is then written (not
// skipped as complete already), and a restore of the newest loads the new
// run's step 2 bitwise, not the old run's step 3. Without the set-aside the
// step-2 checkpoint writes nothing and the restore finds step 3.
class CheckpointAllTest : public CheckpointDirTest<0> {
 protected:
  // Job "k" of `r`, stepped and checkpointed at 1 ... complete, a torn step
  // after those (a server died writing it), then dropped, for a restore;
  // returns the torn step's directory.
  std::string CheckpointedThenTorn(const v1::CreateJobRequest& r, uint64_t complete, std::mt19937_64& rng) {
    Create(r);
    for (uint64_t step = 1; step <= complete; ++step) StepAndCheckpoint("k", step, 1000, rng);
    const std::string torn = checkpoint::StepDirectory(dir_, "k", complete + 1);
    std::filesystem::create_directories(torn);
    std::ofstream(torn + "/part-0-500.bin") << "partial";  // a peer's
    EXPECT_TRUE(store_.DropJob("k").ok());
    return torn;
  }
  absl::StatusOr<v1::CreateJobResponse> RestoreAt(v1::CreateJobRequest r, uint64_t step) {
    r.set_restore_step(step);
    return store_.CreateJob(r);
  }
};

TEST_F(CheckpointAllTest, ARestoreAtAnOlderStepSetsTheNewerStepsAside) {
  const v1::CreateJobRequest r = JobRequest("k", 1, {{"w", 1000}});
  std::mt19937_64 rng(13);
  const std::string torn = CheckpointedThenTorn(r, 3, rng);
  auto restored = RestoreAt(r, 1);
  ASSERT_TRUE(restored.ok()) << restored.status();
  ASSERT_TRUE(restored->restored());
  ASSERT_EQ(restored->step(), 1u);
  std::vector<std::string> left;
  const std::filesystem::path job_dir = std::filesystem::path(torn).parent_path();
  for (const auto& e : std::filesystem::directory_iterator(job_dir)) {
    const std::string name = e.path().filename().string();
    // RestoreAt dropped the job first: its life's mark is no step.
    if (!checkpoint::IsDroppedLifeMark(name)) left.push_back(name);
  }
  std::sort(left.begin(), left.end());
  ASSERT_EQ(left.size(), 4u);
  EXPECT_THAT(left[0], ::testing::StartsWith("abandoned-step-00000000000000000002-"));
  EXPECT_THAT(left[1], ::testing::StartsWith("abandoned-step-00000000000000000003-"));
  EXPECT_THAT(left[2], ::testing::StartsWith("abandoned-step-00000000000000000004-"));
  EXPECT_EQ(left[3], "step-00000000000000000001");
  EXPECT_THAT(log_, ::testing::Contains(HasSubstr("set aside checkpoint " + torn + " as ")));

  StepAndCheckpoint("k", 2, 1000, rng);  // the new run's step 2, from other gradients
  const std::string new_run = Snapshot("k");
  auto backend = MakeCpuBackend({});
  JobStore fresh(backend.get(), Options0(dir_));
  auto newest = fresh.CreateJob(r);
  ASSERT_TRUE(newest.ok()) << newest.status();
  EXPECT_EQ(newest->step(), 2u);
  EXPECT_EQ(Snapshot(fresh, "k"), new_run);
}

// A restore_step that is the newest complete checkpoint goes back past
// nothing: a newer torn step stays, as after a restore of the newest (a
// peer may still complete it).
TEST_F(CheckpointAllTest, ARestoreStepThatIsTheNewestLeavesANewerTornStep) {
  const v1::CreateJobRequest r = JobRequest("k", 1, {{"w", 1000}});
  std::mt19937_64 rng(17);
  const std::string torn = CheckpointedThenTorn(r, 2, rng);
  auto restored = RestoreAt(r, 2);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->step(), 2u);
  EXPECT_TRUE(std::filesystem::exists(torn + "/part-0-500.bin"));
}

// A checkpoint written without shapes (by a client before TensorSpec.shape)
// restores into a job asked for with them, and one written with them
// refuses another shape: the restore compares shapes where both give one.
TEST_F(CheckpointAllTest, ACheckpointWithoutShapesRestoresForACallerWithThemAndOneWithThemRefusesAnother) {
  const v1::CreateJobRequest r = JobRequest("k", 1, {{"w", 1000}});
  std::mt19937_64 rng(17);
  CheckpointedThenTorn(r, 1, rng);
  v1::CreateJobRequest shaped = r;
  shaped.mutable_tensors(0)->add_shape(10);
  shaped.mutable_tensors(0)->add_shape(100);
  auto restored = RestoreAt(shaped, 1);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_TRUE(restored->restored());
  StepAndCheckpoint("k", 2, 1000, rng);  // written by the job with shapes
  ASSERT_TRUE(store_.DropJob("k").ok());
  v1::CreateJobRequest other = r;
  other.mutable_tensors(0)->add_shape(100);
  other.mutable_tensors(0)->add_shape(10);
  const auto refused = RestoreAt(other, 2);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("shape")) << refused.status();
}

// A write that fails mid-checkpoint (here past RLIMIT_FSIZE, EFBIG) stops
// the stream, and the checkpoint answers with the disk's error, leaving no
// part: RESOURCE_EXHAUSTED, as for a full disk, not INTERNAL, which reads
// as the server's bug. The job is untouched and the next checkpoint is
// written whole.
TEST_F(CheckpointAllTest, AFailedWriteAnswersWithTheDisksErrorAndLeavesNoPart) {
  Create(JobRequest("k", 1, {{"w", 4 << 20}}));  // a 48 MiB part
  const std::string before = Snapshot("k");
  v1::CheckpointRequest request;
  request.set_job("k");
  request.set_step(0);
  rlimit old;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit small = old;
  small.rlim_cur = 16 << 20;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  const auto old_handler = signal(SIGXFSZ, SIG_IGN);  // the write fails with EFBIG instead
  auto failed = store_.Checkpoint(request);
  setrlimit(RLIMIT_FSIZE, &old);
  signal(SIGXFSZ, old_handler);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted) << failed.status();
  EXPECT_THAT(std::string(failed.status().message()), HasSubstr("cannot write")) << failed.status();
  EXPECT_THAT(std::string(failed.status().message()), HasSubstr("File too large")) << failed.status();
  const std::string step_dir = checkpoint::StepDirectory(dir_, "k", 0);
  EXPECT_TRUE(std::filesystem::is_empty(step_dir));
  EXPECT_EQ(Snapshot("k"), before);
  auto written = store_.Checkpoint(request);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_TRUE(written->complete());
}

// A restore streams the part file in pieces of 8 MiB of data, which end
// wherever they fall: here one ends inside an fp32 element of c, whose
// arrays start 2 bytes past a multiple of 4 after b's bf16 ones of odd
// length. Arrays longer than a piece, of odd element counts, after frames
// of different lengths (the job's name), all restore bitwise (master, m, v
// and the params derived from the master).
// A checkpoint asked for again, once this server wrote its part of the step
// but before a slow peer completed it, keeps that part as it is: a round
// sealed since changes the manifest (its size too), and the peer may
// already have listed the file, to name it with its size in COMMIT.
TEST_F(CheckpointAllTest, ACheckpointAskedForAgainKeepsThePartThisServerWrote) {
  constexpr uint64_t kN = 4000, kHalf = kN / 2;
  auto placement = [&](uint64_t offset) {
    v1::CreateJobRequest r = JobRequest("two", 1, {{"w", kN}});
    v1::ShardRange* shard = r.add_shards();
    shard->set_tensor("w");
    shard->set_offset(offset);
    shard->set_length(kHalf);
    return r;
  };
  auto init = [&](JobStore& store, uint64_t offset) {
    ASSERT_TRUE(store.CreateJob(placement(offset)).ok());
    const std::vector<float> values = RandomFloats(rng_, kHalf, -1, 1);
    v1::InitChunk c;
    c.set_job("two");
    c.set_tensor("w");
    c.set_offset(offset);
    c.set_dtype(v1::FP32);
    c.set_data(values.data(), kHalf * 4);
    ASSERT_EQ(store.Init(c).value_or(0), kHalf);
  };
  auto backend = MakeCpuBackend({});
  JobStore peer(backend.get(), Options0(dir_));
  init(store_, 0);
  init(peer, kHalf);
  v1::CheckpointRequest request;
  request.set_job("two");
  request.set_step(0);
  auto first = store_.Checkpoint(request);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_FALSE(first->complete());
  ASSERT_GT(first->part_bytes(), 0u);
  const std::string part = checkpoint::StepDirectory(dir_, "two", 0) + "/part-0-0.bin";
  auto read = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  const std::string bytes = read(part);
  // Step 1's round seals here: this server's manifest of step 0 now differs.
  auto session = StartPush("two", 1, 0);
  ASSERT_TRUE(session.ok());
  const auto g = RandomBf16(rng_, kHalf, 1.0f);
  ASSERT_TRUE((*session)->Add(Chunk("w", 0, g.data(), kHalf)).ok());
  ASSERT_TRUE((*session)->Finish().ok());
  auto again = store_.Checkpoint(request);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->part_bytes(), 0u);
  EXPECT_FALSE(again->complete());
  EXPECT_TRUE(read(part) == bytes) << "the part was written again";
  // The placement's state, every kind, read from where its shard starts.
  auto state = [](const JobStore& store, uint64_t offset) {
    std::string out;
    for (v1::StateKind kind : {v1::MASTER, v1::EXP_AVG, v1::EXP_AVG_SQ, v1::PARAM_BF16}) {
      v1::ReadRequest r;
      r.set_job("two");
      r.set_tensor("w");
      r.set_offset(offset);
      r.set_kind(kind);
      EXPECT_TRUE(store.Read(r, [&](const v1::StateChunk& c) {
                    out += c.data();
                    return true;
                  }).ok());
    }
    return out;
  };
  // The peer's part completes the step; both placements restore it.
  const std::string before = state(store_, 0), peer_before = state(peer, kHalf);
  auto last = peer.Checkpoint(request);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_TRUE(last->complete());
  for (const auto& [offset, snapshot] : {std::pair{uint64_t{0}, &before}, std::pair{kHalf, &peer_before}}) {
    JobStore fresh(backend.get(), Options0(dir_));
    auto restored = fresh.CreateJob(placement(offset));
    ASSERT_TRUE(restored.ok()) << restored.status();
    ASSERT_TRUE(restored->restored());
    EXPECT_EQ(restored->step(), 0u);
    EXPECT_TRUE(state(fresh, offset) == *snapshot) << "placement at " << offset;
  }
}

// A restore of a part whose pieces end anywhere is bitwise. Tensor a
// (FP32, 10 MB arrays) is read straight into the state where the part pads
// its arrays to 4096 bytes (format version 2); b (BF16) and c (too small a
// mapping) go through the read buffers. With the arrays back to back
// (version 1's layout), everything goes through the buffers, and a piece
// ends 2 bytes into one of c's elements.
// Counts the state bytes a restore wrote that were in place already (read
// straight into the state): WriteState given the state's own memory.
class InPlaceCounter final : public testing::ForwardingJobState {
 public:
  InPlaceCounter(std::unique_ptr<JobState> cpu, std::atomic<uint64_t>* in_place)
      : ForwardingJobState(std::move(cpu)), in_place_(in_place) {}
  absl::Status WriteState(uint32_t shard, StateKind kind, uint64_t offset, DType dtype, const void* data,
                          uint64_t count) override {
    const char* state = HostFp32State(shard, kind);
    if (state != nullptr && data == state + offset * 4) *in_place_ += count * 4;
    return ForwardingJobState::WriteState(shard, kind, offset, dtype, data, count);
  }

 private:
  std::atomic<uint64_t>* const in_place_;
};

template <typename Base>
class RestoreAnywhereTest : public Base {
 protected:
  // `in_place`: the bytes the restore must find read straight into place.
  void Run(uint64_t in_place) {
    for (const std::string name : {"big", "big123"}) {
      v1::CreateJobRequest r = this->JobRequest(name, 1, {{"a", 2500001}});
      v1::Group* bf16 = r.add_groups();
      *bf16 = r.groups(0);
      bf16->set_precision(v1::PRECISION_BF16);
      for (auto [tensor, numel, group] : {std::tuple{"b", 4500001, 1}, std::tuple{"c", 300003, 0}}) {
        v1::TensorSpec* t = r.add_tensors();
        t->set_name(tensor);
        t->set_numel(numel);
        t->set_group(group);
      }
      // Packed, c's sections, in data bytes, hold the 7th piece's end, 2
      // bytes into an element.
      constexpr uint64_t kCBegins = 3 * (2500001 * 4 + 4500001 * 2), kPieceEnd = 7 * checkpoint::kDirectChunkBytes;
      static_assert(kCBegins < kPieceEnd && kPieceEnd < kCBegins + 3 * 300003 * 4 && (kPieceEnd - kCBegins) % 4 == 2);
      this->Create(r);
      std::mt19937_64 rng(7);
      std::map<std::string, std::vector<uint16_t>> grads;
      for (const v1::TensorSpec& t : r.tensors()) grads[t.name()] = RandomBf16(rng, t.numel(), 0.5f);
      ASSERT_TRUE(this->Push(name, 1, 0, grads).ok());
      ASSERT_TRUE(this->Commit(name, 1, 1e-2).ok());
      v1::CheckpointRequest request;
      request.set_job(name);
      request.set_step(1);
      auto written = this->store_.Checkpoint(request);
      ASSERT_TRUE(written.ok()) << written.status();
      const std::string before = this->Snapshot(name);

      std::atomic<uint64_t> counted{0};
      // Described as the CPU backend is: Describe's device is in the snapshot.
      testing::WrappedCpuBackend backend(MakeCpuBackend({})->Describe(), [&](std::unique_ptr<JobState> cpu) {
        return std::make_unique<InPlaceCounter>(std::move(cpu), &counted);
      });
      JobStore fresh(&backend, this->Options0(this->dir_));
      auto restored = fresh.CreateJob(r);
      ASSERT_TRUE(restored.ok()) << restored.status();
      ASSERT_TRUE(restored->restored());
      // Not EXPECT_EQ: gtest would diff 60 MB strings.
      EXPECT_TRUE(this->Snapshot(fresh, name) == before) << "job " << name;
      EXPECT_EQ(counted.load(), in_place) << "job " << name;
    }
  }
};

using PaddedRestoreTest = RestoreAnywhereTest<CheckpointDirTest<2>>;
// a's master, m and v, 10 MB each, are read straight in; c's, in a small
// buffer each, and b's, BF16, are not.
TEST_F(PaddedRestoreTest, StreamedRestoreIsBitwiseWhereverThePiecesEnd) { Run(3 * 2500001 * 4); }

using PackedRestoreTest = RestoreAnywhereTest<CheckpointDirTest<2, /*kPacked=*/true>>;
TEST_F(PackedRestoreTest, StreamedRestoreOfPackedArraysIsBitwiseWhereverThePiecesEnd) { Run(0); }

}  // namespace
}  // namespace shardopt
