#include "tests/scale/scale_job.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "tests/testing/reference.h"

namespace shardopt::scale {
namespace {

uint64_t Mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t Key(uint64_t seed, uint64_t step, uint64_t rank, uint64_t tensor) {
  return Mix(Mix(Mix(Mix(seed) ^ step) ^ rank) ^ tensor);
}

}  // namespace

JobOptions MakeJob(const std::string& name, uint32_t world_size, uint32_t barrier_timeout_ms, uint32_t size) {
  JobOptions job;
  job.name = name;
  job.world_size = world_size;
  job.groups = {{"all", kHyper.beta1, kHyper.beta2, kHyper.eps, kHyper.weight_decay, kHyper.lr_multiplier}};
  job.tensors = {{"w", 40000ull * size, 0}, {"b", 5000ull * size, 0}, {"gain", 64ull * size, 0}};
  job.barrier_timeout_ms = barrier_timeout_ms;
  return job;
}

std::vector<uint16_t> Gradient(uint64_t seed, uint64_t step, uint32_t rank, uint32_t tensor, uint64_t numel) {
  const uint64_t key = Key(seed, step, rank, tensor);
  std::vector<uint16_t> out(numel);
  for (uint64_t i = 0; i < numel; ++i) {
    const uint64_t h = Mix(key ^ i);
    // Sign, a binade in [2^-20, 2^0) and 7 mantissa bits: never zero. The
    // 20 binades plus bf16's 8 bits exceed fp32's 24, so sums of a few of
    // them round, and the order of addition shows in the bits.
    const uint32_t exponent = 107 + static_cast<uint32_t>((h >> 8) % 20);
    out[i] = static_cast<uint16_t>(((h & 1) << 15) | (exponent << 7) | ((h >> 1) & 0x7F));
  }
  return out;
}

std::vector<float> InitialValues(uint64_t seed, uint32_t tensor, uint64_t numel) {
  const uint64_t key = Key(seed, ~0ull, ~0ull, tensor);
  std::vector<float> out(numel);
  for (uint64_t i = 0; i < numel; ++i) {
    out[i] = static_cast<float>(static_cast<double>(Mix(key ^ i) >> 11) * 0x1p-53 * 2.0 - 1.0);
  }
  return out;
}

std::string OutputPath(const std::string& prefix, uint32_t rank) { return absl::StrCat(prefix, ".rank", rank); }

absl::Status WriteOutput(const std::string& path, const WorkerOutput& output) {
  // Written whole, then renamed: a reader sees all of it or nothing.
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(output.masters.data()), output.masters.size() * sizeof(float));
    f.write(reinterpret_cast<const char*>(output.gscales.data()), output.gscales.size() * sizeof(float));
    if (!f) return absl::DataLossError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return absl::DataLossError(absl::StrCat("cannot rename ", tmp));
  return absl::OkStatus();
}

absl::StatusOr<WorkerOutput> ReadOutput(const std::string& path, uint64_t masters) {
  std::ifstream f(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (!f.good() && !f.eof()) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  if (bytes.size() < masters * sizeof(float) || bytes.size() % sizeof(float) != 0) {
    return absl::DataLossError(absl::StrCat(path, " holds ", bytes.size(), " bytes, fewer than ", masters, " masters"));
  }
  const auto floats_at = [&](uint64_t first, uint64_t count) {
    std::vector<float> floats(count);
    // memcpy to an empty vector's null is undefined even for no bytes.
    if (count > 0) std::memcpy(floats.data(), bytes.data() + first * sizeof(float), count * sizeof(float));
    return floats;
  };
  WorkerOutput out;
  out.masters = floats_at(0, masters);
  out.gscales = floats_at(masters, bytes.size() / sizeof(float) - masters);
  return out;
}

std::vector<float> ReferenceMasters(const JobOptions& job, uint64_t seed, const std::vector<float>& gscales) {
  std::vector<float> out;
  for (uint32_t t = 0; t < job.tensors.size(); ++t) {
    const uint64_t numel = job.tensors[t].numel;
    testing::ReferenceTensor ref(kHyper, InitialValues(seed, t, numel), false);
    for (uint64_t step = 1; step <= gscales.size(); ++step) {
      std::vector<std::vector<uint16_t>> grads;
      std::vector<const uint16_t*> views;
      for (uint32_t r = 0; r < job.world_size; ++r) grads.push_back(Gradient(seed, step, r, t, numel));
      for (const auto& g : grads) views.push_back(g.data());
      ref.Step(views, kLr, gscales[step - 1]);
    }
    out.insert(out.end(), ref.p.begin(), ref.p.end());
  }
  return out;
}

}  // namespace shardopt::scale
