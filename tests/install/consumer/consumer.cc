// One AdamW step through a live server, with nothing but the installed
// headers and library: consumer HOST:PORT.
#include <cmath>
#include <cstdio>
#include <vector>

#include "shardopt/client.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer HOST:PORT\n");
    return 2;
  }
  shardopt::ClientOptions options;
  options.servers = {argv[1]};
  auto client = shardopt::Client::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "consumer: %s\n", client.status().ToString().c_str());
    return 1;
  }
  constexpr uint64_t kNumel = 8;
  shardopt::JobOptions job;
  job.name = "install-test";
  job.groups = {{"all", 0.9, 0.999, 1e-8f, 0.0}};
  job.tensors = {{"w", kNumel, 0}};
  const std::vector<float> ones(kNumel, 1.0f);
  const std::vector<uint16_t> grad(kNumel, 0x3F80);  // bf16 1.0
  std::vector<uint16_t> params(kNumel);
  std::vector<float> master(kNumel);
  shardopt::StepOptions step;
  step.lr = 1e-3;
  absl::Status st = (*client)->CreateOrAttach(job).status();
  if (st.ok()) st = (*client)->InitFp32("w", ones.data());
  if (st.ok()) st = (*client)->Step({{"w", grad.data()}}, step, {{"w", params.data()}}).status();
  if (st.ok()) st = (*client)->Read("w", shardopt::StateToRead::kMaster, 0, kNumel, master.data());
  if (!st.ok()) {
    std::fprintf(stderr, "consumer: %s\n", st.ToString().c_str());
    return 1;
  }
  // Adam's first step moves every element by lr * g / (|g| + eps): 1 - 1e-3.
  for (float m : master) {
    if (std::fabs(m - 0.999f) > 1e-6f) {
      std::fprintf(stderr, "consumer: master %.9g after one step, want 0.999\n", m);
      return 1;
    }
  }
  std::printf("consumer: one step on %s, master %.9g\n", argv[1], master[0]);
  return 0;
}
