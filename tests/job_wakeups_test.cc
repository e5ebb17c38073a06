// Which waiting pushes a change of the job wakes. A push waiting for the
// window is woken by every change of the round (Notify), but by the sum's
// progress only if it is of the lowest unfinished rank or among the two
// lowest-ranked waiters (NotifyProgress): progress happens O(W x chunks)
// times a round, and waking all W waiters each time made the server's
// wakeups grow as W squared.
#include <memory>
#include <set>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/job.h"
#include "server/job_spec.h"
#include "server/memory_budget.h"
#include "server/wakeups.h"

namespace shardopt {
namespace {

constexpr uint32_t kWorld = 8;

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
    t->set_numel(1000);
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
