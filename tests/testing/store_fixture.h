// The job store driven directly, as the service drives it: a fixture that
// creates jobs, pushes, commits and reads them back, shared by the tests of
// the step protocol.
#pragma once

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/job_store.h"
#include "tests/testing/reference.h"

namespace shardopt::testing {

struct TensorDef {
  std::string name;
  uint64_t numel;
};

class StoreTest : public ::testing::Test {
 protected:
  // `backend`: the CPU's when null.
  explicit StoreTest(JobStoreOptions options = {}, std::unique_ptr<Backend> backend = nullptr)
      : backend_(backend ? std::move(backend) : MakeCpuBackend({2, cpu::BestIsa()})),
        store_(backend_.get(), std::move(options)) {}

  v1::CreateJobRequest JobRequest(const std::string& job, uint32_t world, const std::vector<TensorDef>& tensors,
                                  v1::Precision precision = v1::PRECISION_FP32, uint32_t barrier_ms = 10000) {
    v1::CreateJobRequest r;
    r.set_job(job);
    r.set_world_size(world);
    v1::Group* g = r.add_groups();
    g->set_beta1(kDefaultHyper.beta1);
    g->set_beta2(kDefaultHyper.beta2);
    g->set_eps(kDefaultHyper.eps);
    g->set_weight_decay(kDefaultHyper.weight_decay);
    g->set_precision(precision);
    for (const TensorDef& t : tensors) {
      v1::TensorSpec* s = r.add_tensors();
      s->set_name(t.name);
      s->set_numel(t.numel);
    }
    r.set_barrier_timeout_ms(barrier_ms);
    return r;
  }

  // An Init message of fp32 master values for `tensor` from offset 0.
  static v1::InitChunk Fp32Init(const std::string& job, const std::string& tensor, const std::vector<float>& values) {
    v1::InitChunk c;
    c.set_job(job);
    c.set_tensor(tensor);
    c.set_dtype(v1::FP32);
    c.set_data(values.data(), values.size() * 4);
    return c;
  }

  // Creates the job and gives every tensor random initial values.
  std::map<std::string, std::vector<float>> Create(const v1::CreateJobRequest& r) {
    EXPECT_TRUE(store_.CreateJob(r).ok());
    std::map<std::string, std::vector<float>> init;
    for (const v1::TensorSpec& t : r.tensors()) {
      init[t.name()] = RandomFloats(rng_, t.numel(), -1, 1);
      auto written = store_.Init(Fp32Init(r.job(), t.name(), init[t.name()]));
      EXPECT_EQ(written.value_or(0), t.numel()) << written.status();
    }
    return init;
  }

  static v1::GradChunk Chunk(const std::string& tensor, uint64_t offset, const uint16_t* data, uint64_t n) {
    v1::GradChunk c;
    c.set_tensor(tensor);
    c.set_offset(offset);
    c.set_dtype(v1::BF16);
    c.set_data(data, n * 2);
    return c;
  }

  // A push stream's first message, opening a session, on `store` (a
  // restarted server's) or on store_; `chunk_bytes` is what it says of its
  // chunks' size (0: nothing, as older clients).
  static absl::StatusOr<std::unique_ptr<JobStore::PushSession>> StartPush(JobStore& store, const std::string& job,
                                                                          uint64_t step, uint32_t rank,
                                                                          uint64_t chunk_bytes = 0) {
    v1::GradChunk head;
    head.set_job(job);
    head.set_step(step);
    head.set_rank(rank);
    head.set_chunk_bytes(chunk_bytes);
    return store.BeginPush(head);
  }
  absl::StatusOr<std::unique_ptr<JobStore::PushSession>> StartPush(const std::string& job, uint64_t step, uint32_t rank,
                                                                   uint64_t chunk_bytes = 0) {
    return StartPush(store_, job, step, rank, chunk_bytes);
  }

  // `bytes` as gRPC may deliver a message's data: cut at random bytes (odd
  // ones too, so elements are split between pieces), each piece in a buffer
  // of its own at an odd address.
  static Pieces Scatter(const std::string& bytes, std::mt19937_64& rng) {
    auto buffers = std::make_shared<std::vector<std::string>>();
    std::vector<size_t> cuts = {0, bytes.size()};
    for (int i = rng() % 6; i > 0; --i) cuts.push_back(rng() % (bytes.size() + 1));
    std::sort(cuts.begin(), cuts.end());
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      buffers->push_back("x" + bytes.substr(cuts[i], cuts[i + 1] - cuts[i]));
    }
    std::vector<absl::string_view> views;
    for (const std::string& b : *buffers) views.push_back(absl::string_view(b).substr(1));
    return Pieces(std::move(views), buffers);
  }

  // One rank's push, chunks of `chunk` elements sent in `order` (a seed for
  // shuffling; 0 keeps them in order). With `scatter` (a seed), each chunk's
  // data arrives in pieces (Scatter).
  absl::StatusOr<v1::PushResponse> Push(const std::string& job, uint64_t step, uint32_t rank,
                                        const std::map<std::string, std::vector<uint16_t>>& grads,
                                        uint64_t chunk = 1000, uint64_t order = 0,
                                        const std::vector<std::string>& no_grad = {}, uint64_t scatter = 0,
                                        const v1::StepIntent* intent = nullptr) {
    std::vector<v1::GradChunk> chunks;
    for (const auto& [name, g] : grads) {
      for (uint64_t off = 0; off < g.size(); off += chunk) {
        chunks.push_back(Chunk(name, off, g.data() + off, std::min(chunk, g.size() - off)));
      }
    }
    if (order != 0) std::shuffle(chunks.begin(), chunks.end(), std::mt19937_64(order));
    v1::GradChunk head;
    head.set_job(job);
    head.set_step(step);
    head.set_rank(rank);
    for (const auto& n : no_grad) head.add_no_grad(n);
    if (intent != nullptr) *head.mutable_intent() = *intent;
    auto session = store_.BeginPush(head);
    if (!session.ok()) return session.status();
    if (auto st = (*session)->Add(head); !st.ok()) return st;
    std::mt19937_64 cutter(scatter);
    for (const auto& c : chunks) {
      v1::GradChunk chunk_head = c;
      chunk_head.clear_data();
      const Pieces data = scatter == 0 ? Pieces::Own(c.data()) : Scatter(c.data(), cutter);
      if (auto st = (*session)->Add(std::move(chunk_head), data); !st.ok()) return st;
    }
    return (*session)->Finish();
  }

  static v1::CommitRequest CommitRequestFor(const std::string& job, uint64_t step, double lr, float gscale = 1.0f,
                                            bool skip = false) {
    v1::CommitRequest r;
    r.set_job(job);
    r.set_step(step);
    r.set_lr(lr);
    r.set_gscale(gscale);
    r.set_skip(skip);
    return r;
  }

  absl::StatusOr<std::map<std::string, std::vector<uint16_t>>> Commit(const std::string& job, uint64_t step, double lr,
                                                                      float gscale = 1.0f, bool skip = false) {
    const v1::CommitRequest r = CommitRequestFor(job, step, lr, gscale, skip);
    std::map<std::string, std::vector<uint16_t>> params;
    auto st = store_.Commit(r, [&](const v1::ParamChunk& c) {
      auto& p = params[c.tensor()];
      const uint64_t n = c.data().size() / 2;
      if (p.size() < c.offset() + n) p.resize(c.offset() + n);
      std::memcpy(p.data() + c.offset(), c.data().data(), n * 2);
      return true;
    });
    if (!st.ok()) return st;
    return params;
  }

  std::vector<float> ReadFloats(const std::string& job, const std::string& tensor, v1::StateKind kind) {
    return ReadFloats(store_, job, tensor, kind);
  }
  static std::vector<float> ReadFloats(const JobStore& store, const std::string& job, const std::string& tensor,
                                       v1::StateKind kind) {
    const std::string bytes = ReadBytes(store, job, tensor, kind);
    std::vector<float> out(bytes.size() / 4);
    std::memcpy(out.data(), bytes.data(), out.size() * 4);
    return out;
  }
  // A tensor's state of `kind` as Read sends it: fp32, or bf16 for the params.
  static std::string ReadBytes(const JobStore& store, const std::string& job, const std::string& tensor,
                               v1::StateKind kind) {
    const size_t esize = kind == v1::PARAM_BF16 ? 2 : 4;
    v1::ReadRequest r;
    r.set_job(job);
    r.set_tensor(tensor);
    r.set_kind(kind);
    std::string out;
    EXPECT_TRUE(store.Read(r, [&](const v1::StateChunk& c) {
                  out.resize(std::max<size_t>(out.size(), c.offset() * esize + c.data().size()));
                  out.replace(c.offset() * esize, c.data().size(), c.data());
                  return true;
                }).ok());
    return out;
  }

  // Everything a refusal must leave alone.
  std::string Snapshot(const std::string& job) { return Snapshot(store_, job); }
  static std::string Snapshot(const JobStore& store, const std::string& job) {
    auto d = store.Describe(job);
    EXPECT_TRUE(d.ok());
    // The server's memory in use is the server's, not the job's: a push in
    // flight holds some of it.
    d->clear_memory_used_bytes();
    // Nor is the open round's progress the job's state (a refused push may
    // leave the round it started open, as docs/design.md section 4.1 says).
    d->clear_waiting_for();
    d->clear_barrier_seconds_left();
    std::string s = d->SerializeAsString();
    for (const auto& t : d->tensors()) {
      for (v1::StateKind k : {v1::MASTER, v1::EXP_AVG, v1::EXP_AVG_SQ, v1::PARAM_BF16}) {
        s += ReadBytes(store, job, t.name(), k);
      }
    }
    return s;
  }

  std::mt19937_64 rng_{1234};
  std::unique_ptr<Backend> backend_;
  JobStore store_;
};

}  // namespace shardopt::testing
