#include "tests/testing/reference.h"

#include <algorithm>
#include <cmath>

namespace shardopt::testing {

std::vector<float> RandomFloats(std::mt19937_64& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> out(n);
  for (float& x : out) {
    do {
      x = dist(rng);
    } while (x == 0);
  }
  return out;
}

std::vector<uint16_t> RandomBf16(std::mt19937_64& rng, size_t n, float scale) {
  std::normal_distribution<float> dist(0, scale);
  std::vector<uint16_t> out(n);
  for (uint16_t& x : out) {
    do {
      x = math::float_to_bf16(dist(rng));
    } while ((x & 0x7FFF) == 0);
  }
  return out;
}

double TreeSumsq(const std::vector<float>& g, double total) {
  for (size_t b = 0; b < g.size(); b += math::kSumsqBlock) {
    std::vector<double> lanes(math::kSumsqLanes, 0.0);
    for (size_t i = b; i < std::min(g.size(), b + math::kSumsqBlock); ++i) {
      lanes[(i - b) % math::kSumsqLanes] += static_cast<double>(g[i]) * g[i];
    }
    for (int stride = math::kSumsqLanes / 2; stride > 0; stride /= 2) {
      for (int l = 0; l < stride; ++l) lanes[l] += lanes[l + stride];
    }
    total += lanes[0];
  }
  return total;
}

std::vector<uint16_t> ToBf16(const std::vector<float>& x) {
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = math::float_to_bf16(x[i]);
  return out;
}

ReferenceTensor::ReferenceTensor(const AdamWHyper& h, std::vector<float> init, bool bf16)
    : hyper(h), bf16_state(bf16), p(std::move(init)), m(p.size(), 0.f), v(p.size(), 0.f) {
  if (bf16_state) {
    for (float& x : p) x = math::bf16_to_float(math::float_to_bf16(x));
  }
}

void ReferenceTensor::Step(const std::vector<const uint16_t*>& rank_grads, double lr, float gscale) {
  std::vector<float> g(p.size());
  for (size_t i = 0; i < p.size(); ++i) {
    g[i] = math::bf16_to_float(rank_grads[0][i]);
    for (size_t r = 1; r < rank_grads.size(); ++r) g[i] += math::bf16_to_float(rank_grads[r][i]);
  }
  StepAggregated(g, lr, gscale);
}

void ReferenceTensor::StepAggregated(const std::vector<float>& g, double lr, float gscale) {
  ++adam_step;
  const math::AdamWScalars s = ComputeAdamWScalars(hyper, lr, gscale, adam_step);
  auto round = [](float x) { return math::bf16_to_float(math::float_to_bf16(x)); };
  for (size_t i = 0; i < p.size(); ++i) {
    // docs/design.md's lines (section 3.1) written out here rather than
    // calling adamw_math.h, so that a change of order in the shared header
    // fails the bitwise tests.
    const float gs = g[i] * s.gscale;
    p[i] = p[i] * s.decay;
    const float w = s.one_minus_beta1;
    m[i] = w < 0.5f ? m[i] + w * (gs - m[i]) : gs - (gs - m[i]) * (1.0f - w);
    v[i] = v[i] * s.beta2 + (s.one_minus_beta2 * gs) * gs;
    const float d = std::sqrt(v[i]) / s.bc2_sqrt + s.eps;
    p[i] = p[i] - s.step_size * (m[i] / d);
    if (bf16_state) {
      p[i] = round(p[i]);
      m[i] = round(m[i]);
      v[i] = round(v[i]);
    }
  }
}

std::vector<uint16_t> ReferenceTensor::Params() const { return ToBf16(p); }

}  // namespace shardopt::testing
