// Host-side, per-step constants of the AdamW update (docs/design.md, section
// 3.2: computed in double, rounded to float once).
#pragma once

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

// `adam_step` is the tensor's own step count after this update (1 for the
// first update). `lr` is the step's base learning rate.
math::AdamWScalars ComputeAdamWScalars(const AdamWHyper& hyper, double lr, float gscale,
                                       uint64_t adam_step);

}  // namespace shardopt
