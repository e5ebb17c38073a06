#include "kernels/cpu/thread_pool.h"

namespace shardopt::cpu {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::RunItems() {
  std::unique_lock<std::mutex> lock(mu_);
  ++busy_;
  while (next_ < n_) {
    const size_t i = next_++;
    const auto* fn = fn_;
    lock.unlock();
    (*fn)(i);
    lock.lock();
  }
  if (--busy_ == 0) done_.notify_all();
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    RunItems();
  }
}

void ThreadPool::ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  std::lock_guard<std::mutex> call_lock(call_mu_);
  if (workers_.empty() || n == 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    next_ = 0;
    ++generation_;
  }
  wake_.notify_all();
  RunItems();
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return busy_ == 0 && next_ >= n_; });
  fn_ = nullptr;
}

}  // namespace shardopt::cpu
