// Host-side, per-step constants of the AdamW update (docs/design.md, section
// 3.2: computed in double, rounded to float once).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/adamw_math.h"

namespace shardopt {

// A group's hyperparameters. Betas, weight decay and the lr multiplier are
// doubles, as in torch, so that 1-β1 etc. round exactly as torch's do.
struct AdamWHyper {
  double beta1 = 0.9;
  double beta2 = 0.999;
  float eps = 1e-8f;
  double weight_decay = 0.01;
  double lr_multiplier = 1.0;
};

// Three of the update's constants in double, before ComputeAdamWScalars
// rounds each to float once; a commit's lr is checked against them too
// (rpc/learning_rates.h), so that one whose float overflows is refused before
// any update runs. `lr_eff` is EffectiveLr's.
inline double EffectiveLr(const AdamWHyper& hyper, double lr) { return lr * hyper.lr_multiplier; }
inline double Decay(const AdamWHyper& hyper, double lr_eff) { return 1.0 - lr_eff * hyper.weight_decay; }
inline double StepSize(const AdamWHyper& hyper, double lr_eff, uint64_t adam_step) {
  return lr_eff / (1.0 - std::pow(hyper.beta1, static_cast<double>(adam_step)));
}

// `adam_step` is the tensor's own step count after this update (1 for the
// first update). `lr` is the step's base learning rate.
math::AdamWScalars ComputeAdamWScalars(const AdamWHyper& hyper, double lr, float gscale,
                                       uint64_t adam_step);

}  // namespace shardopt
