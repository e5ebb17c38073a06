// The running sum that replaced per-rank gradient slots: bitwise the
// rank-order sum whatever the arrival order, the chunking (and the pieces a
// chunk's bytes arrive in), the ranks without a gradient and a window small
// enough that pushes must wait for it; and a refused push that was partly
// summed restarts the round cleanly.
#include <algorithm>
#include <atomic>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/reference.h"
#include "tests/testing/store_fixture.h"

namespace shardopt {
namespace {

using ::testing::HasSubstr;
using testing::RandomBf16;
using testing::ReferenceTensor;
using testing::StoreTest;

constexpr AdamWHyper kHyper = testing::kDefaultHyper;

JobStoreOptions SmallWindow() {
  JobStoreOptions o;
  o.window_bytes = 0;  // raised to the smallest the store allows: a few blocks
  return o;
}

class RunningSumTest : public StoreTest {
 protected:
  RunningSumTest() : StoreTest(SmallWindow()) {}
};

TEST_F(RunningSumTest, AnyArrivalOrderAndChunkingThroughAFullWindowGivesTheRankOrderSum) {
  constexpr uint32_t kWorld = 6;
  const std::vector<testing::TensorDef> tensors = {{"w", 70001}, {"b", 333}, {"e", 40000}};
  auto init = Create(JobRequest("wave", kWorld, tensors));
  std::map<std::string, ReferenceTensor> ref;
  for (const auto& t : tensors) ref.emplace(t.name, ReferenceTensor(kHyper, init[t.name], false));
  for (uint64_t step = 1; step <= 3; ++step) {
    std::vector<std::map<std::string, std::vector<uint16_t>>> grads(kWorld);
    for (auto& g : grads) {
      for (const auto& t : tensors) g[t.name] = RandomBf16(rng_, t.numel, 1.0f);
    }
    // Rank 3 has no gradient for "e" (torch: grad is None on that rank).
    grads[3].erase("e");
    // Ranks start in reverse order, each with its own chunk size and order.
    std::vector<std::thread> ranks;
    std::vector<double> sums(kWorld, -1);
    for (int r = kWorld - 1; r >= 0; --r) {
      const uint64_t chunk = 1000 + 777 * r, order = step * 100 + r;
      const std::vector<std::string> no_grad = r == 3 ? std::vector<std::string>{"e"} : std::vector<std::string>{};
      ranks.emplace_back([&, r, chunk, order, no_grad] {
        // Odd ranks' chunks arrive in pieces split at any byte, as gRPC's slices do.
        auto pushed = Push("wave", step, r, grads[r], chunk, order, no_grad, r % 2 == 1 ? order : 0);
        EXPECT_TRUE(pushed.ok()) << "rank " << r << ": " << pushed.status();
        if (pushed.ok()) sums[r] = pushed->sum_squares();
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    for (auto& t : ranks) t.join();
    // The server's sum of squares: the fixed tree over its shards in order,
    // of the rank-order sum.
    double want = 0;
    for (const auto& t : tensors) {
      std::vector<float> agg(t.numel);
      for (uint64_t i = 0; i < t.numel; ++i) {
        bool any = false;
        for (uint32_t r = 0; r < kWorld; ++r) {
          if (!grads[r].count(t.name)) continue;
          const float g = math::bf16_to_float(grads[r][t.name][i]);
          agg[i] = any ? agg[i] + g : g;
          any = true;
        }
      }
      want = testing::TreeSumsq(agg, want);
    }
    for (uint32_t r = 0; r < kWorld; ++r) EXPECT_EQ(sums[r], want) << "rank " << r << " step " << step;
    ASSERT_TRUE(Commit("wave", step, 1e-3, 1.0f / kWorld).ok());
    for (const auto& t : tensors) {
      std::vector<const uint16_t*> in_order;
      for (uint32_t r = 0; r < kWorld; ++r) {
        if (grads[r].count(t.name)) in_order.push_back(grads[r][t.name].data());
      }
      ref.at(t.name).Step(in_order, 1e-3, 1.0f / kWorld);
      EXPECT_EQ(ReadFloats("wave", t.name, v1::MASTER), ref.at(t.name).p) << t.name << " step " << step;
    }
  }
  auto described = store_.Describe("wave");
  ASSERT_TRUE(described.ok());
  // 4 B/param of sum and 2 B/param of params out (padded per shard), and the
  // window's cap: nothing that grows with the ranks.
  EXPECT_LE(described->staging_bytes(), (70001 + 333 + 40000 + 3 * 64) * 6 + 4 * RunningSum::kBlock * 4);
}

// A push stream reads its next message only while what the job's pushes
// hold fits the window (PushSession::MayRead), except the lowest rank still
// pushing, whose chunks always fold: it reads regardless, and when it
// finishes the next rank may, and is woken to ask again.
TEST_F(RunningSumTest, OnlyTheLowestRankStillPushingReadsPastAFullWindow) {
  constexpr uint64_t kN = 3 * RunningSum::kBlock;
  auto init = Create(JobRequest("gate", 3, {{"w", kN}}));
  std::vector<std::vector<uint16_t>> g;
  for (int r = 0; r < 3; ++r) g.push_back(RandomBf16(rng_, kN, 1.0f));
  std::vector<std::unique_ptr<JobStore::PushSession>> s;
  for (uint32_t r = 0; r < 3; ++r) {
    auto session = StartPush("gate", 1, r);
    ASSERT_TRUE(session.ok());
    s.push_back(*std::move(session));
  }
  std::atomic<int> woken[3] = {0, 0, 0};
  auto wake = [&](int r) { return [&woken, r] { ++woken[r]; }; };
  // A read is expected at 1 MiB until a stream has sent a chunk: past the
  // smallest window (two fp32 blocks). A small chunk of rank 2 waits in the window,
  // and a read of that size fits beside it.
  EXPECT_FALSE(*s[2]->MayRead(wake(2)));
  ASSERT_TRUE(s[2]->Add(Chunk("w", 0, g[2].data(), 1000)).ok());
  EXPECT_TRUE(*s[2]->MayRead(wake(2)));
  // Rank 0, the lowest, reads whatever is held; then its read is held too,
  // and nobody else's fits.
  EXPECT_TRUE(*s[0]->MayRead(wake(0)));
  EXPECT_FALSE(*s[1]->MayRead(wake(1)));
  EXPECT_FALSE(*s[2]->MayRead(wake(2)));
  // Rank 0 pushes all and finishes; rank 1, now the lowest, is woken and reads.
  ASSERT_TRUE(s[0]->Add(Chunk("w", 0, g[0].data(), kN)).ok());
  auto sealed0 = s[0]->TrySeal([] {});
  ASSERT_TRUE(sealed0.ok() && !*sealed0);  // waiting for the others
  for (int i = 0; i < 500 && woken[1] == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_GT(woken[1], 0);
  EXPECT_TRUE(*s[1]->MayRead(wake(1)));
  ASSERT_TRUE(s[1]->Add(Chunk("w", 0, g[1].data(), kN)).ok());
  ASSERT_TRUE(s[2]->Add(Chunk("w", 1000, g[2].data() + 1000, kN - 1000)).ok());
  std::thread rank1([&] { EXPECT_TRUE(s[1]->Finish().ok()); });
  EXPECT_TRUE(s[2]->Finish().ok());
  rank1.join();
  ASSERT_TRUE(Commit("gate", 1, 1e-3, 1.0f / 3).ok());
  ReferenceTensor ref(kHyper, init["w"], false);
  ref.Step({g[0].data(), g[1].data(), g[2].data()}, 1e-3, 1.0f / 3);
  EXPECT_EQ(ReadFloats("gate", "w", v1::MASTER), ref.p);
}

// A read is counted at the most a stream's chunks carry: what its first
// message said (at most the window), or the largest chunk it has sent, not
// its last chunk. Counted at its last chunk, a small chunk after a large one
// let reads of the large size through past the window (an outside probe: 24
// ranks' reads held 63 MB against an 8 MiB cap).
TEST_F(RunningSumTest, AReadIsCountedAtTheMostTheStreamSaidOrSentNotAtItsLastChunk) {
  constexpr uint64_t kN = 4 * RunningSum::kBlock;
  constexpr uint64_t kHalf = RunningSum::MinWindowBytes() / 4;  // bf16 elements of half the smallest window
  constexpr uint64_t kSmall = 100;
  static_assert(kHalf + kSmall <= kN);
  std::map<std::string, std::vector<float>> init;
  const auto g0 = RandomBf16(rng_, kN, 1.0f), g1 = RandomBf16(rng_, kN, 1.0f);
  // Rank 1 pushes ahead of rank 0, so its chunks wait in the window.
  const auto rank1_ahead = [&](const std::string& job, uint64_t said, std::vector<uint64_t> sizes) {
    init = Create(JobRequest(job, 2, {{"w", kN}}));
    auto s0 = StartPush(job, 1, 0), s1 = StartPush(job, 1, 1, said);
    EXPECT_TRUE(s0.ok() && s1.ok());
    uint64_t off = 0;
    for (uint64_t n : sizes) {
      EXPECT_TRUE((*s1)->Add(Chunk("w", off, g1.data() + off, n)).ok());
      off += n;
    }
    const bool may = *(*s1)->MayRead([] {});
    EXPECT_TRUE((*s0)->Add(Chunk("w", 0, g0.data(), kN)).ok());
    EXPECT_TRUE((*s1)->Add(Chunk("w", off, g1.data() + off, kN - off)).ok());
    std::thread rank0([&] { EXPECT_TRUE((*s0)->Finish().ok()); });
    EXPECT_TRUE((*s1)->Finish().ok());
    rank0.join();
    EXPECT_TRUE(Commit(job, 1, 1e-3, 0.5f).ok());
    ReferenceTensor ref(kHyper, init["w"], false);
    ref.Step({g0.data(), g1.data()}, 1e-3, 0.5f);
    EXPECT_EQ(ReadFloats(job, "w", v1::MASTER), ref.p) << job;
    return may;
  };
  // A small chunk waits: a read of its size fits beside it.
  EXPECT_TRUE(rank1_ahead("small", 0, {kSmall}));
  // Half the window waits, then a small chunk: a read of the large size no
  // longer fits beside them, whether the stream said nothing or said less.
  EXPECT_FALSE(rank1_ahead("sent", 0, {kHalf, kSmall}));
  EXPECT_FALSE(rank1_ahead("said-less", 1, {kHalf, kSmall}));
  // A stream that says its chunks may be as large as anything is counted
  // at the window (a sum past 2^64 would have let it through).
  EXPECT_FALSE(rank1_ahead("said-most", UINT64_MAX, {kSmall}));
}

// The smallest window takes a rank's fp32 block ahead of its turn, entry
// and all: with only one block's bytes, no fp32 chunk of a rank that is
// not next ever fitted, and every rank waited for all the lower ones.
TEST_F(RunningSumTest, TheSmallestWindowTakesFp32BlocksAheadOfTheirTurn) {
  constexpr uint64_t kN = 2 * RunningSum::kBlock;
  v1::CreateJobRequest request = JobRequest("fp32", 2, {{"w", kN}});
  request.set_grad_dtype(v1::FP32);
  auto init = Create(request);
  const std::vector<std::vector<float>> g = {testing::RandomFloats(rng_, kN, -1, 1),
                                             testing::RandomFloats(rng_, kN, -1, 1)};
  auto block = [&](uint32_t rank, uint64_t offset, v1::GradChunk* head) {
    head->set_tensor("w");
    head->set_offset(offset);
    head->set_dtype(v1::FP32);
    return Pieces::Own(std::string(reinterpret_cast<const char*>(g[rank].data() + offset), RunningSum::kBlock * 4));
  };
  std::vector<std::unique_ptr<JobStore::PushSession>> s;
  for (uint32_t r = 0; r < 2; ++r) {
    auto session = StartPush("fp32", 1, r);
    ASSERT_TRUE(session.ok());
    s.push_back(*std::move(session));
  }
  // Rank 1 comes first: both of its blocks wait in the window, at once.
  for (uint64_t off = 0; off < kN; off += RunningSum::kBlock) {
    v1::GradChunk head;
    Pieces data = block(1, off, &head);
    auto taken = s[1]->Offer(head, std::move(data), {}, [] {});
    ASSERT_TRUE(taken.ok()) << taken.status();
    EXPECT_TRUE(*taken) << "rank 1's block at " << off << " found no room in the window";
  }
  for (uint64_t off = 0; off < kN; off += RunningSum::kBlock) {
    v1::GradChunk head;
    Pieces data = block(0, off, &head);
    ASSERT_TRUE(s[0]->Add(head, std::move(data)).ok());
  }
  std::thread rank1([&] { EXPECT_TRUE(s[1]->Finish().ok()); });
  EXPECT_TRUE(s[0]->Finish().ok());
  rank1.join();
  ASSERT_TRUE(Commit("fp32", 1, 1e-3).ok());
  std::vector<float> sum(kN);
  for (uint64_t i = 0; i < kN; ++i) sum[i] = g[0][i] + g[1][i];
  ReferenceTensor ref(kHyper, init["w"], false);
  ref.StepAggregated(sum, 1e-3, 1.0f);
  EXPECT_EQ(ReadFloats("fp32", "w", v1::MASTER), ref.p);
}

// The lowest rank still pushing may read its next message while it folds
// the last (PushSession::ReadAhead), since its chunks never wait for the
// window; nobody else may. That read is held as MayRead's would be, so the
// others' reads still fit the window with it counted.
TEST_F(RunningSumTest, OnlyTheLowestRankReadsAheadAndItsReadIsHeld) {
  constexpr uint64_t kN = 6 * RunningSum::kBlock;
  // 2/5 of the smallest window in bf16: two chunks and a read fit, three do not.
  constexpr uint64_t kChunk = RunningSum::MinWindowBytes() / 5;
  auto init = Create(JobRequest("ahead", 2, {{"w", kN}}));
  const auto g0 = RandomBf16(rng_, kN, 1.0f), g1 = RandomBf16(rng_, kN, 1.0f);
  auto s0 = StartPush("ahead", 1, 0), s1 = StartPush("ahead", 1, 1);
  ASSERT_TRUE(s0.ok() && s1.ok());
  auto& r0 = **s0;
  auto& r1 = **s1;
  EXPECT_FALSE(r0.ReadAhead());  // not in the round before its first chunk
  ASSERT_TRUE(r0.Add(Chunk("w", 0, g0.data(), kChunk)).ok());
  // Rank 1's chunk lies in a block rank 0 is not yet done with: it waits in the window.
  constexpr uint64_t kLate = 4 * RunningSum::kBlock;  // past rank 0's first two chunks
  static_assert(2 * kChunk <= kLate && kLate + kChunk <= kN);
  ASSERT_TRUE(r1.Add(Chunk("w", kLate, g1.data() + kLate, kChunk)).ok());
  EXPECT_FALSE(r1.ReadAhead());
  EXPECT_TRUE(*r1.MayRead([] {}));  // its chunk and one read of that size fit
  EXPECT_TRUE(r0.ReadAhead());
  ASSERT_TRUE(r0.Add(Chunk("w", kChunk, g0.data() + kChunk, kChunk)).ok());
  // Rank 0's read ahead is held now: rank 1's next read no longer fits.
  EXPECT_FALSE(*r1.MayRead([] {}));
  // Rank 0's next chunk arrives without another read ahead: it holds nothing.
  ASSERT_TRUE(r0.Add(Chunk("w", 2 * kChunk, g0.data() + 2 * kChunk, kN - 2 * kChunk)).ok());
  EXPECT_TRUE(*r1.MayRead([] {}));
  ASSERT_TRUE(r1.Add(Chunk("w", 0, g1.data(), kLate)).ok());
  ASSERT_TRUE(r1.Add(Chunk("w", kLate + kChunk, g1.data() + kLate + kChunk, kN - kLate - kChunk)).ok());
  std::thread rank0([&] { EXPECT_TRUE(r0.Finish().ok()); });
  EXPECT_TRUE(r1.Finish().ok());
  rank0.join();
  ASSERT_TRUE(Commit("ahead", 1, 1e-3, 0.5f).ok());
  ReferenceTensor ref(kHyper, init["w"], false);
  ref.Step({g0.data(), g1.data()}, 1e-3, 0.5f);
  EXPECT_EQ(ReadFloats("ahead", "w", v1::MASTER), ref.p);
}

TEST_F(RunningSumTest, ARefusedPushThatWasPartlySummedRestartsTheRound) {
  auto init = Create(JobRequest("restart", 2, {{"w", 50000}}));
  const auto g0 = RandomBf16(rng_, 50000, 1.0f), g1 = RandomBf16(rng_, 50000, 1.0f);
  // Rank 1 waits at the barrier, its gradient windowed behind rank 0's.
  absl::StatusOr<v1::PushResponse> first_of_rank1;
  std::thread rank1([&] { first_of_rank1 = Push("restart", 1, 1, {{"w", g1}}); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  {
    auto session = StartPush("restart", 1, 0);
    ASSERT_TRUE(session.ok());
    ASSERT_TRUE((*session)->Add(Chunk("w", 0, g0.data(), 20000)).ok());  // summed at once: rank 0 is first
    v1::GradChunk odd = Chunk("w", 20000, g0.data() + 20000, 1);
    odd.mutable_data()->resize(1);
    EXPECT_EQ((*session)->Add(odd).code(), absl::StatusCode::kInvalidArgument);
  }
  rank1.join();
  EXPECT_EQ(first_of_rank1.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(first_of_rank1.status().message()), HasSubstr("rank 0's push was refused"));
  // Both push again: the step is as if the refused stream never came.
  std::thread again([&] { EXPECT_TRUE(Push("restart", 1, 1, {{"w", g1}}).ok()); });
  EXPECT_TRUE(Push("restart", 1, 0, {{"w", g0}}).ok());
  again.join();
  ASSERT_TRUE(Commit("restart", 1, 1e-3, 0.5f).ok());
  ReferenceTensor ref(kHyper, init["w"], false);
  ref.Step({g0.data(), g1.data()}, 1e-3, 0.5f);
  EXPECT_EQ(ReadFloats("restart", "w", v1::MASTER), ref.p);
}

TEST_F(RunningSumTest, AStreamCutOffAfterPartOfItWasSummedKeepsItAndItsRetryCountsOnce) {
  auto init = Create(JobRequest("cut", 1, {{"w", 40000}}));
  const auto g = RandomBf16(rng_, 40000, 1.0f);
  {
    auto session = StartPush("cut", 1, 0);
    ASSERT_TRUE(session.ok());
    ASSERT_TRUE((*session)->Add(Chunk("w", 0, g.data(), 30000)).ok());
  }  // the connection dropped: no error was answered
  ASSERT_TRUE(Push("cut", 1, 0, {{"w", g}}).ok());  // the retry sends it all again
  ASSERT_TRUE(Commit("cut", 1, 1e-3).ok());
  ReferenceTensor ref(kHyper, init["w"], false);
  ref.Step({g.data()}, 1e-3, 1.0f);
  EXPECT_EQ(ReadFloats("cut", "w", v1::MASTER), ref.p);
}

}  // namespace
}  // namespace shardopt
