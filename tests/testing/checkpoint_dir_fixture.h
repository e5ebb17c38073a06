// A store whose checkpoints go to a fresh temporary directory: the fixture
// of the tests that write checkpoints and restore them.
#pragma once

#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "server/job_store.h"
#include "tests/testing/store_fixture.h"

namespace shardopt::testing {

// Keeps `kKeep` checkpoints per job (0: all), its log lines kept for the
// test to read. `backend`: the CPU's when null; `after_snapshot_slice`: the
// store's seam (JobStoreOptions); `kPacked`: parts with their arrays back
// to back, as format version 1 wrote them (JobStoreOptions).
template <uint64_t kKeep, bool kPacked = false>
class CheckpointDirTest : public StoreTest {
 protected:
  explicit CheckpointDirTest(std::unique_ptr<Backend> backend = nullptr,
                             std::function<void()> after_snapshot_slice = nullptr)
      : StoreTest(Options(std::move(after_snapshot_slice)), std::move(backend)) {}
  ~CheckpointDirTest() override { std::filesystem::remove_all(dir_); }
  static JobStoreOptions Options(std::function<void()> after_snapshot_slice = nullptr) {
    char tmpl[] = "/tmp/shardopt-checkpoints-XXXXXX";
    dir_ = mkdtemp(tmpl);
    log_.clear();
    JobStoreOptions o;
    o.checkpoint_dir = dir_;
    o.checkpoint_keep = kKeep;
    o.checkpoint_log = [](const std::string& line) { log_.push_back(line); };
    o.after_snapshot_slice = std::move(after_snapshot_slice);
    o.checkpoint_packed_arrays = kPacked;
    return o;
  }
  // Another store's options on the same directory, that keeps every checkpoint.
  static JobStoreOptions Options0(const std::string& dir) {
    JobStoreOptions o;
    o.checkpoint_dir = dir;
    o.checkpoint_log = [](const std::string&) {};
    return o;
  }
  // One step of `job`'s one tensor "w" of `numel` elements, from random
  // gradients, then its checkpoint, which must be written and complete.
  void StepAndCheckpoint(const std::string& job, uint64_t step, uint64_t numel, std::mt19937_64& rng) {
    ASSERT_TRUE(Push(job, step, 0, {{"w", RandomBf16(rng, numel, 0.3f)}}).ok());
    ASSERT_TRUE(Commit(job, step, 1e-3).ok());
    v1::CheckpointRequest request;
    request.set_job(job);
    request.set_step(step);
    auto written = store_.Checkpoint(request);
    ASSERT_TRUE(written.ok()) << written.status();
    EXPECT_TRUE(written->complete());
    EXPECT_GT(written->part_bytes(), 0u) << "step " << step << " was not written";
  }

  static inline std::string dir_;
  static inline std::vector<std::string> log_;
};

}  // namespace shardopt::testing
