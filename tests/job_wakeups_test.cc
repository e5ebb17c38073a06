// Which waiting pushes a change of the job wakes. A push waiting for the
// window is woken by every change of the round (Notify), but by the sum's
// progress only if it is of the lowest unfinished rank, of a rank that just
// became some block's next, or among the two lowest-ranked other waiters
// (NotifyProgress): progress happens O(W x chunks) times a round, and waking
// all W waiters each time made the server's wakeups grow as W squared.
#include <chrono>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "base/pieces.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/job.h"
#include "server/job_spec.h"
#include "server/memory_budget.h"
#include "server/wakeups.h"

namespace shardopt {
namespace {

constexpr uint32_t kWorld = 8;
constexpr uint64_t kNumel = 1000;  // one block

class JobWakeupsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    v1::CreateJobRequest request;
    request.set_job("wakeups");
    request.set_world_size(kWorld);
    v1::Group* g = request.add_groups();
    g->set_beta1(0.9);
    g->set_beta2(0.999);
    g->set_eps(1e-8f);
    v1::TensorSpec* t = request.add_tensors();
    t->set_name("w");
    t->set_numel(kNumel);
    auto spec = NormalizeJobSpec(request, absl::Seconds(10));
    ASSERT_TRUE(spec.ok()) << spec.status();
    auto job = Job::Create(*spec, backend_.get(), 1 << 20, &wakeups_, &budget_);
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

  std::unique_ptr<Backend> backend_ = MakeCpuBackend({});
  MemoryBudget budget_{uint64_t{1} << 30};
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
  std::mt19937 rng(7);
  auto offer = [&](uint32_t rank) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    std::string bf16(kNumel * 2, '\0');
    for (char& c : bf16) c = static_cast<char>(rng() & 0x3f);  // small finite values
    auto offered = job_->round.sum->Offer(*job_->state, rank, 0, 0, DType::kBf16, Pieces::Own(std::move(bf16)));
    ASSERT_TRUE(offered.ok()) << offered.status();
    EXPECT_EQ(offered->taken, kNumel);
  };
  {
    absl::MutexLock lock(&job_->mu);
    job_->StartRound(std::chrono::steady_clock::now());
    // Ranks 3 and 4 wait in the window; nothing moved yet.
    offer(3);
    offer(4);
    EXPECT_TRUE(job_->round.sum->TakeNewlyNext().empty());
    offer(0);
    offer(1);
    EXPECT_EQ(job_->round.sum->TakeNewlyNext(), (std::vector<uint32_t>{1, 2}));
  }
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
  absl::MutexLock lock(&job_->mu);
  EXPECT_TRUE(job_->round.sum->TakeNewlyNext().empty()) << "each is woken once";
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
