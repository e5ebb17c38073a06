#include "server/job_life.h"

#include <random>

namespace shardopt {
namespace {

// splitmix64's finalizer: a fixed mix, the same in every process (unlike
// absl::Hash, seeded per process), never 0.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15u;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9u;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebu;
  x ^= x >> 31;
  return x != 0 ? x : 1;
}

}  // namespace

uint64_t NewLife() {
  std::random_device entropy;
  for (;;) {
    const uint64_t id = (uint64_t{entropy()} << 32) ^ entropy();
    if (id != 0) return id;
  }
}

uint64_t NextLife(uint64_t life) { return Mix(life ^ 0x6c69666521u); }

uint64_t LifeOfUnnamedPart(const std::string& job, uint64_t step) {
  uint64_t h = 0xcbf29ce484222325u;  // FNV-1a over the name
  for (unsigned char c : job) h = (h ^ c) * 0x100000001b3u;
  return Mix(h ^ Mix(step));
}

}  // namespace shardopt
