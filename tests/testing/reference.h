// Plain, scalar references for the tests: the same per-element header run
// one element at a time, and the same formula in float64.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/step_scalars.h"

namespace shardopt::testing {

// The hyperparameters most tests use: torch's AdamW defaults.
inline constexpr AdamWHyper kDefaultHyper{0.9, 0.999, 1e-8f, 0.01, 1.0};

// Fresh random values: never zeros, a spread of magnitudes.
std::vector<float> RandomFloats(std::mt19937_64& rng, size_t n, float lo, float hi);
std::vector<uint16_t> RandomBf16(std::mt19937_64& rng, size_t n, float scale);
std::vector<uint16_t> ToBf16(const std::vector<float>& x);
// The fixed-tree sum of squares of adamw_math.h, written out the slow way:
// each block's result added to `total` in order (so the shards of one
// server chain, each starting from the last one's total).
double TreeSumsq(const std::vector<float>& g, double total = 0);

// One tensor's optimizer state, updated one element at a time.
struct ReferenceTensor {
  AdamWHyper hyper;
  bool bf16_state = false;  // the BF16 precision: round p, m, v after each step
  std::vector<float> p, m, v;
  uint64_t adam_step = 0;

  ReferenceTensor(const AdamWHyper& h, std::vector<float> init, bool bf16);
  // `rank_grads` are the contributing ranks' gradients, in rank order.
  void Step(const std::vector<const uint16_t*>& rank_grads, double lr, float gscale);
  // One step from a gradient already aggregated in fp32 (a node group's sums).
  void StepAggregated(const std::vector<float>& g, double lr, float gscale);
  std::vector<uint16_t> Params() const;
};

}  // namespace shardopt::testing
