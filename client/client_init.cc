// A Client's initial values of a new job: masters (InitFp32, InitBf16,
// InitFromSafetensors), Adam's moments (InitAdamState), many tensors' at
// once (InitMany), and the wait for other ranks' shares.
#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client_impl.h"
#include "rpc/initial_values.h"
#include "shardopt/client.h"
#include "shardopt/safetensors.h"

namespace shardopt {

absl::Status Client::InitFp32(const std::string& tensor, const float* values, InitShare share) {
  const Impl::Entered call(*impl_);
  SHARDOPT_RETURN_IF_ERROR(call.status());
  SHARDOPT_RETURN_IF_ERROR(impl_->CheckInit(tensor, values, v1::FP32, v1::MASTER, share));
  return impl_->SendInit({{tensor, values, v1::FP32}}, share);
}
absl::Status Client::InitBf16(const std::string& tensor, const uint16_t* values, InitShare share) {
  const Impl::Entered call(*impl_);
  SHARDOPT_RETURN_IF_ERROR(call.status());
  SHARDOPT_RETURN_IF_ERROR(impl_->CheckInit(tensor, values, v1::BF16, v1::MASTER, share));
  return impl_->SendInit({{tensor, values, v1::BF16}}, share);
}

absl::Status Client::WaitForInitialValues(int64_t timeout_ms) {
  const Impl::Entered call(*impl_);
  SHARDOPT_RETURN_IF_ERROR(call.status());
  Impl& im = *impl_;
  SHARDOPT_RETURN_IF_ERROR(im.CheckAttached());
  if (timeout_ms < 0) {
    return absl::InvalidArgumentError(absl::StrCat("WaitForInitialValues: timeout_ms is ", timeout_ms, "; give 0 or more"));
  }
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  // A server whose parts all have values keeps them (they are taken only at
  // step 0, and never taken away), so only the others are asked again; and
  // ever less often, since every rank of the job asks every server.
  std::vector<uint32_t> pending;
  for (uint32_t s = 0; s < im.servers(); ++s) {
    if (!im.shards_of[s].empty()) pending.push_back(s);
  }
  std::vector<uint32_t> missing(im.servers(), 0);  // each server's thread writes its own entry
  for (auto pause = std::chrono::milliseconds(10);; pause = std::min(2 * pause, std::chrono::milliseconds(500))) {
    SHARDOPT_RETURN_IF_ERROR(fanout::ForEach(pending, [&](uint32_t s) {
      v1::DescribeResponse r;
      // Each call within what is left, so that an unresponsive server keeps
      // the wait near timeout_ms; but given a second at least, so that a
      // short wait still hears the servers' count and can say what lacks.
      const int64_t rpc_ms = im.options.rpc_timeout_ms;
      const int64_t left = std::chrono::duration_cast<std::chrono::milliseconds>(
                               give_up - std::chrono::steady_clock::now()).count();
      const uint32_t call_ms = static_cast<uint32_t>(std::clamp<int64_t>(left, std::min<int64_t>(1000, rpc_ms), rpc_ms));
      SHARDOPT_RETURN_IF_ERROR(im.Call(s, call_ms, [&](grpc::ClientContext* ctx) {
        v1::DescribeRequest req;
        req.set_job(im.job.name);
        req.set_incarnation(im.incarnation[s]);
        req.set_max_tensors(1);  // only the job-wide fields are wanted
        return im.stubs[s]->Describe(ctx, req, &r);
      }));
      missing[s] = r.uninitialized_tensors();
      return absl::OkStatus();
    }));
    pending.erase(std::remove_if(pending.begin(), pending.end(), [&](uint32_t s) { return missing[s] == 0; }),
                  pending.end());
    if (pending.empty()) return absl::OkStatus();
    if (std::chrono::steady_clock::now() >= give_up) {
      return absl::DeadlineExceededError(absl::StrCat(
          im.address(pending.front()), ": ", missing[pending.front()], " of its parts of job '", im.job.name,
          "' still lack initial values after ", timeout_ms, " ms; is every rank that writes them, or a share of them, "
          "running, with this job name and world_size? (A rank that gave another made another job, and waits as "
          "well)"));
    }
    std::this_thread::sleep_for(std::min(pause, std::chrono::duration_cast<std::chrono::milliseconds>(
                                                    give_up - std::chrono::steady_clock::now())));
  }
}

absl::Status Client::InitAdamState(const std::string& tensor, const float* exp_avg, const float* exp_avg_sq,
                                   uint64_t adam_step, InitShare share) {
  const Impl::Entered call(*impl_);
  SHARDOPT_RETURN_IF_ERROR(call.status());
  TensorValues values;
  values.tensor = tensor;
  values.exp_avg = exp_avg;
  values.exp_avg_sq = exp_avg_sq;
  values.adam_step = adam_step;
  return InitMany({&values, 1}, share);
}

absl::Status Client::InitMany(absl::Span<const TensorValues> tensors, InitShare share) {
  const Impl::Entered call(*impl_);
  SHARDOPT_RETURN_IF_ERROR(call.status());
  Impl& im = *impl_;
  SHARDOPT_RETURN_IF_ERROR(im.CheckAttached());
  SHARDOPT_RETURN_IF_ERROR(Impl::CheckShare(share));
  std::vector<Impl::InitWrite> writes;
  for (const TensorValues& t : tensors) {
    SHARDOPT_RETURN_IF_ERROR(im.FindTensor(t.tensor).status());
    if (t.fp32 == nullptr && t.bf16 == nullptr && t.exp_avg == nullptr && t.exp_avg_sq == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("no values given for tensor '", t.tensor, "'"));
    }
    if (t.fp32 != nullptr && t.bf16 != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.tensor, "' is given both fp32 and bf16 values"));
    }
    if ((t.exp_avg == nullptr) != (t.exp_avg_sq == nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.tensor, "' is given one of Adam's moments "
                                                     "without the other: give exp_avg and exp_avg_sq together"));
    }
    if (t.exp_avg == nullptr && t.adam_step != 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.tensor, "' is given adam_step ", t.adam_step,
                                                     " without moments: the step is that of the moments given"));
    }
    if (t.fp32 != nullptr || t.bf16 != nullptr) {
      writes.push_back({t.tensor, t.fp32 != nullptr ? static_cast<const void*>(t.fp32) : t.bf16,
                        t.fp32 != nullptr ? v1::FP32 : v1::BF16});
    }
    if (t.exp_avg != nullptr) {
      SHARDOPT_RETURN_IF_ERROR(CheckAdamStep(t.adam_step, absl::StrCat("'", t.tensor, "'")));
      writes.push_back({t.tensor, t.exp_avg, v1::FP32, v1::EXP_AVG, t.adam_step});
      writes.push_back({t.tensor, t.exp_avg_sq, v1::FP32, v1::EXP_AVG_SQ, t.adam_step});
    }
  }
  for (const Impl::InitWrite& w : writes) {
    SHARDOPT_RETURN_IF_ERROR(im.CheckInit(w.tensor, w.values, w.dtype, w.kind, share));
  }
  return im.SendInit(writes, share);
}

absl::Status Client::InitFromSafetensors(const std::string& path) {
  const Impl::Entered call(*impl_);
  SHARDOPT_RETURN_IF_ERROR(call.status());
  Impl& im = *impl_;
  SHARDOPT_RETURN_IF_ERROR(im.CheckAttached());
  SHARDOPT_ASSIGN_OR_RETURN(auto file, ReadSafetensors(path));
  absl::flat_hash_map<std::string, const SafetensorsTensor*> by_name;
  for (const SafetensorsTensor& t : file) by_name[t.name] = &t;
  for (const TensorOptions& t : im.job.tensors) {
    auto it = by_name.find(t.name);
    if (it == by_name.end()) return absl::InvalidArgumentError(absl::StrCat(path, " has no tensor '", t.name, "'"));
    const SafetensorsTensor& f = *it->second;
    if (f.dtype != "F32" && f.dtype != "BF16") {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", t.name, "' is ", f.dtype, "; F32 or BF16 needed"));
    }
    if (f.data.size() != t.numel * (f.dtype == "F32" ? 4 : 2)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", t.name, "' has ", f.data.size(),
                                                     " bytes of ", f.dtype, "; the job's has ", t.numel, " elements"));
    }
    // A file in another shape of the same size (a transposed weight) would
    // be taken in the wrong order; 1-D, as export wrote every tensor before
    // jobs had shapes, is taken as it is.
    if (!t.shape.empty() && f.shape != t.shape && f.shape != std::vector<uint64_t>{t.numel}) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", t.name, "' has shape (",
                                                     absl::StrJoin(f.shape, ", "), "); the job's is (",
                                                     absl::StrJoin(t.shape, ", "), ")"));
    }
  }
  for (const TensorOptions& t : im.job.tensors) {
    const SafetensorsTensor& f = *by_name[t.name];
    const absl::Status values = im.CheckInit(t.name, f.data.data(), f.dtype == "F32" ? v1::FP32 : v1::BF16, v1::MASTER, {});
    if (!values.ok()) return absl::Status(values.code(), absl::StrCat(path, ": ", values.message()));
  }
  std::vector<Impl::InitWrite> writes;
  for (const TensorOptions& t : im.job.tensors) {
    const SafetensorsTensor& f = *by_name[t.name];
    writes.push_back({t.name, f.data.data(), f.dtype == "F32" ? v1::FP32 : v1::BF16});
  }
  return im.SendInit(writes);
}

}  // namespace shardopt
