#include "client/proto_convert.h"

namespace shardopt {

v1::CreateJobRequest ToCreateJobRequest(const JobOptions& job, absl::Span<const ShardPlacement> shards, uint32_t rank) {
  v1::CreateJobRequest req;
  req.set_job(job.name);
  req.set_world_size(job.world_size);
  for (const GroupOptions& g : job.groups) {
    v1::Group* pg = req.add_groups();
    pg->set_name(g.name);
    pg->set_beta1(g.beta1);
    pg->set_beta2(g.beta2);
    pg->set_eps(g.eps);
    pg->set_weight_decay(g.weight_decay);
    pg->set_lr_multiplier(g.lr_multiplier);
    pg->set_precision(g.precision == StatePrecision::kFp32 ? v1::PRECISION_FP32 : v1::PRECISION_BF16);
  }
  for (const TensorOptions& t : job.tensors) {
    v1::TensorSpec* pt = req.add_tensors();
    pt->set_name(t.name);
    pt->set_numel(t.numel);
    pt->set_group(t.group);
    for (uint64_t d : t.shape) pt->add_shape(d);
    // BF16 stays unset: what clients sent before param_dtype existed.
    if (t.param_type == ParamType::kFp32) pt->set_param_dtype(v1::FP32);
  }
  for (const ShardPlacement& p : shards) {
    v1::ShardRange* r = req.add_shards();
    r->set_tensor(p.tensor);
    r->set_offset(p.offset);
    r->set_length(p.length);
  }
  req.set_grad_dtype(job.grad_type == GradType::kBf16 ? v1::BF16 : v1::FP32);
  req.set_barrier_timeout_ms(job.barrier_timeout_ms);
  req.set_restore_step(job.restore_step);
  req.set_rank(rank);
  req.set_trainers_per_rank(job.trainers_per_rank);
  return req;
}

v1::DType GradDType(const JobOptions& job, const TensorOptions& tensor) {
  return tensor.param_type == ParamType::kFp32 || job.grad_type == GradType::kFp32 ? v1::FP32 : v1::BF16;
}

v1::DType StateDType(StatePrecision precision) { return precision == StatePrecision::kFp32 ? v1::FP32 : v1::BF16; }

v1::StateKind ToProto(StateToRead what) {
  switch (what) {
    case StateToRead::kMaster: return v1::MASTER;
    case StateToRead::kExpAvg: return v1::EXP_AVG;
    case StateToRead::kExpAvgSq: return v1::EXP_AVG_SQ;
    case StateToRead::kParamBf16: return v1::PARAM_BF16;
  }
  return v1::STATE_KIND_UNSPECIFIED;
}

ServerState FromProto(const std::string& address, const v1::DescribeResponse& r) {
  return {address,
          r.device(),
          r.step(),
          r.state_bytes(),
          r.staging_bytes(),
          r.memory_limit_bytes(),
          r.memory_used_bytes(),
          r.uninitialized_tensors(),
          !r.has_checkpoint_dir() || r.checkpoint_dir(),
          r.bookkeeping_bytes()};
}

v1::StepIntent ToProto(const StepOptions& options) {
  v1::StepIntent intent;
  intent.set_lr(options.lr);
  for (double lr : options.group_lr) intent.add_group_lr(lr);
  intent.set_max_grad_norm(options.max_grad_norm);
  intent.set_loss_scale(options.loss_scale);
  return intent;
}

}  // namespace shardopt
