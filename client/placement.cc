#include <algorithm>
#include <cmath>

#include "shardopt/client.h"

namespace shardopt {

namespace {
constexpr uint64_t kAlign = 4096;
uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
}  // namespace

std::vector<ShardPlacement> PlaceTensors(absl::Span<const TensorOptions> tensors, uint32_t servers) {
  std::vector<ShardPlacement> out;
  if (servers == 0) return out;
  // Each tensor starts 4096-aligned in the flat space, so a boundary there is
  // also 4096-aligned inside the tensor.
  std::vector<uint64_t> start(tensors.size());
  uint64_t flat = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    start[i] = flat;
    flat = RoundUp(flat + tensors[i].numel, kAlign);
  }
  const uint64_t per_server = RoundUp((flat + servers - 1) / servers, kAlign);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t begin = start[i];
    const uint64_t end = begin + tensors[i].numel;
    for (uint64_t pos = begin; pos < end;) {
      const uint32_t server = static_cast<uint32_t>(std::min<uint64_t>(pos / per_server, servers - 1));
      const uint64_t server_end = server + 1 == servers ? end : std::min(end, (server + 1) * per_server);
      out.push_back({server, tensors[i].name, pos - begin, server_end - pos});
      pos = server_end;
    }
  }
  return out;
}

Decision Decide(const PushResult& push, uint32_t world_size, const StepOptions& options) {
  Decision d;
  const double average_scale = options.loss_scale * world_size;
  d.grad_norm = std::sqrt(push.sum_squares) / average_scale;
  if (push.nonfinite || !std::isfinite(d.grad_norm)) {
    d.skip = true;
    d.gscale = static_cast<float>(1.0 / average_scale);
    return d;
  }
  if (options.max_grad_norm > 0) {
    // torch.nn.utils.clip_grad_norm_'s rule.
    d.clip_factor = std::min(1.0, options.max_grad_norm / (d.grad_norm + 1e-6));
  }
  d.gscale = static_cast<float>(d.clip_factor / average_scale);
  return d;
}

}  // namespace shardopt
