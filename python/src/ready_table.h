// The extension's hand-off of gradients from backward to an overlap push
// (python/src/module.cc, PyClient::StartPush and Mark).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <vector>

namespace shardopt::python {

// Gradients that become ready during backward, one slot per tensor of a
// PushInOrder's order. Python's autograd hooks fill slots (Mark), the
// client's per-server threads wait on them (Wait) without ever touching the
// GIL.
class ReadyTable {
 public:
  void Reset(size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    data_.assign(n, nullptr);
    ready_.assign(n, false);
  }
  // Slot i's data; a slot is marked once a step (the Python side refuses
  // a second gradient before it gets here), and a second mark is ignored.
  void Mark(size_t i, const void* data) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ready_.at(i)) return;
      data_[i] = data;
      ready_[i] = true;
    }
    cv_.notify_all();
  }
  // Marks every slot not yet marked as "no gradient".
  void MarkRest() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < ready_.size(); ++i) ready_[i] = true;
    }
    cv_.notify_all();
  }
  // Whether Wait(i) would answer at once: the push then asks for slot i on
  // gRPC's callback thread, not on its own (PushInOrder's `ready`).
  bool Ready(size_t i) {
    std::lock_guard<std::mutex> lock(mu_);
    return ready_[i];
  }
  const void* Wait(size_t i) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return ready_[i]; });
    return data_[i];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<const void*> data_;
  std::vector<bool> ready_;
};

}  // namespace shardopt::python
