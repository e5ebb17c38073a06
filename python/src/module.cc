// shardopt._C: a thin binding of shardopt::Client for the PyTorch optimizer
// (python/shardopt/torch.py). It never links libtorch: tensors cross as their
// data_ptr() (an integer address) and the caller guarantees they are
// contiguous host memory of the tensor's element type and numel. Every call
// that talks to a server releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/after_step.h"
#include "python/src/ready_table.h"
#include "rpc/initial_values.h"
#include "rpc/job_limits.h"
#include "rpc/learning_rates.h"
#include "rpc/push_incomplete.h"
#include "rpc/skip_disagreement.h"
#include "shardopt/client.h"

namespace py = pybind11;

namespace {

// An absl::Status that is not OK, on its way to Python: the translator below
// turns it into shardopt._errors' exception for its code.
struct StatusError {
  absl::Status status;
};

void Check(const absl::Status& status) {
  if (!status.ok()) throw StatusError{status};
}

template <typename T>
T Value(absl::StatusOr<T> result) {
  Check(result.status());
  return *std::move(result);
}

// (tensor name, address) pairs from Python; address 0 is nullptr.
using Views = std::vector<std::pair<std::string, uintptr_t>>;

std::vector<shardopt::GradView> GradViews(const Views& views) {
  std::vector<shardopt::GradView> out;
  out.reserve(views.size());
  for (const auto& [name, ptr] : views) out.push_back({name, reinterpret_cast<const void*>(ptr)});
  return out;
}

std::vector<shardopt::ParamView> ParamViews(const Views& views) {
  std::vector<shardopt::ParamView> out;
  out.reserve(views.size());
  for (const auto& [name, ptr] : views) out.push_back({name, reinterpret_cast<void*>(ptr)});
  return out;
}

shardopt::StepOptions MakeStepOptions(double lr, std::vector<double> group_lr, double max_grad_norm,
                                      double loss_scale) {
  shardopt::StepOptions o;
  o.lr = lr;
  o.group_lr = std::move(group_lr);
  o.max_grad_norm = max_grad_norm;
  o.loss_scale = loss_scale;
  return o;
}

class PyClient {
 public:
  // shardopt::Client is not thread-safe. Its calls release the GIL, so two
  // Python threads (a training loop and a checkpointing or monitoring
  // thread) could be in it at once: each call holds mu_ for its whole run,
  // and while StartPush's thread uses the client every other call is
  // refused. mu_ is taken after the GIL is let go, and nothing holding it
  // waits for the GIL.
  template <typename F>
  auto Exclusive(F&& f) {
    InOwnProcess();
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    Idle();
    return f();
  }
  // gRPC's threads and connections do not survive a fork: in a forked
  // child (a process the trainer forked after it made this client) every
  // call is refused, and the client is never torn down (see the destructor).
  void InOwnProcess() const {
    if (getpid() != owner_) {
      throw StatusError{absl::FailedPreconditionError(absl::StrCat(
          "this optimizer's connections were made in process ", owner_, ", of which this process (", getpid(),
          ") is a fork, and gRPC's do not survive a fork: no optimizer can be used here, this one or a new one; "
          "make it in a process started afresh (multiprocessing's 'spawn', torchrun, subprocess)"))};
    }
  }
  void Idle() const {
    if (push_thread_.joinable()) {
      throw StatusError{absl::FailedPreconditionError(
          "a push is running (overlap=True: backward ran and step() has not finished it)")};
    }
  }

  PyClient(std::vector<std::string> servers, uint32_t rank, int max_attempts, uint32_t rpc_timeout_ms,
           uint64_t chunk_bytes, uint64_t checkpoint_every, std::string tls_root_certs, std::string tls_cert_chain,
           std::string tls_private_key, std::string token) {
    shardopt::ClientOptions o;
    o.servers = std::move(servers);
    o.rank = rank;
    o.max_attempts = max_attempts;
    o.rpc_timeout_ms = rpc_timeout_ms;
    o.chunk_bytes = chunk_bytes;
    // For CreateOrAttach's check of the servers alone: RemoteAdamW takes the
    // checkpoints itself, once the params are in the model.
    o.checkpoint_every = checkpoint_every;
    o.checkpoint_in_step = false;
    o.tls_root_certs = std::move(tls_root_certs);
    o.tls_cert_chain = std::move(tls_cert_chain);
    o.tls_private_key = std::move(tls_private_key);
    o.token = std::move(token);
    // The trainer's process is PyTorch's: its CPU tensors come from the same
    // malloc, and a 32 MiB mmap threshold with a 256 MiB trim threshold
    // would keep every freed tensor under 32 MiB in the process.
    o.tune_allocator = false;
    py::gil_scoped_release nogil;
    client_ = Value(shardopt::Client::Connect(o));
  }

  ~PyClient() {
    if (getpid() != owner_) {
      // A forked child: a push thread of the parent's cannot be joined here
      // (nor left joinable, which would terminate), and the table its
      // threads waited on cannot be destroyed; both are left in place, for
      // the child's exit to free. The Client, destroyed in the child, leaves
      // its gRPC objects alone itself (client.h).
      if (push_thread_.joinable()) (void)new std::thread(std::move(push_thread_));
      (void)table_.release();
      return;
    }
    // A push left running (backward raised, the optimizer was dropped) must
    // end before the client it uses: its remaining tensors go as "no grad".
    // With one rank, its step is then committed as a skip: left sealed, it
    // would answer the push of that step by a trainer that attaches to the
    // job later, whose commit would apply this partial gradient instead of
    // its own. With several, nothing is committed: the other ranks' commits
    // apply the step, and a skip from this one would disagree with them
    // (every server keeps the commit that reached it first and refuses the
    // other for good, so the job could not go on).
    if (push_thread_.joinable()) {
      py::gil_scoped_release nogil;
      table_->MarkRest();
      push_thread_.join();
      if (world_size_ == 1 && push_result_ && push_result_->ok()) {
        // (A server that restarted after the push is pushed the step
        // again, with no gradient: Client::Commit.)
        client_->Commit(push_step_, 0.0, 1.0f, /*skip=*/true, {}, {}).IgnoreError();
      }
    }
  }

  // groups: (name, beta1, beta2, eps, weight_decay, lr_multiplier, fp32_state)
  // tensors: (name, numel, group, fp32_params, shape)
  uint64_t CreateOrAttach(const std::string& name, uint32_t world_size,
                          const std::vector<std::tuple<std::string, double, double, float, double, double, bool>>& groups,
                          const std::vector<std::tuple<std::string, uint64_t, uint32_t, bool, std::vector<uint64_t>>>& tensors,
                          bool fp32_grads, uint32_t barrier_timeout_ms, uint64_t restore_step,
                          std::optional<bool> resume) {
    shardopt::JobOptions job;
    job.name = name;
    job.world_size = world_size;
    for (const auto& [gname, b1, b2, eps, wd, mult, fp32] : groups) {
      job.groups.push_back({gname, b1, b2, eps, wd, mult,
                            fp32 ? shardopt::StatePrecision::kFp32 : shardopt::StatePrecision::kBf16});
    }
    for (const auto& [tname, numel, group, fp32, shape] : tensors) {
      // A param of more dimensions than a job's spec holds goes without its
      // shape, as a caller that gives none.
      job.tensors.push_back({tname, numel, group, fp32 ? shardopt::ParamType::kFp32 : shardopt::ParamType::kBf16,
                             shape.size() <= shardopt::kMaxShapeDims ? shape : std::vector<uint64_t>{}});
    }
    job.grad_type = fp32_grads ? shardopt::GradType::kFp32 : shardopt::GradType::kBf16;
    job.barrier_timeout_ms = barrier_timeout_ms;
    job.restore_step = restore_step;
    // None: attach or create; False: a new job (step 0); True: resume a later step.
    job.resume = !resume ? shardopt::Resume::kEither : *resume ? shardopt::Resume::kOnly : shardopt::Resume::kNew;
    world_size_ = world_size;
    return Exclusive([&] { return Value(client_->CreateOrAttach(job)); });
  }

  // values: (tensor, master's address (0: none), whether it is fp32 (else
  // bf16), exp_avg's and exp_avg_sq's addresses (0: none), Adam step) each.
  using TensorValues = std::tuple<std::string, uintptr_t, bool, uintptr_t, uintptr_t, uint64_t>;
  void InitMany(const std::vector<TensorValues>& values, uint32_t share_index, uint32_t share_count) {
    std::vector<shardopt::TensorValues> v;
    v.reserve(values.size());
    for (const auto& [tensor, master, fp32, exp_avg, exp_avg_sq, adam_step] : values) {
      shardopt::TensorValues& t = v.emplace_back();
      t.tensor = tensor;
      if (fp32) {
        t.fp32 = reinterpret_cast<const float*>(master);
      } else {
        t.bf16 = reinterpret_cast<const uint16_t*>(master);
      }
      t.exp_avg = reinterpret_cast<const float*>(exp_avg);
      t.exp_avg_sq = reinterpret_cast<const float*>(exp_avg_sq);
      t.adam_step = adam_step;
    }
    Exclusive([&] { Check(client_->InitMany(v, {share_index, share_count})); });
  }
  void WaitForInitialValues(int64_t timeout_ms) {
    Exclusive([&] { Check(client_->WaitForInitialValues(timeout_ms)); });
  }
  shardopt::StepResult Step(const Views& grads, const Views& params, double lr, std::vector<double> group_lr,
                            double max_grad_norm, double loss_scale) {
    const auto g = GradViews(grads);
    const auto p = ParamViews(params);
    const auto o = MakeStepOptions(lr, std::move(group_lr), max_grad_norm, loss_scale);
    return Exclusive([&] { return Value(client_->Step(g, o, p)); });
  }

  // The C++ baseline of the benchmark: `steps` calls of Client::Step on the
  // same buffers, timed here, with no Python in between. Returns seconds.
  double TimedSteps(int steps, const Views& grads, const Views& params, double lr) {
    const auto g = GradViews(grads);
    const auto p = ParamViews(params);
    const auto o = MakeStepOptions(lr, {}, 0, 1);
    return Exclusive([&] {
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < steps; ++i) Check(client_->Step(g, o, p).status());
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
  }

  // Starts PushInOrder(step, order) on a thread of its own; Mark fills the
  // gradients as they become ready, FinishPush joins.
  void StartPush(uint64_t step, std::vector<std::string> order) {
    Exclusive([&] {
      table_->Reset(order.size());
      push_order_ = std::move(order);
      push_step_ = step;
      push_result_.reset();
      push_thread_ = std::thread([this, step] {
        push_result_ = client_->PushInOrder(
            step, push_order_, [this](size_t i) { return table_->Wait(i); }, /*intent=*/nullptr,
            [this](size_t i) { return table_->Ready(i); });
      });
    });
  }
  // `owner` holds the memory `data` is in (_overlap.py's _held: the tensor
  // and a view of its memory, which p.grad.data = t cannot take). It is
  // held until the push has ended, so that a gradient let go meanwhile (set
  // to None, or the optimizer and its staging dropped while backward
  // raised) is not freed under the push thread, which reads it by address.
  void Mark(size_t i, uintptr_t data, py::object owner) {
    InOwnProcess();
    held_.push_back(std::move(owner));
    table_->Mark(i, reinterpret_cast<const void*>(data));
  }
  bool Pushing() {
    InOwnProcess();
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    return push_thread_.joinable();
  }
  // Marks what is not marked yet as "no gradient", waits for the push.
  shardopt::PushResult FinishPush() {
    InOwnProcess();
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mu_);
      if (!push_thread_.joinable()) throw std::logic_error("no push is running");
      table_->MarkRest();
      push_thread_.join();
    }
    held_.clear();
    return Value(*std::move(push_result_));
  }

  void Commit(uint64_t step, double lr, float gscale, bool skip, const Views& params, std::vector<double> group_lr) {
    const auto p = ParamViews(params);
    Exclusive([&] { Check(client_->Commit(step, lr, gscale, skip, p, group_lr)); });
  }

  void Read(const std::string& tensor, shardopt::StateToRead what, uint64_t offset, uint64_t count, uintptr_t out) {
    Exclusive([&] { Check(client_->Read(tensor, what, offset, count, reinterpret_cast<void*>(out))); });
  }

  // reads: (tensor, what, offset, count, address) each.
  using StateRead = std::tuple<std::string, shardopt::StateToRead, uint64_t, uint64_t, uintptr_t>;
  void ReadMany(const std::vector<StateRead>& reads) {
    std::vector<shardopt::StateRead> r;
    r.reserve(reads.size());
    for (const auto& [tensor, what, offset, count, out] : reads) {
      r.push_back({tensor, what, offset, count, reinterpret_cast<void*>(out)});
    }
    Exclusive([&] { Check(client_->ReadMany(r)); });
  }

  std::vector<shardopt::ServerState> Describe() {
    return Exclusive([&] { return Value(client_->Describe()); });
  }
  std::vector<uint64_t> AdamSteps() {
    return Exclusive([&] { return Value(client_->AdamSteps()); });
  }
  void VerifyState() {
    Exclusive([&] { Check(client_->VerifyState()); });
  }
  void Drop() {
    Exclusive([&] { Check(client_->Drop()); });
  }
  void Checkpoint() {
    Exclusive([&] { Check(client_->Checkpoint()); });
  }
  uint64_t step() {
    InOwnProcess();  // mu_ may have been held by a parent's thread at the fork
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    return client_->step();
  }
  uint64_t pushed_ahead() {
    InOwnProcess();  // mu_ may have been held by a parent's thread at the fork
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    return client_->pushed_ahead();
  }
  std::vector<double> applied_group_lr() {
    InOwnProcess();  // mu_ may have been held by a parent's thread at the fork
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu_);
    return client_->applied_group_lr();
  }

 private:
  const pid_t owner_ = getpid();  // the process whose gRPC threads the client uses
  std::mutex mu_;  // one call in the client at a time (Exclusive)
  std::unique_ptr<shardopt::Client> client_;
  // On the heap, so that a forked child can leave it: its condition
  // variable may count waiters (the parent's push threads) that the child
  // does not have, and destroying it would wait for them.
  std::unique_ptr<shardopt::python::ReadyTable> table_ = std::make_unique<shardopt::python::ReadyTable>();
  std::vector<std::string> push_order_;
  uint64_t push_step_ = 0;
  uint32_t world_size_ = 1;  // the job's (~PyClient)
  std::optional<absl::StatusOr<shardopt::PushResult>> push_result_;
  std::vector<py::object> held_;  // the marked gradients' tensors, until the push ends (Mark)
  std::thread push_thread_;
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "shardopt's C++ client, for shardopt.torch";

  // Status codes become shardopt._errors' exceptions, which carry the code
  // and the server's message.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::object raise = py::module_::import("shardopt._errors").attr("raise_status");
      try {
        raise(static_cast<int>(e.status.code()), std::string(e.status.message()));
      } catch (py::error_already_set& err) {
        err.restore();
      }
    }
  });

  py::enum_<shardopt::StateToRead>(m, "StateToRead")
      .value("MASTER", shardopt::StateToRead::kMaster)
      .value("EXP_AVG", shardopt::StateToRead::kExpAvg)
      .value("EXP_AVG_SQ", shardopt::StateToRead::kExpAvgSq)
      .value("PARAM_BF16", shardopt::StateToRead::kParamBf16);

  py::class_<shardopt::PushResult>(m, "PushResult")
      .def_readonly("sum_squares", &shardopt::PushResult::sum_squares)
      .def_readonly("nonfinite", &shardopt::PushResult::nonfinite);
  py::class_<shardopt::Decision>(m, "Decision")
      .def_readonly("skip", &shardopt::Decision::skip)
      .def_readonly("grad_norm", &shardopt::Decision::grad_norm)
      .def_readonly("clip_factor", &shardopt::Decision::clip_factor)
      .def_readonly("gscale", &shardopt::Decision::gscale)
      .def("__repr__", [](const shardopt::Decision& d) {
        return "Decision(skip=" + std::string(d.skip ? "True" : "False") + ", grad_norm=" +
               std::to_string(d.grad_norm) + ", clip_factor=" + std::to_string(d.clip_factor) + ")";
      });
  py::class_<shardopt::StepResult>(m, "StepResult")
      .def_readonly("step", &shardopt::StepResult::step)
      .def_readonly("decision", &shardopt::StepResult::decision);
  py::class_<shardopt::ServerState>(m, "ServerState")
      .def_readonly("address", &shardopt::ServerState::address)
      .def_readonly("device", &shardopt::ServerState::device)
      .def_readonly("step", &shardopt::ServerState::step)
      .def_readonly("state_bytes", &shardopt::ServerState::state_bytes)
      .def_readonly("staging_bytes", &shardopt::ServerState::staging_bytes)
      .def_readonly("memory_limit_bytes", &shardopt::ServerState::memory_limit_bytes)
      .def_readonly("memory_used_bytes", &shardopt::ServerState::memory_used_bytes)
      .def_readonly("uninitialized_tensors", &shardopt::ServerState::uninitialized_tensors)
      .def_readonly("checkpoint_dir", &shardopt::ServerState::checkpoint_dir)
      .def_readonly("bookkeeping_bytes", &shardopt::ServerState::bookkeeping_bytes)
      .def("__repr__", [](const shardopt::ServerState& s) {
        return absl::StrCat("ServerState(address='", s.address, "', device='", s.device, "', step=", s.step,
                            ", state_bytes=", s.state_bytes, ", staging_bytes=", s.staging_bytes,
                            ", memory_limit_bytes=", s.memory_limit_bytes, ", memory_used_bytes=",
                            s.memory_used_bytes, ", uninitialized_tensors=", s.uninitialized_tensors,
                            ", checkpoint_dir=", s.checkpoint_dir ? "True" : "False",
                            ", bookkeeping_bytes=", s.bookkeeping_bytes, ")");
      });

  m.def(
      "decide",
      [](const shardopt::PushResult& push, uint32_t world_size, double max_grad_norm, double loss_scale) {
        return shardopt::Decide(push, world_size, MakeStepOptions(0, {}, max_grad_norm, loss_scale));
      },
      py::arg("push"), py::arg("world_size"), py::arg("max_grad_norm"), py::arg("loss_scale"));
  // The servers' check of initial values (rpc/initial_values.h), for a
  // caller that checks a whole state dict before it sends any of it.
  m.def(
      "check_initial_values",
      [](const std::string& tensor, uintptr_t data, uint64_t count, bool bf16_state, const std::string& kind) {
        const shardopt::InitialKind initial = kind == "exp_avg"      ? shardopt::InitialKind::kExpAvg
                                              : kind == "exp_avg_sq" ? shardopt::InitialKind::kExpAvgSq
                                                                     : shardopt::InitialKind::kMaster;
        Check(shardopt::CheckInitialValues(reinterpret_cast<const char*>(data), count, /*fp32=*/true, bf16_state,
                                           initial, absl::StrCat("'", tensor, "'"), 0));
      },
      py::arg("tensor"), py::arg("data"), py::arg("count"), py::arg("bf16_state"), py::arg("kind"));
  // The servers' check of an lr against a group's update constants
  // (rpc/learning_rates.h), for a group's lr before anything is pushed.
  m.def(
      "check_learning_rate",
      [](double lr, double beta1, double weight_decay) {
        const shardopt::AdamWHyper group{beta1, 0.999, 1e-8f, weight_decay, 1.0};  // beta2 and eps take no part
        Check(shardopt::CheckLearningRates(lr, {}, {group}, ""));
      },
      py::arg("lr"), py::arg("beta1"), py::arg("weight_decay"));
  // The start of the servers' refusal of a commit whose push they lost
  // (rpc/push_incomplete.h), which the overlap path pushes again for.
  m.def("push_incomplete", &shardopt::PushIncomplete, py::arg("step"));
  // The servers' words for a skip asked of a step applied by another commit,
  // and for an apply asked of one skipped (rpc/skip_disagreement.h), which
  // an overlap rank takes as the servers hold it.
  m.attr("applied_asked_skipped") = shardopt::kAppliedAskedSkipped;
  m.attr("skipped_asked_applied") = shardopt::kSkippedAskedApplied;
  // Raises what Client::Step does when that push, pushed again, decided
  // the step otherwise (client/after_step.h).
  m.def(
      "refuse_redecided",
      [](uint64_t step, float first_gscale, const shardopt::Decision& redecided) {
        Check(shardopt::RepushDecidedOtherwise(step, first_gscale, redecided));
      },
      py::arg("step"), py::arg("first_gscale"), py::arg("redecided"));
  m.def(
      "expand_server_pattern",
      [](const std::string& pattern, uint32_t count) { return Value(shardopt::ExpandServerPattern(pattern, count)); },
      py::arg("pattern"), py::arg("count"));

  py::class_<PyClient>(m, "Client")
      .def(py::init<std::vector<std::string>, uint32_t, int, uint32_t, uint64_t, uint64_t, std::string, std::string,
                    std::string, std::string>(),
           py::arg("servers"), py::arg("rank"), py::arg("max_attempts"), py::arg("rpc_timeout_ms"),
           py::arg("chunk_bytes"), py::arg("checkpoint_every"), py::arg("tls_root_certs") = "",
           py::arg("tls_cert_chain") = "", py::arg("tls_private_key") = "", py::arg("token") = "")
      .def("create_or_attach", &PyClient::CreateOrAttach, py::arg("name"), py::arg("world_size"), py::arg("groups"),
           py::arg("tensors"), py::arg("fp32_grads"), py::arg("barrier_timeout_ms"), py::arg("restore_step"), py::arg("resume"))
      .def("init_many", &PyClient::InitMany, py::arg("values"), py::arg("share_index") = 0, py::arg("share_count") = 1)
      .def("wait_for_initial_values", &PyClient::WaitForInitialValues)
      .def("step", &PyClient::Step, py::arg("grads"), py::arg("params"), py::arg("lr"), py::arg("group_lr"),
           py::arg("max_grad_norm"), py::arg("loss_scale"))
      .def("timed_steps", &PyClient::TimedSteps)
      .def("start_push", &PyClient::StartPush)
      .def("mark", &PyClient::Mark)
      .def("pushing", &PyClient::Pushing)
      .def("finish_push", &PyClient::FinishPush)
      .def("commit", &PyClient::Commit, py::arg("step"), py::arg("lr"), py::arg("gscale"), py::arg("skip"),
           py::arg("params"), py::arg("group_lr"))
      .def("read", &PyClient::Read)
      .def("read_many", &PyClient::ReadMany)
      .def("describe", &PyClient::Describe)
      .def("adam_steps", &PyClient::AdamSteps)
      .def("verify_state", &PyClient::VerifyState)
      .def("drop", &PyClient::Drop)
      .def("checkpoint", &PyClient::Checkpoint)
      .def_property_readonly("step_count", &PyClient::step)
      .def_property_readonly("pushed_ahead", &PyClient::pushed_ahead)
      .def_property_readonly("applied_group_lr", &PyClient::applied_group_lr);
}
