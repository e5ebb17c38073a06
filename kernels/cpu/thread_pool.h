// A fixed set of worker threads for data-parallel loops. Work is handed out as
// item indices, so what each item computes never depends on which thread or
// how many threads run it.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace shardopt::cpu {

class ThreadPool {
 public:
  // `threads` counts the calling thread, which works too. 0 means one per core.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }
  // Runs fn(i) for every i in [0, n) and returns when all are done. Calls from
  // several threads are serialized.
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn);

 private:
  void WorkerLoop();
  void RunItems();

  std::mutex call_mu_;  // one ParallelFor at a time
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(size_t)>* fn_ = nullptr;
  size_t n_ = 0;
  size_t next_ = 0;
  size_t busy_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace shardopt::cpu
