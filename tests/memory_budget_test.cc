// The server's one memory budget: its arithmetic and flag syntax; jobs
// charged before they are built and given back when dropped; barrier
// tracking that does not grow with world_size x tensors; a checkpoint's
// buffers. Against the store
// directly, where the process's own RSS is the server's.
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "checkpoint/direct_io.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/checkpoint_buffers.h"
#include "server/memory_budget.h"
#include "server/metrics.h"
#include "server/tenant_ledger.h"
#include "tests/testing/store_fixture.h"
#include "tests/testing/wrapped_cpu_backend.h"

namespace shardopt {
namespace {

using ::testing::HasSubstr;
using testing::StoreTest;

// This process's resident set, from /proc.
uint64_t RssBytes() {
  std::ifstream in("/proc/self/statm");
  uint64_t pages = 0, resident = 0;
  in >> pages >> resident;
  return resident * 4096;
}

TEST(MemoryBudgetTest, ChargesGrowShrinkAndReturnWhenDestroyed) {
  MemoryBudget budget(1000);
  {
    auto a = budget.Reserve(600, "job 'a'");
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(budget.used(), 600u);
    auto b = budget.Reserve(500, "job 'b'");
    EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(std::string(b.status().message()), HasSubstr("job 'b' needs 500 bytes"));
    EXPECT_THAT(std::string(b.status().message()), HasSubstr("has 400 left"));
    EXPECT_EQ(budget.used(), 600u);  // a refusal holds nothing
    EXPECT_TRUE(a->Grow(400, "more").ok());
    EXPECT_FALSE(a->Grow(1, "one more").ok());
    EXPECT_EQ(a->bytes(), 1000u);
    a->Shrink(300);
    EXPECT_EQ(budget.used(), 700u);
    MemoryBudget::Charge moved = *std::move(a);
    EXPECT_EQ(budget.used(), 700u);
  }
  EXPECT_EQ(budget.used(), 0u);
  EXPECT_EQ(budget.Reserve(1001, "x").status().code(), absl::StatusCode::kResourceExhausted);
}

// A Checkpoint call's buffers when the budget has no room for them: while
// another checkpoint holds buffers, the call waits for them to come back,
// until its deadline; with none to wait for it is refused at once.
TEST(CheckpointBuffersTest, ACallWaitsForAnotherCheckpointsBuffersUntilItsDeadline) {
  MemoryBudget budget(100);
  CheckpointBuffers buffers(&budget);
  auto first = buffers.Take(60, "a checkpoint of job 'a'", absl::InfiniteFuture());
  ASSERT_TRUE(first.ok()) << first.status();
  std::atomic<bool> done{false};
  absl::StatusOr<CheckpointBuffers::Held> second = absl::UnknownError("not yet");
  std::thread waiter([&] {
    second = buffers.Take(60, "a checkpoint of job 'b'", absl::Now() + absl::Seconds(30));
    done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(done);  // waits, holding nothing
  EXPECT_EQ(budget.used(), 60u);
  *first = CheckpointBuffers::Held();  // the first checkpoint ends
  waiter.join();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(budget.used(), 60u);

  // Until its deadline, then the budget's refusal, saying it waited.
  const absl::Time asked = absl::Now();
  auto late = buffers.Take(60, "a checkpoint of job 'c'", asked + absl::Milliseconds(300));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(late.status().message()), HasSubstr("a checkpoint of job 'c' needs 60 bytes"));
  EXPECT_THAT(std::string(late.status().message()), HasSubstr("until the call's deadline"));
  EXPECT_GE(absl::Now() - asked, absl::Milliseconds(300));
  EXPECT_EQ(budget.used(), 60u);

  // Nothing to wait for when what holds the budget is not a checkpoint.
  *second = CheckpointBuffers::Held();
  auto messages = budget.Reserve(50, "stream messages");
  ASSERT_TRUE(messages.ok());
  const absl::Time again = absl::Now();
  auto refused = buffers.Take(60, "a checkpoint of job 'd'", absl::InfiniteFuture());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.status().message()), ::testing::Not(HasSubstr("waited")));
  EXPECT_LT(absl::Now() - again, absl::Seconds(1));
  EXPECT_EQ(budget.used(), 50u);
}

// The drain stops the waits: a call waiting its turn holds its job's
// checkpoint, which the drain must write. The waits end with the drain's
// status, not as a want of room (which counts as a failed checkpoint).
TEST(CheckpointBuffersTest, StopWaitingEndsTheWaitsAndAnyLaterOne) {
  MemoryBudget budget(100);
  CheckpointBuffers buffers(&budget);
  auto first = buffers.Take(60, "a checkpoint of job 'a'", absl::InfiniteFuture());
  ASSERT_TRUE(first.ok());
  absl::StatusOr<CheckpointBuffers::Held> waiting = absl::UnknownError("not yet");
  std::thread waiter([&] { waiting = buffers.Take(60, "a checkpoint of job 'b'", absl::InfiniteFuture()); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  buffers.StopWaiting(absl::UnavailableError("stopping"));
  waiter.join();
  EXPECT_EQ(waiting.status(), absl::UnavailableError("stopping"));
  const absl::Time asked = absl::Now();
  EXPECT_EQ(buffers.Take(60, "x", absl::InfiniteFuture()).status(), absl::UnavailableError("stopping"));
  EXPECT_LT(absl::Now() - asked, absl::Seconds(1));
  EXPECT_EQ(budget.used(), 60u);
  *first = CheckpointBuffers::Held();  // nothing to wait for: still the drain's status, and room is taken
  auto messages = budget.Reserve(50, "stream messages");
  EXPECT_EQ(buffers.Take(60, "y", absl::InfiniteFuture()).status(), absl::UnavailableError("stopping"));
  messages->Release();
  EXPECT_TRUE(buffers.Take(60, "z", absl::InfiniteFuture()).ok());
}

TEST(MemoryBudgetTest, ParsesKubernetesQuantitiesAndDefaultsBelowTheMachine) {
  EXPECT_EQ(*MemoryBudget::ParseLimit("2Gi"), uint64_t{2} << 30);
  EXPECT_EQ(*MemoryBudget::ParseLimit("512M"), uint64_t{512} * 1000 * 1000);
  EXPECT_EQ(*MemoryBudget::ParseLimit("67108864"), uint64_t{64} << 20);
  // Digits only, as the tokens file's max_memory: SimpleAtoi took "512 M".
  for (const char* bad : {"", "0", "-1", "12X", "Gi", "1.5Gi", "99999999999999999999", "512 M", " 512M", "+1Gi"}) {
    EXPECT_FALSE(MemoryBudget::ParseLimit(bad).ok()) << bad;
  }
  // A budget that holds no job started, and refused every CreateJob (a
  // probe's --memory_limit=100).
  for (const char* small : {"100", "1K", "67108863"}) {
    const auto refused = MemoryBudget::ParseLimit(small);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << small;
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("under 64Mi")) << small;
  }
  std::string found;
  const uint64_t limit = MemoryBudget::DefaultLimit(&found);
  const uint64_t physical = uint64_t(sysconf(_SC_PHYS_PAGES)) * uint64_t(sysconf(_SC_PAGE_SIZE));
  EXPECT_GT(limit, 0u);
  EXPECT_LE(limit, physical - (uint64_t{256} << 20));
  EXPECT_THAT(found, HasSubstr("headroom"));
  EXPECT_EQ(*MemoryBudget::ParseLimit("auto"), limit);
  // More than the machine (or the cgroup) gives is refused: such a budget
  // would refuse nothing before the OOM killer stopped the server.
  const auto too_much = MemoryBudget::ParseLimit(absl::StrCat(physical / 1000 + 1, "K"));
  EXPECT_EQ(too_much.status().code(), absl::StatusCode::kInvalidArgument) << too_much.status();
  EXPECT_THAT(std::string(too_much.status().message()), HasSubstr("is more than this process may use"));
}

class BudgetTest : public StoreTest {
 protected:
  static constexpr uint64_t kLimit = uint64_t{96} << 20;
  BudgetTest() : StoreTest(Options()) {}
  static JobStoreOptions Options() {
    JobStoreOptions o;
    o.memory_limit = kLimit;
    o.window_bytes = 1 << 20;
    return o;
  }
};

// A job is charged before anything of it is built: one over the budget is
// refused, naming what it needs and what is left, and holds nothing; jobs
// fill the budget until the next is refused; a dropped job's charge comes
// back, and the store's other jobs step throughout.
TEST_F(BudgetTest, JobsAreChargedBeforeTheyAreBuiltAndGiveItBackWhenDropped) {
  Create(JobRequest("victim", 1, {{"w", 4096}}));
  const uint64_t base = store_.budget()->used();
  const uint64_t rss = RssBytes();
  auto huge = store_.CreateJob(JobRequest("huge", 1, {{"w", uint64_t{1200} * 1000 * 1000}}));
  ASSERT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(huge.status().message()), HasSubstr("job 'huge' needs"));
  EXPECT_THAT(std::string(huge.status().message()), HasSubstr("left"));
  EXPECT_EQ(store_.budget()->used(), base);
  EXPECT_LT(RssBytes(), rss + (uint64_t{64} << 20));  // nothing was zeroed
  EXPECT_EQ(store_.Describe("huge").status().code(), absl::StatusCode::kNotFound);

  // 1M fp32 params: 18 MiB of state and staging each.
  int made = 0;
  absl::Status refused;
  for (; made < 10; ++made) {
    auto r = store_.CreateJob(JobRequest(absl::StrCat("fill", made), 1, {{"w", 1 << 20}}));
    if (!r.ok()) {
      refused = r.status();
      break;
    }
  }
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_GE(made, 3);
  EXPECT_LE(store_.budget()->used(), kLimit);
  const uint64_t full = store_.budget()->used();
  // The victim still steps.
  std::mt19937_64 rng(7);
  const std::vector<uint16_t> g = testing::RandomBf16(rng, 4096, 1.0f);
  EXPECT_TRUE(Push("victim", 1, 0, {{"w", g}}).ok());
  EXPECT_TRUE(Commit("victim", 1, 1e-2, 1.0f).ok());

  ASSERT_TRUE(store_.DropJob("fill0").ok());
  EXPECT_LT(store_.budget()->used(), full);
  EXPECT_TRUE(store_.CreateJob(JobRequest("again", 1, {{"w", 1 << 20}})).ok());
}

// A tenant's jobs hold at most its cap, counted as Describe counts them; a
// refused create builds nothing and says why; another tenant, or one
// without a cap, is not held back; attaching costs nothing; a drop gives
// the job's bytes back to its maker.
TEST_F(StoreTest, EachOwnersJobsHoldAtMostItsCap) {
  ASSERT_TRUE(store_.CreateJob(JobRequest("probe", 1, {{"w", 1 << 16}})).ok());
  const auto d = store_.Describe("probe");
  ASSERT_TRUE(d.ok());
  const uint64_t job_bytes = d->state_bytes() + d->staging_bytes() + d->bookkeeping_bytes();
  EXPECT_TRUE(store_.TenantBytes().empty());  // a job made with no owner (no tokens) is nobody's
  ASSERT_TRUE(store_.DropJob("probe").ok());
  // Alice's third job passes the check before it is built (its state and
  // window alone fit) and is refused once built, at its whole size.
  const JobOwner alice{"alice", job_bytes * 3 - 100}, bob{"bob", job_bytes * 5 / 2}, root{"root", 0};

  ASSERT_TRUE(store_.CreateJob(JobRequest("a1", 1, {{"w", 1 << 16}}), alice).ok());
  ASSERT_TRUE(store_.CreateJob(JobRequest("a2", 1, {{"w", 1 << 16}}), alice).ok());
  const uint64_t used = store_.budget()->used();
  auto third = store_.CreateJob(JobRequest("a3", 1, {{"w", 1 << 16}}), alice);
  ASSERT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted) << third.status();
  EXPECT_THAT(std::string(third.status().message()),
              HasSubstr(absl::StrCat("'alice' may hold ", alice.max_bytes, " bytes of jobs on this server (max_memory ",
                                     "in the tokens file); its jobs hold ", 2 * job_bytes, ", and job 'a3' needs ",
                                     job_bytes)));
  EXPECT_EQ(store_.Describe("a3").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_.budget()->used(), used);  // nothing of it is held
  // Attaching to a job costs nothing, whoever made it.
  EXPECT_TRUE(store_.CreateJob(JobRequest("a1", 1, {{"w", 1 << 16}}), alice).ok());
  EXPECT_TRUE(store_.CreateJob(JobRequest("a2", 1, {{"w", 1 << 16}}), bob).ok());
  // Others have caps of their own, or none.
  EXPECT_TRUE(store_.CreateJob(JobRequest("b1", 1, {{"w", 1 << 16}}), bob).ok());
  EXPECT_TRUE(store_.CreateJob(JobRequest("b2", 1, {{"w", 1 << 16}}), bob).ok());
  EXPECT_EQ(store_.CreateJob(JobRequest("b3", 1, {{"w", 1 << 16}}), bob).status().code(),
            absl::StatusCode::kResourceExhausted);
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(store_.CreateJob(JobRequest(absl::StrCat("r", i), 1, {{"w", 1 << 16}}), root).ok());
  }
  EXPECT_THAT(store_.TenantBytes(),
              ::testing::UnorderedElementsAre(::testing::Pair("alice", 2 * job_bytes),
                                              ::testing::Pair("bob", 2 * job_bytes),
                                              ::testing::Pair("root", 4 * job_bytes)));
  // A drop gives the bytes back to the job's maker, not to whoever attached.
  ASSERT_TRUE(store_.DropJob("a2").ok());
  EXPECT_EQ(store_.CreateJob(JobRequest("b3", 1, {{"w", 1 << 16}}), bob).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(store_.CreateJob(JobRequest("a3", 1, {{"w", 1 << 16}}), alice).ok());
}

// A job of many small tensors is mostly bookkeeping, which its maker's cap
// counts, as the budget does: an outside probe's capped token made such
// jobs until they held 85% of the budget, while its cap, which counted
// state and staging alone, saw a third of its own. On the CPU what Describe
// reports is what the budget charged, to the byte.
TEST_F(StoreTest, AMakersCapCountsTheBookkeepingOfManySmallTensors) {
  std::vector<testing::TensorDef> tiny;
  for (int i = 0; i < 16000; ++i) tiny.push_back({absl::StrCat(i, std::string(150, 'x')), static_cast<uint64_t>(1 + i % 40)});
  const uint64_t used = store_.budget()->used();
  ASSERT_TRUE(store_.CreateJob(JobRequest("measured", 2, tiny)).ok());
  const v1::DescribeResponse d = store_.Describe("measured").value();
  EXPECT_EQ(store_.budget()->used() - used, d.state_bytes() + d.staging_bytes() + d.bookkeeping_bytes());
  // The two sides above come from one computation; the documented
  // per-tensor charge (design.md, section 11) is counted here apart from it.
  uint64_t per_tensor = 0;
  for (const testing::TensorDef& t : tiny) per_tensor += 1024 + 6 * t.name.size();
  EXPECT_GE(d.bookkeeping_bytes(), per_tensor);
  EXPECT_GT(d.bookkeeping_bytes(), d.state_bytes() + d.staging_bytes());
  const JobOwner capped{"capped", 2 * (d.state_bytes() + d.staging_bytes())};
  const auto refused = store_.CreateJob(JobRequest("tiny", 2, tiny), capped);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("needs at least"));
  EXPECT_EQ(store_.budget()->used() - used, d.state_bytes() + d.staging_bytes() + d.bookkeeping_bytes());
  const JobOwner roomy{"roomy", d.state_bytes() + d.staging_bytes() + d.bookkeeping_bytes()};
  ASSERT_TRUE(store_.CreateJob(JobRequest("tiny", 2, tiny), roomy).ok());
  EXPECT_THAT(store_.TenantBytes(), ::testing::ElementsAre(::testing::Pair("roomy", roomy.max_bytes)));
}

// Jobs may not take the budget's last kept_for_streams() bytes: a tenant
// that made the largest job that fits (found by bisecting, as a probe did,
// leaving 2 bytes) used to leave every other job unable to push a message.
// Now the other job still steps, and the largest job leaves the reserve.
TEST_F(BudgetTest, TheLargestJobThatFitsLeavesRoomForTheOthersToStep) {
  Create(JobRequest("victim", 1, {{"w", 4096}}));
  uint64_t lo = 1, hi = uint64_t{1} << 24;  // numel: lo fits, hi does not
  while (hi - lo > 1) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (store_.CreateJob(JobRequest("probe", 1, {{"w", mid}})).ok()) {
      ASSERT_TRUE(store_.DropJob("probe").ok());
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const auto refused = store_.CreateJob(JobRequest("hog", 1, {{"w", hi}}));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("of which a job may not take the last"));
  ASSERT_TRUE(store_.CreateJob(JobRequest("hog", 1, {{"w", lo}})).ok());
  EXPECT_GE(store_.budget()->limit() - store_.budget()->used(), store_.budget()->kept_for_streams());
  EXPECT_EQ(store_.budget()->kept_for_streams(), MemoryBudget::kKeptAtLeast);  // a quarter of 96 MiB is less
  std::mt19937_64 rng(7);
  for (uint64_t t = 1; t <= 2; ++t) {
    EXPECT_TRUE(Push("victim", t, 0, {{"w", testing::RandomBf16(rng, 4096, 1.0f)}}).ok());
    EXPECT_TRUE(Commit("victim", t, 1e-2, 1.0f).ok());
  }
}

// The barrier's tracking of a round: a rank that pushes one element of one
// tensor costs a few hundred bytes, whether the job has 20 tensors or 2000;
// before, each pushing rank held an interval set per tensor (2000 x 48 B),
// and 65536 ranks of a 2-byte push each took about 6 GB.
TEST_F(BudgetTest, BarrierTrackingDoesNotGrowWithWorldSizeTimesTensors) {
  constexpr uint32_t kWorld = 65536;
  auto per_rank = [&](const std::string& job, int tensors, uint32_t ranks) {
    std::vector<testing::TensorDef> defs;
    for (int i = 0; i < tensors; ++i) defs.push_back({absl::StrCat("t", i), 1});
    Create(JobRequest(job, kWorld, defs));
    const uint64_t before = store_.budget()->used();
    const uint64_t rss = RssBytes();
    std::vector<std::unique_ptr<JobStore::PushSession>> sessions;
    const uint16_t one = 0x3f80;  // 1.0
    for (uint32_t r = 0; r < ranks; ++r) {
      auto s = StartPush(job, 1, r);
      EXPECT_TRUE(s.ok()) << s.status();
      if (!s.ok()) break;
      EXPECT_TRUE((*s)->Add(Chunk("t0", 0, &one, 1)).ok());
      sessions.push_back(*std::move(s));
    }
    const double bytes = static_cast<double>(store_.budget()->used() - before) / ranks;
    const double rss_per_rank = static_cast<double>(RssBytes() - std::min(RssBytes(), rss)) / ranks;
    std::printf("%s: %d tensors, %u ranks pushed: %.0f B/rank charged, %.0f B/rank RSS\n", job.c_str(), tensors,
                ranks, bytes, rss_per_rank);
    sessions.clear();
    EXPECT_TRUE(store_.DropJob(job).ok());
    return std::make_pair(bytes, rss_per_rank);
  };
  const auto [narrow, narrow_rss] = per_rank("narrow", 20, 8192);
  const auto [wide, wide_rss] = per_rank("wide", 2000, kWorld);
  EXPECT_GT(narrow, 0);
  EXPECT_LT(wide, 2 * narrow + 64);          // independent of the number of tensors
  EXPECT_LT(wide_rss, 2 * 1024.0);           // was about 96 KB per rank
  EXPECT_LE(store_.budget()->used(), kLimit);
}

// Every rank creates the job at once. One CreateJob builds it while the
// others wait and attach, so a job the budget holds once (but not twice)
// is created for all of them; before, each built its own, charged it, and
// all but one were refused. Building takes 100 ms here (the state's
// allocation is held up), so the ranks' calls all come while it builds.
class SlowBuildBudgetTest : public StoreTest {
 protected:
  SlowBuildBudgetTest()
      : StoreTest(BudgetOptions(), std::make_unique<testing::WrappedCpuBackend>(
                                       MakeCpuBackend({})->Describe(), [this](std::unique_ptr<JobState> s) {
                                         builds_begun_++;
                                         std::this_thread::sleep_for(std::chrono::milliseconds(100));
                                         return s;
                                       })) {}
  static JobStoreOptions BudgetOptions() {
    JobStoreOptions o;
    o.memory_limit = uint64_t{96} << 20;
    return o;
  }
  // Allocations begun: a CreateJob is building its job from then on.
  std::atomic<int> builds_begun_{0};
};

// A drop of a job that a CreateJob is building (allocating, or restoring
// from a checkpoint, which can take seconds) waits for it and drops it: it
// answered NOT_FOUND, and the job appeared after the operator was told so.
TEST_F(SlowBuildBudgetTest, ADropWhileTheJobIsBeingBuiltDropsItOnceBuilt) {
  std::thread create([&] { ASSERT_TRUE(store_.CreateJob(JobRequest("building", 1, {{"w", 4096}})).ok()); });
  for (int i = 0; i < 1000 && builds_begun_ == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_EQ(builds_begun_, 1);
  EXPECT_TRUE(store_.DropJob("building").ok());
  create.join();
  EXPECT_EQ(store_.Describe("building").status().code(), absl::StatusCode::kNotFound);
}

// A job whose state alone is past its maker's cap is refused before it is
// built: it takes nothing from the budget, or the device, that other
// tenants' jobs could be refused for meanwhile.
TEST_F(SlowBuildBudgetTest, AJobPastItsMakersCapIsRefusedBeforeItIsBuilt) {
  // 12 MiB of state, a 4 MiB window and a few KiB of bookkeeping, in a 96
  // MiB budget, against 10 MiB.
  auto refused = store_.CreateJob(JobRequest("past-cap", 1, {{"w", 1 << 20}}), JobOwner{"alice", 10 << 20});
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("'alice' may hold 10485760 bytes of jobs on this server (max_memory in the tokens file); its "
                        "jobs hold 0, and job 'past-cap' needs at least "));
  EXPECT_THAT(std::string(refused.status().message()), ::testing::ContainsRegex("needs at least 167[89][0-9]{4}:"));
  EXPECT_EQ(builds_begun_, 0);
  EXPECT_EQ(store_.budget()->used(), 0u);
  EXPECT_TRUE(store_.CreateJob(JobRequest("under-cap", 1, {{"w", 1 << 16}}), JobOwner{"alice", 10 << 20}).ok());
  EXPECT_EQ(builds_begun_, 1);
}

TEST_F(SlowBuildBudgetTest, RanksCreatingOneJobAtOnceAllGetIt) {
  constexpr int kRanks = 8;
  // 27 MiB of state and staging and a 32 MiB window: a budget of 96 MiB holds one.
  const v1::CreateJobRequest request = JobRequest("shared", kRanks, {{"w", 3 << 19}});
  std::vector<absl::StatusOr<v1::CreateJobResponse>> answers(kRanks);
  std::atomic<int> ready{0};
  std::vector<std::thread> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      ++ready;
      while (ready < kRanks) std::this_thread::yield();
      answers[r] = store_.CreateJob(request);
    });
  }
  for (std::thread& t : ranks) t.join();
  int created = 0;
  for (const auto& a : answers) {
    ASSERT_TRUE(a.ok()) << a.status();
    created += a->created();
  }
  EXPECT_EQ(created, 1);
}

// A checkpoint's writer holds at most SequentialWriter::kMostBytes of
// buffers, charged while it runs: a server without room for them refuses
// the checkpoint, naming it, and writes nothing (a wrong step is still
// FAILED_PRECONDITION); with room it writes, and the charge comes back.
class CheckpointBudgetTest : public StoreTest {
 protected:
  // `after_slice`: the store's seam (JobStoreOptions::after_snapshot_slice).
  explicit CheckpointBudgetTest(uint64_t limit = uint64_t{64} << 20, std::function<void()> after_slice = nullptr)
      : StoreTest(Options(limit, std::move(after_slice))) {}
  ~CheckpointBudgetTest() override { std::filesystem::remove_all(dir_); }
  static JobStoreOptions Options(uint64_t limit, std::function<void()> after_slice) {
    char tmpl[] = "/tmp/shardopt-budget-XXXXXX";
    dir_ = mkdtemp(tmpl);
    JobStoreOptions o;
    o.memory_limit = limit;
    o.window_bytes = 1 << 20;
    o.checkpoint_dir = dir_;
    o.after_snapshot_slice = std::move(after_slice);
    return o;
  }
  absl::StatusOr<v1::CheckpointResponse> CheckpointStep0(const std::string& job = "j",
                                                         absl::Time deadline = absl::InfiniteFuture()) {
    v1::CheckpointRequest r;
    r.set_job(job);
    r.set_step(0);
    return store_.Checkpoint(r, deadline);
  }
  static inline std::string dir_;
};

// The failures of `job`'s checkpoints so far, as Prometheus reads them (the
// registry is the process's: compare before and after).
double CheckpointFailures(const std::string& job = "j") {
  const std::string text = metrics::Registry::Default().Render();
  const std::string key = absl::StrCat("\nshardopt_checkpoint_failures_total{job=\"", job, "\"} ");
  const size_t at = text.find(key);
  return at == std::string::npos ? -1 : std::stod(text.substr(at + key.size()));
}

// Streams' messages holding what jobs leave of the budget, but for less than
// a checkpoint's buffers.
MemoryBudget::Charge HoldAllButLessThanACheckpoint(MemoryBudget* budget) {
  const uint64_t left = budget->limit() - budget->used();
  return budget->Reserve(left - checkpoint::SequentialWriter::kMostBytes + 1, "stream messages").value();
}

// A checkpoint the budget has no room for counts as a failed one (the job's
// state is no more durable than if its write had failed, and an alert on
// failures must see it); one of a wrong step is the caller's mistake.
TEST_F(CheckpointBudgetTest, ACheckpointsBuffersAreChargedWhileItWrites) {
  Create(JobRequest("j", 1, {{"w", 1 << 20}}));  // 18 MiB of state and staging
  const double failures = CheckpointFailures();
  ASSERT_GE(failures, 0);
  // Jobs leave room for one checkpoint: another job that would take it is
  // refused; messages of streams may hold it.
  EXPECT_EQ(store_.CreateJob(JobRequest("filler", 1, {{"w", 1 << 20}})).status().code(),
            absl::StatusCode::kResourceExhausted);
  auto streams = HoldAllButLessThanACheckpoint(store_.budget());
  const uint64_t used = store_.budget()->used();
  ASSERT_LT(store_.budget()->limit() - used, checkpoint::SequentialWriter::kMostBytes);
  v1::CheckpointRequest future;
  future.set_job("j");
  future.set_step(1);
  auto wrong_step = store_.Checkpoint(future);  // the step is checked first, whatever the budget
  EXPECT_EQ(wrong_step.status().code(), absl::StatusCode::kFailedPrecondition) << wrong_step.status();
  auto refused = CheckpointStep0();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("a checkpoint of job 'j' needs"));
  EXPECT_EQ(CheckpointFailures(), failures + 1);  // the wrong step is not counted, the want of room is
  EXPECT_TRUE(std::filesystem::is_empty(dir_));
  EXPECT_EQ(store_.budget()->used(), used);

  streams.Release();
  const uint64_t alone = store_.budget()->used();
  ASSERT_GE(store_.budget()->limit() - alone, checkpoint::SequentialWriter::kMostBytes);
  auto written = CheckpointStep0();
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_TRUE(written->complete());
  EXPECT_EQ(store_.budget()->used(), alone);
}

// Two jobs that checkpoint at once on a server their state fills: what jobs
// leave holds one checkpoint's buffers, so the second waits for the first's
// instead of being refused (a probe's second job at 160Mi was refused, and a
// trainer's checkpoint_every fails its step on that). The first holds its
// buffers at the seam after its first slice until the second has asked.
class TwoCheckpointsTest : public CheckpointBudgetTest {
 protected:
  TwoCheckpointsTest()
      : CheckpointBudgetTest(uint64_t{128} << 20, [] {
          ++slices_;
          while (hold_) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }) {}
  static inline std::atomic<bool> hold_{false};
  static inline std::atomic<int> slices_{0};
};

TEST_F(TwoCheckpointsTest, JobsThatCheckpointAtOnceOnAFullServerTakeTurns) {
  Create(JobRequest("a", 1, {{"w", 2 << 20}}));
  Create(JobRequest("b", 1, {{"w", 2 << 20}}));
  const uint64_t jobs = store_.budget()->used();
  const uint64_t left = store_.budget()->limit() - jobs;
  ASSERT_GE(left, checkpoint::SequentialWriter::kMostBytes);
  ASSERT_LT(left, 2 * checkpoint::SequentialWriter::kMostBytes);  // not both at once

  hold_ = true;
  absl::StatusOr<v1::CheckpointResponse> a = absl::UnknownError("not yet");
  std::thread first([&] { a = CheckpointStep0("a", absl::InfiniteFuture()); });
  for (int i = 0; i < 10000 && slices_ == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_GT(slices_, 0) << "the first checkpoint never streamed";
  std::atomic<bool> b_done{false};
  absl::StatusOr<v1::CheckpointResponse> b = absl::UnknownError("not yet");
  std::thread second([&] {
    b = CheckpointStep0("b", absl::Now() + absl::Seconds(60));
    b_done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(b_done) << b.status();
  hold_ = false;
  first.join();
  second.join();
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(a->complete());
  EXPECT_TRUE(b->complete());
  EXPECT_EQ(store_.budget()->used(), jobs);
}

// The drain ends a wait for buffers at once: the waiting call holds its
// job's checkpoint, which the drain writes. The call is told the server is
// stopping, and it counts as no failed checkpoint (an alert would fire).
TEST_F(TwoCheckpointsTest, TheDrainEndsAWaitForBuffersAndCheckpointsBothJobs) {
  Create(JobRequest("a", 1, {{"w", 2 << 20}}));
  Create(JobRequest("b", 1, {{"w", 2 << 20}}));
  hold_ = true;
  absl::StatusOr<v1::CheckpointResponse> a = absl::UnknownError("not yet");
  std::thread first([&] { a = CheckpointStep0("a"); });
  for (int i = 0; i < 10000 && slices_ == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_GT(slices_, 0) << "the first checkpoint never streamed";
  const double failures_of_b = CheckpointFailures("b");
  ASSERT_GE(failures_of_b, 0);
  std::atomic<bool> b_done{false};
  absl::StatusOr<v1::CheckpointResponse> b = absl::UnknownError("not yet");
  std::thread second([&] {
    b = CheckpointStep0("b");
    b_done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ASSERT_FALSE(b_done) << b.status();
  std::vector<std::pair<std::string, absl::StatusOr<v1::CheckpointResponse>>> drained;
  std::thread drain([&] { drained = store_.DrainAndCheckpoint(); });
  for (int i = 0; i < 5000 && !b_done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_TRUE(b_done) << "the drain left the wait going";
  hold_ = false;
  first.join();
  second.join();
  drain.join();
  EXPECT_EQ(b.status().code(), absl::StatusCode::kUnavailable) << b.status();
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("shutting down"));
  EXPECT_EQ(CheckpointFailures("b"), failures_of_b);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(drained.size(), 2u);
  for (const auto& [job, written] : drained) {
    ASSERT_TRUE(written.ok()) << job << ": " << written.status();
    EXPECT_TRUE(written->complete()) << job;
  }
}

// SIGTERM's checkpoints are not refused for want of budget: their buffers,
// one checkpoint at a time, are the headroom's.
TEST_F(CheckpointBudgetTest, TheDrainCheckpointsEvenWithTheBudgetFull) {
  Create(JobRequest("j", 1, {{"w", 1 << 20}}));
  auto streams = HoldAllButLessThanACheckpoint(store_.budget());
  ASSERT_LT(store_.budget()->limit() - store_.budget()->used(), checkpoint::SequentialWriter::kMostBytes);
  auto drained = store_.DrainAndCheckpoint();
  ASSERT_EQ(drained.size(), 1u);
  ASSERT_TRUE(drained[0].second.ok()) << drained[0].second.status();
  EXPECT_TRUE(drained[0].second->complete());
}

}  // namespace
}  // namespace shardopt
