#include "kernels/step_scalars.h"

#include <cmath>

namespace shardopt {

math::AdamWScalars ComputeAdamWScalars(const AdamWHyper& hyper, double lr, float gscale,
                                       uint64_t adam_step) {
  const double t = static_cast<double>(adam_step);
  const double lr_eff = EffectiveLr(hyper, lr);
  const double bc2 = 1.0 - std::pow(hyper.beta2, t);
  math::AdamWScalars s;
  s.gscale = gscale;
  s.decay = static_cast<float>(Decay(hyper, lr_eff));
  s.one_minus_beta1 = static_cast<float>(1.0 - hyper.beta1);
  s.beta2 = static_cast<float>(hyper.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - hyper.beta2);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.step_size = static_cast<float>(StepSize(hyper, lr_eff, adam_step));
  s.eps = hyper.eps;
  s.beta1 = 1.0f - s.one_minus_beta1;  // exact for one_minus_beta1 in [0.5, 1], where it is used
  return s;
}

}  // namespace shardopt
