// Which waiting pushes a change of the job wakes. A push waiting for the
// window is woken by every change of the round (Notify), but by the sum's
// progress only if it is of the lowest unfinished rank, of a rank that just
// became some block's next, or among the two lowest-ranked other waiters
// (NotifyProgress): progress happens O(W x chunks) times a round, and waking
// all W waiters each time made the server's wakeups grow as W squared.
#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "base/pieces.h"
#include "gtest/gtest.h"
#include "server/job.h"
#include "server/job_spec.h"
#include "server/memory_budget.h"
#include "server/wakeups.h"
#include "tests/testing/store_fixture.h"

namespace shardopt {
namespace {

using testing::RandomBf16;
using testing::StoreTest;

constexpr uint32_t kWorld = 8;
constexpr uint64_t kNumel = 1000;  // one block

// A Job of its own, on the fixture's backend, not in the fixture's store.
class JobWakeupsTest : public StoreTest {
 protected:
  void SetUp() override {
    auto spec = NormalizeJobSpec(JobRequest("wakeups", kWorld, {{"w", kNumel}}), absl::Seconds(10));
    ASSERT_TRUE(spec.ok()) << spec.status();
    auto job = Job::Create(*spec, backend_.get(), 1 << 20, &wakeups_, &budget_, &tenants_, JobOwner{});
    ASSERT_TRUE(job.ok()) << job.status();
    job_ = *std::move(job);
  }

  // Registers a progress watcher for each of `ranks`, recording its wake.
  void WatchAll(const std::vector<uint32_t>& ranks) {
    absl::MutexLock lock(&job_->mu);
    for (uint32_t r : ranks) {
      job_->WatchProgress(r, [this, r] {
        absl::MutexLock woken_lock(&woken_mu_);
        woken_.insert(r);
      });
    }
  }

  // The wakes already posted, once they have all run: the wakeup thread
  // runs posts in order, so a later one runs after them.
  std::multiset<uint32_t> Woken() {
    absl::Notification drained;
    wakeups_.Post([&] { drained.Notify(); });
    drained.WaitForNotification();
    absl::MutexLock lock(&woken_mu_);
    return woken_;
  }

  // The ranks that became the block's next since the last call.
  std::vector<uint32_t> NewlyNext() {
    std::vector<uint32_t> ranks;
    absl::MutexLock lock(&job_->mu);
    job_->round.sum->DrainNewlyNext([&](uint32_t rank) { ranks.push_back(rank); });
    return ranks;
  }

  MemoryBudget budget_{uint64_t{1} << 30};
  TenantLedger tenants_;
  Wakeups wakeups_;
  std::shared_ptr<Job> job_;
  absl::Mutex woken_mu_;
  std::multiset<uint32_t> woken_ ABSL_GUARDED_BY(woken_mu_);
};

TEST_F(JobWakeupsTest, ProgressWakesTheLowestRankAndTwoMoreNotEveryWaiter) {
  // Before the round starts rank 0 is the lowest unfinished one; it has two
  // streams waiting (a retry beside the first), and both are woken.
  WatchAll({6, 3, 0, 7, 0, 5, 4});
  {
    absl::MutexLock lock(&job_->mu);
    job_->NotifyProgress();
  }
  EXPECT_EQ(Woken(), (std::multiset<uint32_t>{0, 0, 3, 4}));
  {
    absl::MutexLock lock(&job_->mu);
    job_->NotifyProgress();
  }
  EXPECT_EQ(Woken(), (std::multiset<uint32_t>{0, 0, 3, 4, 5, 6}));
  // A change of the round wakes every waiter left, and each wake runs once.
  {
    absl::MutexLock lock(&job_->mu);
    job_->Notify();
    job_->Notify();
  }
  EXPECT_EQ(Woken(), (std::multiset<uint32_t>{0, 0, 3, 4, 5, 6, 7}));
}

TEST_F(JobWakeupsTest, ARankThatBecomesTheBlocksNextIsWokenWhateverItsPlace) {
  auto offer = [&](uint32_t rank) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    const std::vector<uint16_t> grad = RandomBf16(rng_, kNumel, 1.0f);
    auto offered = job_->round.sum->Offer(*job_->state, rank, 0, 0, DType::kBf16,
                                          Pieces::Own(std::string(reinterpret_cast<const char*>(grad.data()), kNumel * 2)));
    ASSERT_TRUE(offered.ok()) << offered.status();
    EXPECT_EQ(offered->taken, kNumel);
  };
  {
    absl::MutexLock lock(&job_->mu);
    job_->StartRound(std::chrono::steady_clock::now());
    // Ranks 3 and 4 wait in the window; nothing moved yet.
    offer(3);
    offer(4);
  }
  EXPECT_TRUE(NewlyNext().empty());
  {
    absl::MutexLock lock(&job_->mu);
    offer(0);
    offer(1);
  }
  EXPECT_EQ(NewlyNext(), (std::vector<uint32_t>{1, 2}));
  // Rank 5 waits (for room, say) behind lower-ranked waiters (of other
  // blocks, say), as does 7.
  WatchAll({1, 2, 5, 7});
  {
    absl::MutexLock lock(&job_->mu);
    offer(2);  // the block's next was 2: then 3, whose windowed chunk folds, 4, and now 5
    job_->NotifyProgress();
  }
  // 5 became the block's next; 1 and 2 are the two lowest others; 0, the
  // lowest unfinished rank, has no stream waiting.
  EXPECT_EQ(Woken(), (std::multiset<uint32_t>{1, 2, 5}));
  EXPECT_TRUE(NewlyNext().empty()) << "each is woken once";
}

TEST_F(JobWakeupsTest, StreamsOfFinishedRanksDoNotTakeTheTwoPlaces) {
  {
    absl::MutexLock lock(&job_->mu);
    job_->StartRound(std::chrono::steady_clock::now());
    // Ranks 0 and 1 finish without a gradient: rank 2 is the lowest now.
    for (uint32_t r : {0u, 1u}) ASSERT_TRUE(job_->round.sum->Finish(*job_->state, r, {true}).ok());
    ASSERT_EQ(job_->round.sum->lowest_unfinished(), 2u);
  }
  NewlyNext();  // what those finishes moved, woken with them in the server
  // Leftover streams of 0 and 1 (a retry, one already cut), and three
  // waiters above the lowest.
  WatchAll({0, 1, 4, 5, 6});
  {
    absl::MutexLock lock(&job_->mu);
    job_->NotifyProgress();
  }
  EXPECT_EQ(Woken(), (std::multiset<uint32_t>{0, 1, 4, 5}));
}

TEST_F(JobWakeupsTest, ProgressWithoutTheLowestRankWaitingWakesTwo) {
  WatchAll({5, 2, 7, 1});
  {
    absl::MutexLock lock(&job_->mu);
    job_->NotifyProgress();
  }
  EXPECT_EQ(Woken(), (std::multiset<uint32_t>{1, 2}));
}

}  // namespace
}  // namespace shardopt
