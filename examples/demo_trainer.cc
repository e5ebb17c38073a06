// The demo trainer: a small bf16 model with RMSNorm gains, trained twice
// through a shardopt server, once with FP32 optimizer state and once with
// BF16 state. The learning rate keeps each gain update below half of bf16's
// spacing at 1.0, so with bf16 state the gains never leave 1.0.
//
//   demo_trainer --server=127.0.0.1:50051 [--steps=300] [--print_every=25] [--csv=demo_curves.csv]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "shardopt/client.h"
#include "tools/flags.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "the shardopt server, HOST:PORT");
ABSL_FLAG(int, steps, 300, "training steps of each arm");
ABSL_FLAG(int, print_every, 25, "print the losses every this many steps");
ABSL_FLAG(std::string, csv, "demo_curves.csv", "where the loss curves go");

namespace {

constexpr int kIn = 64;       // input features
constexpr int kHidden = 128;  // RMSNorm width: the gains
constexpr int kBatch = 64;
constexpr float kNormEps = 1e-6f;

float Bf16ToFloat(uint16_t h) {
  const uint32_t u = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t FloatToBf16(float f) {  // round to nearest even; the demo never sees NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// y = w2 . (gain * h / rms(h)),  h = W1 x.
struct Model {
  std::vector<float> w1, gain, w2;
};

struct Grads {
  std::vector<float> w1, gain, w2;
  double loss = 0;
};

Model Widen(const std::vector<uint16_t>& w1, const std::vector<uint16_t>& gain, const std::vector<uint16_t>& w2) {
  Model m;
  for (uint16_t x : w1) m.w1.push_back(Bf16ToFloat(x));
  for (uint16_t x : gain) m.gain.push_back(Bf16ToFloat(x));
  for (uint16_t x : w2) m.w2.push_back(Bf16ToFloat(x));
  return m;
}

float Forward(const Model& m, const float* x, std::vector<float>* h_out, std::vector<float>* u_out, float* r_out) {
  std::vector<float> h(kHidden, 0.f), u(kHidden);
  double sq = 0;
  for (int j = 0; j < kHidden; ++j) {
    for (int i = 0; i < kIn; ++i) h[j] += m.w1[j * kIn + i] * x[i];
    sq += double{h[j]} * h[j];
  }
  const float r = std::sqrt(static_cast<float>(sq / kHidden) + kNormEps);
  float y = 0;
  for (int j = 0; j < kHidden; ++j) {
    u[j] = h[j] / r;
    y += m.w2[j] * m.gain[j] * u[j];
  }
  if (h_out) *h_out = std::move(h);
  if (u_out) *u_out = std::move(u);
  if (r_out) *r_out = r;
  return y;
}

Grads Backward(const Model& m, const std::vector<float>& xs, const std::vector<float>& targets) {
  Grads g{std::vector<float>(m.w1.size(), 0.f), std::vector<float>(kHidden, 0.f), std::vector<float>(kHidden, 0.f)};
  for (int b = 0; b < kBatch; ++b) {
    const float* x = &xs[b * kIn];
    std::vector<float> h, u;
    float r;
    const float y = Forward(m, x, &h, &u, &r);
    const float err = y - targets[b];
    g.loss += 0.5 * err * err / kBatch;
    const float dy = err / kBatch;
    std::vector<float> du(kHidden);
    float dot = 0;
    for (int j = 0; j < kHidden; ++j) {
      const float dn = dy * m.w2[j];
      g.w2[j] += dy * m.gain[j] * u[j];
      g.gain[j] += dn * u[j];
      du[j] = dn * m.gain[j];
      dot += du[j] * u[j];
    }
    for (int j = 0; j < kHidden; ++j) {
      const float dh = (du[j] - u[j] * dot / kHidden) / r;
      for (int i = 0; i < kIn; ++i) g.w1[j * kIn + i] += dh * x[i];
    }
  }
  return g;
}

std::vector<uint16_t> ToBf16(const std::vector<float>& v) {
  std::vector<uint16_t> out;
  for (float x : v) out.push_back(FloatToBf16(x));
  return out;
}

struct Arm {
  std::string label;
  std::unique_ptr<shardopt::Client> client;
  std::vector<uint16_t> w1, gain, w2;  // the trainer's bf16 params
  double loss = 0;
};

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args = shardopt::ParseFlags(
      argc, argv,
      "the demo: a small bf16 model trained through a shardopt server twice, with FP32 and with BF16 optimizer "
      "state.\nusage: demo_trainer --server=HOST:PORT [--steps=N] [--print_every=N] [--csv=FILE]");
  if (!args.empty()) shardopt::UsageError("takes no arguments, only flags");
  const std::string server = absl::GetFlag(FLAGS_server);
  const int steps = absl::GetFlag(FLAGS_steps);
  const int every = absl::GetFlag(FLAGS_print_every);
  const std::string csv_path = absl::GetFlag(FLAGS_csv);
  if (steps < 1) shardopt::UsageError("--steps must be at least 1");
  if (every < 1) shardopt::UsageError("--print_every must be at least 1");
  const double lr = 1e-3;  // Adam's step is ~lr: below 2^-9, half of bf16's spacing just under 1.0

  // A teacher whose gains are not 1: the student starts with the teacher's
  // weights and gains at 1.0, so learning the gains is what lowers the loss.
  std::mt19937_64 rng(2024);
  std::normal_distribution<float> normal(0.f, 1.f);
  Model teacher;
  for (int i = 0; i < kHidden * kIn; ++i) teacher.w1.push_back(normal(rng) / std::sqrt(float{kIn}));
  for (int j = 0; j < kHidden; ++j) teacher.gain.push_back(std::clamp(1.0f + 0.3f * normal(rng), 0.5f, 1.5f));
  for (int j = 0; j < kHidden; ++j) teacher.w2.push_back(normal(rng) / std::sqrt(float{kHidden}));

  std::vector<Arm> arms;
  for (auto precision : {shardopt::StatePrecision::kFp32, shardopt::StatePrecision::kBf16}) {
    const bool fp32 = precision == shardopt::StatePrecision::kFp32;
    Arm arm;
    arm.label = fp32 ? "fp32-state" : "bf16-state";
    shardopt::ClientOptions options;
    options.servers = {server};
    auto client = shardopt::Client::Connect(options);
    if (!client.ok()) {
      std::fprintf(stderr, "demo: %s\n", client.status().ToString().c_str());
      return 1;
    }
    arm.client = *std::move(client);
    shardopt::JobOptions job;
    job.name = std::string("demo-") + arm.label;
    // The weights start at the teacher's; a small lr multiplier keeps Adam's
    // unit-sized steps from adding more noise than the gains can remove.
    shardopt::GroupOptions weights{"weights", 0.9, 0.999, 1e-8f, 0.01, 0.05, precision};
    shardopt::GroupOptions gains{"gains", 0.9, 0.999, 1e-8f, 0.0, 1.0, precision};  // no decay on norm gains
    job.groups = {weights, gains};
    job.tensors = {{"w1", uint64_t{kHidden} * kIn, 0}, {"gain", kHidden, 1}, {"w2", kHidden, 0}};
    if (auto st = arm.client->CreateOrAttach(job); !st.ok()) {
      std::fprintf(stderr, "demo: %s\n", st.status().ToString().c_str());
      return 1;
    }
    if (auto st = arm.client->VerifyState(); !st.ok()) {
      std::fprintf(stderr, "demo: %s\n", st.ToString().c_str());
      return 1;
    }
    arm.w1 = ToBf16(teacher.w1);
    arm.gain.assign(kHidden, FloatToBf16(1.0f));
    arm.w2 = ToBf16(teacher.w2);
    for (auto [name, data] : {std::pair{"w1", &arm.w1}, {"gain", &arm.gain}, {"w2", &arm.w2}}) {
      if (auto st = arm.client->InitBf16(name, data->data()); !st.ok()) {
        std::fprintf(stderr, "demo: %s\n", st.ToString().c_str());
        return 1;
      }
    }
    arms.push_back(std::move(arm));
  }

  std::ofstream csv(csv_path);
  csv << "step,loss_fp32_state,loss_bf16_state\n";
  std::printf("%6s  %18s  %18s\n", "step", "loss fp32-state", "loss bf16-state");
  for (int step = 1; step <= steps; ++step) {
    std::vector<float> xs(kBatch * kIn), targets(kBatch);
    for (float& x : xs) x = normal(rng);
    for (int b = 0; b < kBatch; ++b) targets[b] = Forward(teacher, &xs[b * kIn], nullptr, nullptr, nullptr);
    for (Arm& arm : arms) {
      const Grads g = Backward(Widen(arm.w1, arm.gain, arm.w2), xs, targets);
      arm.loss = g.loss;
      const auto gw1 = ToBf16(g.w1), ggain = ToBf16(g.gain), gw2 = ToBf16(g.w2);
      shardopt::StepOptions so;
      so.lr = lr;
      auto r = arm.client->Step({{"w1", gw1.data()}, {"gain", ggain.data()}, {"w2", gw2.data()}}, so,
                                {{"w1", arm.w1.data()}, {"gain", arm.gain.data()}, {"w2", arm.w2.data()}});
      if (!r.ok()) {
        std::fprintf(stderr, "demo: step %d (%s): %s\n", step, arm.label.c_str(), r.status().ToString().c_str());
        return 1;
      }
    }
    csv << step << "," << arms[0].loss << "," << arms[1].loss << "\n";
    if (step % every == 0 || step == 1) std::printf("%6d  %18.6g  %18.6g\n", step, arms[0].loss, arms[1].loss);
  }

  std::printf("\nafter %d steps at lr=%g (updates below half of bf16's spacing at 1.0):\n", steps, lr);
  for (Arm& arm : arms) {
    int moved = 0;
    for (uint16_t g : arm.gain) moved += g != FloatToBf16(1.0f);
    float master0 = 0;
    (void)arm.client->Read("gain", shardopt::StateToRead::kMaster, 0, 1, &master0);
    std::printf("  %s: %3d of %d gains moved off 1.0, final loss %.6g (gain[0] master %.7f)\n", arm.label.c_str(),
                moved, kHidden, arm.loss, master0);
    (void)arm.client->Drop();
  }
  std::printf("curves written to %s\n", csv_path.c_str());
  return 0;
}
