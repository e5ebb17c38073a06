// Drives a running shardopt-server through the client library for
// test_torch_reference.py: one job with FP32 state (a weight tensor and a
// tensor of gains), and one with BF16 state holding the same gains. Initial
// values and gradients come from a counter-based hash that the Python test
// reimplements in numpy, so both sides see the same bits without gradient
// files. At the end it writes the state as raw little-endian files:
//
//   fp32_w.f32, fp32_gain.f32      the FP32 job's masters
//   fp32_w.bf16, fp32_gain.bf16    the FP32 job's bf16 params
//   bf16_gain.f32, bf16_gain.bf16  the BF16 job's master (held in bf16), params
//   init_w.f32, last_grad_w.bf16, last_grad_gain.bf16
//                                  what the generator produced, so that the
//                                  test tells a generator mismatch from an
//                                  optimizer one
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/adamw_math.h"
#include "shardopt/client.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the output files are raw little-endian");

ABSL_FLAG(std::string, server, "", "host:port of the running shardopt-server");
ABSL_FLAG(std::string, out_dir, "", "existing directory for the output files");
ABSL_FLAG(uint64_t, numel, 1 << 20, "elements of the weight tensor");
ABSL_FLAG(uint64_t, gains, 4096, "elements of the gain tensor");
ABSL_FLAG(uint64_t, steps, 1000, "steps to run");
ABSL_FLAG(uint64_t, seed, 1, "seed of the generator");
ABSL_FLAG(double, lr, 1e-3, "base learning rate");
ABSL_FLAG(double, beta1, 0.9, "Adam beta1 of both groups");
ABSL_FLAG(double, beta2, 0.999, "Adam beta2 of both groups");
ABSL_FLAG(float, eps, 1e-8f, "Adam epsilon of both groups");
ABSL_FLAG(double, weight_decay, 0.01, "weight decay of the weights; the gains have none");
ABSL_FLAG(double, gain_lr_multiplier, 0.1, "lr multiplier of the gains' group");

namespace {

// The generator, mirrored by key, Hasher, init_weights, grad_weights and
// grad_gains in test_torch_reference.py. Each value depends only on (seed,
// stream, step, index), so it vectorizes in numpy.
constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kStreamInitW = 0, kStreamGradW = 1, kStreamGradGain = 2;

uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t Key(uint64_t seed, uint64_t stream, uint64_t step) {
  uint64_t k = Mix((seed + 1) * kGamma);
  k = Mix(k + (stream + 1) * kGamma);
  return Mix(k + (step + 1) * kGamma);
}

uint64_t Hash(uint64_t key, uint64_t i) { return Mix(key + (i + 1) * kGamma); }

// A signed 24-bit integer from the hash's top bits, in [-2^23, 2^23): exact
// as a float, and scaled below only by powers of two, so no float operation
// before the final bf16 rounding can round differently in numpy.
int32_t Top24(uint64_t h) { return static_cast<int32_t>(h >> 40) - (1 << 23); }

// Weights start uniform in [-1, 1), kept exactly as fp32.
std::vector<float> InitWeights(uint64_t seed, uint64_t n) {
  const uint64_t key = Key(seed, kStreamInitW, 0);
  std::vector<float> out(n);
  for (uint64_t i = 0; i < n; ++i) out[i] = std::ldexp(static_cast<float>(Top24(Hash(key, i))), -23);
  return out;
}

// Weight gradients: uniform in [-1, 1) times 2^-(4+e), e in [0, 8) from the
// hash's low bits, so magnitudes spread over eight binades from step to step
// as real gradients' do.
void GradWeights(uint64_t seed, uint64_t step, std::vector<uint16_t>& out) {
  const uint64_t key = Key(seed, kStreamGradW, step);
  for (uint64_t i = 0; i < out.size(); ++i) {
    const uint64_t h = Hash(key, i);
    const int e = static_cast<int>((h >> 8) & 7);
    out[i] = shardopt::math::float_to_bf16(std::ldexp(static_cast<float>(Top24(h)), -23 - 4 - e));
  }
}

// Gain gradients: mean 2^-11 with noise of ±2^-10, so the gains drift in one
// direction like a norm gain that has something to learn.
void GradGains(uint64_t seed, uint64_t step, std::vector<uint16_t>& out) {
  const uint64_t key = Key(seed, kStreamGradGain, step);
  for (uint64_t i = 0; i < out.size(); ++i) {
    const int32_t centred = Top24(Hash(key, i)) + (1 << 22);
    out[i] = shardopt::math::float_to_bf16(std::ldexp(static_cast<float>(centred), -33));
  }
}

absl::Status WriteFile(const std::string& dir, const std::string& name, const void* data, size_t bytes) {
  const std::string path = absl::StrCat(dir, "/", name);
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return absl::UnavailableError(absl::StrCat("cannot open ", path));
  const bool written = std::fwrite(data, 1, bytes, f) == bytes;
  if (std::fclose(f) != 0 || !written) return absl::DataLossError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

#define RETURN_IF_ERROR(expr)                    \
  do {                                           \
    if (absl::Status st_ = (expr); !st_.ok()) { \
      return st_;                                \
    }                                            \
  } while (0)

// A fresh job, so that a leftover job of the same name cannot answer for it.
absl::StatusOr<std::unique_ptr<shardopt::Client>> StartJob(const std::string& server, const shardopt::JobOptions& job) {
  shardopt::ClientOptions options;
  options.servers = {server};
  auto client = shardopt::Client::Connect(options);
  if (!client.ok()) return client.status();
  auto step = (*client)->CreateOrAttach(job);
  if (!step.ok()) return step.status();
  if (*step != 0) return absl::FailedPreconditionError(absl::StrCat("job '", job.name, "' already exists at step ", *step));
  return client;
}

absl::Status Run() {
  const std::string server = absl::GetFlag(FLAGS_server);
  const std::string dir = absl::GetFlag(FLAGS_out_dir);
  const uint64_t n = absl::GetFlag(FLAGS_numel);
  const uint64_t gains = absl::GetFlag(FLAGS_gains);
  const uint64_t steps = absl::GetFlag(FLAGS_steps);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  if (server.empty() || dir.empty()) return absl::InvalidArgumentError("--server and --out_dir are required");

  shardopt::GroupOptions weights_group;
  weights_group.name = "weights";
  weights_group.beta1 = absl::GetFlag(FLAGS_beta1);
  weights_group.beta2 = absl::GetFlag(FLAGS_beta2);
  weights_group.eps = absl::GetFlag(FLAGS_eps);
  weights_group.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  shardopt::GroupOptions gains_group = weights_group;
  gains_group.name = "gains";
  gains_group.weight_decay = 0;
  gains_group.lr_multiplier = absl::GetFlag(FLAGS_gain_lr_multiplier);

  shardopt::JobOptions fp32_job;
  fp32_job.name = "torch-reference-fp32";
  fp32_job.groups = {weights_group, gains_group};
  fp32_job.tensors = {{"w", n, 0}, {"gain", gains, 1}};
  shardopt::JobOptions bf16_job;
  bf16_job.name = "torch-reference-bf16";
  bf16_job.groups = {gains_group};
  bf16_job.groups[0].precision = shardopt::StatePrecision::kBf16;
  bf16_job.tensors = {{"gain", gains, 0}};

  auto fp32 = StartJob(server, fp32_job);
  if (!fp32.ok()) return fp32.status();
  auto bf16 = StartJob(server, bf16_job);
  if (!bf16.ok()) return bf16.status();

  const std::vector<float> w0 = InitWeights(seed, n);
  const std::vector<float> ones(gains, 1.0f);
  RETURN_IF_ERROR((*fp32)->InitFp32("w", w0.data()));
  RETURN_IF_ERROR((*fp32)->InitFp32("gain", ones.data()));
  RETURN_IF_ERROR((*bf16)->InitFp32("gain", ones.data()));
  // Each arm must really hold the precision it stands for.
  RETURN_IF_ERROR((*fp32)->VerifyState());
  RETURN_IF_ERROR((*bf16)->VerifyState());

  std::vector<uint16_t> grad_w(n), grad_gain(gains), w(n), gain_fp32(gains), gain_bf16(gains);
  shardopt::StepOptions step_options;
  step_options.lr = absl::GetFlag(FLAGS_lr);
  for (uint64_t t = 1; t <= steps; ++t) {
    GradWeights(seed, t, grad_w);
    GradGains(seed, t, grad_gain);
    auto a = (*fp32)->Step({{"w", grad_w.data()}, {"gain", grad_gain.data()}}, step_options,
                           {{"w", w.data()}, {"gain", gain_fp32.data()}});
    if (!a.ok()) return a.status();
    auto b = (*bf16)->Step({{"gain", grad_gain.data()}}, step_options, {{"gain", gain_bf16.data()}});
    if (!b.ok()) return b.status();
    if (a->step != t || b->step != t || a->decision.skip || b->decision.skip) {
      return absl::InternalError(absl::StrCat("step ", t, " came back as steps ", a->step, " and ", b->step,
                                              (a->decision.skip || b->decision.skip) ? ", skipped" : ""));
    }
  }

  std::vector<float> master_w(n), master_gain(gains), bf16_master_gain(gains);
  RETURN_IF_ERROR((*fp32)->Read("w", shardopt::StateToRead::kMaster, 0, n, master_w.data()));
  RETURN_IF_ERROR((*fp32)->Read("gain", shardopt::StateToRead::kMaster, 0, gains, master_gain.data()));
  RETURN_IF_ERROR((*bf16)->Read("gain", shardopt::StateToRead::kMaster, 0, gains, bf16_master_gain.data()));
  RETURN_IF_ERROR(WriteFile(dir, "fp32_w.f32", master_w.data(), n * 4));
  RETURN_IF_ERROR(WriteFile(dir, "fp32_gain.f32", master_gain.data(), gains * 4));
  RETURN_IF_ERROR(WriteFile(dir, "fp32_w.bf16", w.data(), n * 2));
  RETURN_IF_ERROR(WriteFile(dir, "fp32_gain.bf16", gain_fp32.data(), gains * 2));
  RETURN_IF_ERROR(WriteFile(dir, "bf16_gain.f32", bf16_master_gain.data(), gains * 4));
  RETURN_IF_ERROR(WriteFile(dir, "bf16_gain.bf16", gain_bf16.data(), gains * 2));
  RETURN_IF_ERROR(WriteFile(dir, "init_w.f32", w0.data(), n * 4));
  RETURN_IF_ERROR(WriteFile(dir, "last_grad_w.bf16", grad_w.data(), n * 2));
  RETURN_IF_ERROR(WriteFile(dir, "last_grad_gain.bf16", grad_gain.data(), gains * 2));
  RETURN_IF_ERROR((*fp32)->Drop());
  return (*bf16)->Drop();
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::Status st = Run(); !st.ok()) {
    std::cerr << "shardopt_reference_driver: " << st << "\n";
    return 1;
  }
  return 0;
}
