// The library trainers link. It places each tensor across the servers,
// streams gradients to all of them in parallel, decides clipping and skipping
// from their partial norms, commits, and writes the updated params back into
// the caller's buffers (bf16, or the fp32 master for a tensor of fp32
// params). It retries UNAVAILABLE, DEADLINE_EXCEEDED and a server's
// CANCELLED (a stopping server's gRPC answers so the calls it had not
// begun), which the step protocol makes safe.
//
// Thread safety: a Client is not thread-safe; call it from one thread at a
// time (a trainer rank has one), and destroy it only when no call of it runs
// (a call left running on another thread then uses freed memory). A call
// made while another thread's runs is refused with FAILED_PRECONDITION, and
// nothing is sent. Separate Clients may be used at once. A process forked
// from the one that made a Client cannot use it (gRPC's threads stay in the
// parent): every call there is FAILED_PRECONDITION, and destroying it there
// leaves its gRPC objects in place, so that the child exits. The callback of PushInOrder is the
// exception: the Client calls it from its own threads, one per server.
//
//   shardopt::ClientOptions opts;
//   opts.servers = {"10.0.0.5:50051"};
//   auto client = shardopt::Client::Connect(opts).value();
//   client->CreateOrAttach(job).value();
//   CHECK_OK(client->InitBf16("w", w.data()));   // every call returns a [[nodiscard]] status
//   shardopt::StepOptions step_options;
//   step_options.lr = 1e-3;
//   for (...) CHECK_OK(client->Step({{"w", grad_w.data()}}, step_options, {{"w", w.data()}}).status());
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace shardopt {

enum class StatePrecision { kFp32, kBf16 };
enum class GradType { kBf16, kFp32 };
// What CreateOrAttach must find, for a launch that knows which it is
// (JobOptions::resume). kEither: attach to the job or create it. kNew: the
// job must be at step 0 (made now, or by this run's other ranks), so that a
// new run never takes over a job that another run, or a checkpoint, left at
// a later step under its name. kOnly: it must be at a later step (held, or
// restored from a checkpoint), so that a resume never starts again from
// step 0 where nothing was found (servers redeployed on empty directories).
// Either refusal is FAILED_PRECONDITION, naming the step, and the job this
// call made or restored is let go again.
enum class Resume { kEither, kNew, kOnly };
// The dtype a trainer holds a tensor's params in. kBf16 tensors push
// gradients in JobOptions::grad_type and get the bf16 rounding of the master
// back; kFp32 tensors (an fp32 model) push fp32 gradients and get the fp32
// master itself back, bit for bit, so the trainer keeps no second master.
enum class ParamType { kBf16, kFp32 };
enum class StateToRead { kMaster, kExpAvg, kExpAvgSq, kParamBf16 };

struct GroupOptions {
  std::string name;
  double beta1 = 0.9;
  double beta2 = 0.999;
  float eps = 1e-8f;
  double weight_decay = 0.01;
  double lr_multiplier = 1.0;  // 0 is taken as 1 (the proto's default); freeze a group with group_lr 0
  StatePrecision precision = StatePrecision::kFp32;
};

struct TensorOptions {
  std::string name;
  uint64_t numel = 0;
  uint32_t group = 0;  // index into JobOptions::groups
  ParamType param_type = ParamType::kBf16;
  // Its shape as the trainer holds it (product numel, at most 32 dimensions),
  // or empty. Part of the job's identity where the job has one too (a
  // transposed param of the same numel is then ALREADY_EXISTS), and the
  // shape `shardopt export` writes.
  std::vector<uint64_t> shape = {};
};

struct JobOptions {
  std::string name;
  uint32_t world_size = 1;
  std::vector<GroupOptions> groups;
  std::vector<TensorOptions> tensors;
  GradType grad_type = GradType::kBf16;
  uint32_t barrier_timeout_ms = 60000;
  // For servers with --checkpoint_dir, when they do not hold the job yet: 0
  // resumes from the newest complete checkpoint, if there is one; t > 0 from
  // the checkpoint of step t. CreateOrAttach returns the step resumed at.
  // An older t starts a new run (newer checkpoints are moved aside): give it
  // only to the launch that goes back, and 0 to later ones (README, "Restore").
  uint64_t restore_step = 0;
  Resume resume = Resume::kEither;
  // How many trainers' gradients each rank's push sums; Step averages over
  // world_size x max(1, this). NodeGroup sets its G local ranks. The servers
  // refuse an attach, ALREADY_EXISTS, that says another number than the job
  // was made with (FAILED_PRECONDITION where it would restore the job from a
  // checkpoint that says another): nodes of different G would each apply
  // their own average. 0 says nothing (a plain rank, a reader) and attaches
  // to, or restores, a job of any (a job it restores holds its checkpoint's).
  uint32_t trainers_per_rank = 0;
};

struct ClientOptions {
  // host:port of every server ([address]:port for IPv6), or a gRPC target
  // with a scheme gRPC resolves, in lower case (dns:, unix:, unix-abstract:,
  // ipv4:, ipv6:, xds:, google-c2p:), in a fixed order that all ranks
  // share; see ExpandServerPattern for a StatefulSet's. Each once: Connect
  // refuses a server listed twice, or without a numeric port (also after
  // dns:, ipv4: and ipv6:), INVALID_ARGUMENT.
  std::vector<std::string> servers;
  uint32_t rank = 0;
  // Indices into `servers` that Push and Commit go to, each once; empty
  // means all. A node group splits the servers among its local ranks this
  // way, so that each pushes one part of the node's reduced gradient. The
  // other calls go to every server that holds part of the job.
  std::vector<uint32_t> push_servers;
  // This client's id as a trainer, sent with its pushes: once another
  // trainer has pushed this rank since this client attached, its pushes are
  // FAILED_PRECONDITION (two live trainers of one rank; a trainer started
  // in place of a dead one attaches after its pushes, and goes on). 0: a
  // random one. Clients that stand for one trainer may share one.
  uint64_t trainer = 0;
  // Attempts per RPC for UNAVAILABLE, DEADLINE_EXCEEDED and CANCELLED, with backoff;
  // at least 1 (no retry).
  int max_attempts = 5;
  // Deadline of an RPC, on top of the barrier's wait for a push; at least 1.
  uint32_t rpc_timeout_ms = 60000;
  // Bytes of gradient (and of initial values) per streamed message; 0: the
  // client chooses, from the job's world_size. Larger messages cost less
  // per byte, but a server's gRPC keeps a read buffer of about one message
  // per connection, per rank on every server. So the choice is 4 MiB up to
  // 2 ranks, 8 MiB shared out over the ranks above that, and 256 KiB from
  // 32 ranks on; and never more than half the smallest message a server of
  // the job takes (its --max_message_bytes). chunk_bytes() says what it is.
  // A size given here is kept as given: one above that half is refused by
  // CreateOrAttach (INVALID_ARGUMENT, naming the server and its limit).
  // docs/design.md, section 10.2.
  uint64_t chunk_bytes = 0;
  // Keeps freed MiB-sized buffers in the process (mallopt); see
  // docs/design.md, section 10.2.
  bool tune_allocator = true;
  // Rank 0 checkpoints after every step that is a multiple of this; 0: never.
  // Rank 0's CreateOrAttach refuses it (FAILED_PRECONDITION) where a server
  // of the job has no --checkpoint_dir. If that checkpoint fails, Step
  // returns its error although the step itself is done (step() says so);
  // Checkpoint() may be called again.
  uint64_t checkpoint_every = 0;
  // Whether Step takes checkpoint_every's checkpoints (true), or the caller
  // does after its own part of the step (false: RemoteAdamW, which copies
  // the params into the model first). CreateOrAttach checks the servers
  // either way.
  bool checkpoint_in_step = true;
  // TLS, as PEM text: the CA that signed the servers' certificates (empty:
  // the system's roots), and this client's certificate chain and key, both
  // or neither, for servers that ask for one (mutual TLS). Any of them set
  // turns TLS on; all empty: plaintext. Connect refuses text that is not
  // PEM, and a certificate or key alone, with INVALID_ARGUMENT.
  std::string tls_root_certs;
  std::string tls_cert_chain;
  std::string tls_private_key;
  // The bearer token for servers started with --tokens_file (sent as
  // 'authorization: Bearer <token>' on every call). Without TLS anyone on
  // the path can read it.
  std::string token;
};

// One tensor's gradient: numel elements (float for a kFp32 tensor, else the
// job's GradType: bf16 bits or float), or nullptr for a tensor without a
// gradient this step.
struct GradView {
  std::string tensor;
  const void* data = nullptr;
};

// Where a tensor's updated params go: numel elements of its ParamType (bf16
// bits, or float for kFp32). A null `data` (or a tensor left out) is not
// returned: its params are updated on the servers all the same.
struct ParamView {
  std::string tensor;
  void* data = nullptr;
};

// One tensor's initial values for Client::InitMany, as InitFp32, InitBf16
// and InitAdamState take them: its master as float or as bf16 bits (or
// neither: the master is not written), and Adam's moments with the tensor's
// Adam step (both or neither; an adam_step without them is refused).
struct TensorValues {
  std::string tensor;
  const float* fp32 = nullptr;
  const uint16_t* bf16 = nullptr;
  const float* exp_avg = nullptr;
  const float* exp_avg_sq = nullptr;
  uint64_t adam_step = 0;
};

// One range of a tensor's state for Client::ReadMany: [offset,
// offset+count) of `what`, into `out` (float for master, m and v; bf16 bits
// for params).
struct StateRead {
  std::string tensor;
  StateToRead what = StateToRead::kMaster;
  uint64_t offset = 0;
  uint64_t count = 0;
  void* out = nullptr;
};

struct StepOptions {
  double lr = 1e-3;
  // Empty, or one base lr per group that replaces `lr` for that group (a
  // scheduler that gives groups different lrs). Each group's lr_multiplier
  // applies either way.
  std::vector<double> group_lr;
  double max_grad_norm = 0;  // 0: no clipping
  double loss_scale = 1;     // gradients arrive multiplied by this
};

// One server's answer to a push: over its shards, of the summed, unscaled
// gradient.
struct PushPartial {
  double sum_squares = 0;
  bool nonfinite = false;
};

struct PushResult {
  double sum_squares = 0;  // of the summed, unscaled gradient, over all servers
  bool nonfinite = false;
  // Indexed by server; zero for servers this client did not push to.
  std::vector<PushPartial> partials;
};

// Sums the partials in server order, the one order every rank uses, so that
// all reach the same double.
PushResult CombinePartials(std::vector<PushPartial> partials);

// What every rank decides alike from the same PushResult.
struct Decision {
  bool skip = false;
  double grad_norm = 0;    // of the averaged, unscaled gradient
  double clip_factor = 1;  // <= 1
  float gscale = 1;        // clip_factor / (loss_scale * world_size), rounded once
};

struct StepResult {
  uint64_t step = 0;
  Decision decision;
};

struct ServerState {
  std::string address;
  std::string device;
  uint64_t step = 0;
  uint64_t state_bytes = 0;
  uint64_t staging_bytes = 0;
  // The server's memory budget (--memory_limit) and what all its jobs and
  // streams hold against it.
  uint64_t memory_limit_bytes = 0;
  uint64_t memory_used_bytes = 0;
  // Tensor parts here that still lack initial values (0: ready to step).
  uint32_t uninitialized_tensors = 0;
  // Whether the server has --checkpoint_dir (true from a server too old to
  // say).
  bool checkpoint_dir = true;
  // What the server keeps for the job besides its state and staging (per
  // tensor, per rank, rounding): with them, what the job's maker's
  // max_memory counts (DescribeResponse.bookkeeping_bytes; 0 from a server
  // too old to say).
  uint64_t bookkeeping_bytes = 0;
};

// A part of the initial values, for callers that all hold the same ones (a
// job's ranks, as DDP requires): caller `index` of `count` writes the
// index-th of `count` even slices of each server's part of a tensor, so the
// servers take the model's bytes once, whatever the number of ranks.
struct InitShare {
  uint32_t index = 0;
  uint32_t count = 1;
};

// Decide's rule, a pure function so that every rank and the tests agree
// (docs/design.md, section 4.2): a skip where a gradient is not finite, or
// where gscale > 1 (loss_scale x trainers below the clip factor) could
// scale one past fp32's range, judged by the norm. `trainers`, whose
// gradients the pushes sum, is at least 1 (a job of 0 ranks is refused
// before any push; here it would divide by zero).
Decision Decide(const PushResult& push, uint64_t trainers, const StepOptions& options);
// The trainers a plain client's Step averages over: world_size x
// max(1, trainers_per_rank).
uint64_t Trainers(const JobOptions& job);

// Each server's part of each tensor: the placement of docs/design.md,
// section 5. Tensors are laid end to end in a flat space, each starting at a
// multiple of 4096; the space is split evenly at 4096-aligned boundaries.
struct ShardPlacement {
  uint32_t server;
  std::string tensor;
  uint64_t offset;
  uint64_t length;
};
// For a job the servers take: each numel in [1, 2^40] (as CreateOrAttach
// checks), at most --max_tensors_per_job tensors, at most 65536 servers; past
// that the flat space's arithmetic wraps, and the result is meaningless
// (though never out of bounds).
std::vector<ShardPlacement> PlaceTensors(absl::Span<const TensorOptions> tensors, uint32_t servers);
// Where each tensor starts in that flat space, and (last entry) its size.
std::vector<uint64_t> FlatOffsets(absl::Span<const TensorOptions> tensors);
// Where each server's part of the flat space starts, and (last entry) its
// end; empty for no servers.
std::vector<uint64_t> ServerBounds(absl::Span<const TensorOptions> tensors, uint32_t servers);

// A StatefulSet's server addresses: `pattern` holds "{i}" once, which becomes
// 0 ... count-1, and ends in ":PORT", e.g. "shardopt-{i}.shardopt:50051".
absl::StatusOr<std::vector<std::string>> ExpandServerPattern(const std::string& pattern, uint32_t count);

class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Creates the job on every server, or attaches to it; returns its step.
  // A job without a name or tensors, a world_size of 0 or an enum value
  // that names nothing is INVALID_ARGUMENT before any server is asked. Any
  // failure leaves the client attached to no job.
  absl::StatusOr<uint64_t> CreateOrAttach(const JobOptions& job);
  // Initial values of a whole tensor, before step 1. fp32 is kept exactly.
  // `values` is always the whole tensor; with a share, only this caller's
  // slices of it are sent, and the other callers send the rest. What is to
  // be sent is checked as the servers check it (finite as the group holds
  // it) before any of it is: INVALID_ARGUMENT, naming the first bad element,
  // and nothing written.
  absl::Status InitFp32(const std::string& tensor, const float* values, InitShare share = {});
  absl::Status InitBf16(const std::string& tensor, const uint16_t* values, InitShare share = {});
  // Waits until every server holding part of the job has initial values for
  // all of it (the other callers' shares are in), asking the servers not
  // yet ready again after 10 ms, then ever less often, up to every 500 ms;
  // DEADLINE_EXCEEDED after `timeout_ms` (INVALID_ARGUMENT if negative),
  // naming a server and how many of its tensor parts still lack values.
  absl::Status WaitForInitialValues(int64_t timeout_ms);
  // Adam's moments and step count of a whole tensor, before step 1: resuming
  // from an optimizer's state dict. fp32, kept exactly in FP32 groups. With a
  // share, only this caller's slices are sent, as for InitFp32. Nothing
  // counts the moments' shares: step 1 waits for every rank's push, so for
  // every rank's Init calls, but a read before then may find some missing.
  // Both arrays are checked before either is sent (exp_avg finite;
  // exp_avg_sq not negative and not NaN, +Inf taken, as design.md section
  // 3.5 says): INVALID_ARGUMENT and nothing written.
  absl::Status InitAdamState(const std::string& tensor, const float* exp_avg, const float* exp_avg_sq,
                             uint64_t adam_step, InitShare share = {});
  // What InitFp32, InitBf16 and InitAdamState do, for many tensors: every
  // value of every tensor checked before any is sent, then all of them in as
  // few Init streams per server as carry 256 MiB each, where a call each
  // costs a round trip (a model of 1000 small tensors: several times
  // faster). As for InitFp32 with a share, the values checked are those
  // this caller sends. A tensor given nothing, both fp32 and bf16, one
  // moment without the other, or an adam_step without moments is
  // INVALID_ARGUMENT; one given twice is written twice, in order (the later
  // values stand; an adam_step of 0 leaves the one before). A server that
  // refuses a stream partway keeps what came before, as for the single
  // calls: then any of the tensors may be written on any of the servers.
  absl::Status InitMany(absl::Span<const TensorValues> tensors, InitShare share = {});
  // Initial values of every tensor of the job from a safetensors file (F32
  // kept exactly, or BF16), matched by name; entries the job lacks are
  // ignored. Checks the whole file against the job (names, sizes, dtypes
  // and values, and shapes where TensorOptions::shape gives one: the file's
  // must be it, or 1-D) before sending anything.
  absl::Status InitFromSafetensors(const std::string& path);

  // One whole step: push, decide, commit. If it fails, call it again with the
  // same gradients: step() advances only once the commit succeeded, and the
  // servers count a repeated push of a step once (new gradients for a step
  // already pushed would be ignored). A Step refused for its own arguments
  // (loss_scale, max_grad_norm, lr, group_lr, or params naming a tensor the
  // job lacks) is refused before its push: nothing was sent, so fix them and
  // call it again, with any gradients. A server that restarted between the
  // push and the commit, and so lost the push, is pushed the step again and
  // the step committed in the same call, if the answers decide it as the
  // first push's did (else FAILED_PRECONDITION: another rank pushed other
  // gradients for it, and the servers that applied it hold the first).
  absl::StatusOr<StepResult> Step(absl::Span<const GradView> grads, const StepOptions& options,
                                  absl::Span<const ParamView> params);
  // The phases of Step, for callers that combine decisions themselves.
  // `intent`: the options the step will be committed with if it applies it
  // (Step passes its own). The servers refuse, with FAILED_PRECONDITION, a
  // commit that applies a step whose ranks' pushes said different ones, on
  // every server alike, where each would otherwise apply whichever rank's
  // commit reached it first; nullptr says none, and is not compared. Ranks'
  // intents are compared with each other only, not with the commit's own
  // arguments: with one rank, a Commit unlike its Push's intent is applied.
  absl::StatusOr<PushResult> Push(uint64_t step, absl::Span<const GradView> grads,
                                  const StepOptions* intent = nullptr);
  // A push whose gradients become ready over time, for overlapping it with
  // the backward pass: each server's stream sends the tensors in `order`,
  // calling grad(i) for order[i] when it gets there. grad may block until
  // that gradient exists; it returns its data, or nullptr for no gradient
  // this step (as do tensors left out of `order`). It is called from one
  // thread per server at once, and again for a retried stream. A tensor
  // named twice (in `order`, or in Push's `grads`), or an empty `grad`, is
  // INVALID_ARGUMENT.
  // `ready(i)`, if given, says without blocking whether grad(i) would now
  // answer at once. Such a gradient is asked for on one of gRPC's callback
  // threads when the write before it completes, which saves a hop to the
  // client's thread and back per tensor; one that may block is asked for on
  // the client's thread. So ready, and grad once ready(i) was true, run on
  // gRPC's threads, for several servers at once and again for a retried
  // stream: they must be thread-safe, must not throw, must not call this
  // Client, and grad(i) must not block once ready(i) was true.
  absl::StatusOr<PushResult> PushInOrder(uint64_t step, absl::Span<const std::string> order,
                                         const std::function<const void*(size_t)>& grad,
                                         const StepOptions* intent = nullptr,
                                         const std::function<bool(size_t)>& ready = nullptr);
  // group_lr: as StepOptions::group_lr; empty means `lr` for every group.
  // A skip sends none of lr, gscale and group_lr, and checks none: every
  // skip of a step is the same commit. A server that lost the step's push
  // (it restarted after it) is pushed the step again with no gradient, as a
  // skip applies none, and the skip committed once more. Any other commit
  // refused that way (FAILED_PRECONDITION, "its push is incomplete") needs
  // the step pushed again, with the same gradients, and committed again.
  // A commit that is not a skip, of a step whose push answers said
  // nonfinite (Decide skips it), is refused (FAILED_PRECONDITION) by each
  // server whose own sum is not finite, which applies nothing; the others
  // apply it, and the job's servers then hold different steps. Commit what
  // Decide says.
  absl::Status Commit(uint64_t step, double lr, float gscale, bool skip, absl::Span<const ParamView> params,
                      absl::Span<const double> group_lr = {});

  // Reads [offset, offset+count) of a tensor's state: float for master, m
  // and v; bf16 bits for params. A count of 0 at an offset up to numel reads nothing (OK).
  absl::Status Read(const std::string& tensor, StateToRead what, uint64_t offset, uint64_t count, void* out);
  // Reads every range as Read does, all of one step of the job (else
  // ABORTED: it stepped during the read), each server's ranges on up to 4
  // streams at once (fewer where more than 16 servers hold ranges of it,
  // one each from 33 on; the streams count against the server's
  // --max_streams_per_client, and a read they exceed is made again one
  // stream per server, a refusal tried again after a call's backoff): for a model's many small tensors (a state dict)
  // several times cheaper than a Read of each. Every range is checked
  // before anything is read; on an error, the ranges may hold some of the
  // state read.
  absl::Status ReadMany(absl::Span<const StateRead> reads);
  absl::StatusOr<std::vector<ServerState>> Describe();
  // Each tensor's own Adam step count, in JobOptions::tensors order.
  absl::StatusOr<std::vector<uint64_t>> AdamSteps();
  // Fails with FAILED_PRECONDITION when any group's state is not held at the
  // precision asked for: the remote analogue of refusing a training loop
  // whose optimizer state silently fell to bf16.
  absl::Status VerifyState();
  // Drops the job on every server, with its state (another client's calls
  // then get NOT_FOUND "was dropped"). This client is then attached to
  // nothing: its calls get FAILED_PRECONDITION ("was dropped by this
  // client") until CreateOrAttach, which makes a new job of the name at step
  // 0, or restores its newest complete checkpoint: checkpoints on disk stay.
  absl::Status Drop();
  // Writes a checkpoint of the job's current step on every server (each
  // server its part, into a --checkpoint_dir they share). Fails with
  // FAILED_PRECONDITION if no server saw every part, e.g. because their
  // directories are not shared.
  absl::Status Checkpoint();

  // The job's step: the last one done.
  uint64_t step() const;
  // Once attached: step() + 1 if a server this client pushes to holds that
  // step's push, not yet committed, either complete (every rank's) or this
  // client's rank's, whole or the part of it summed already; else 0. A
  // trainer of this rank pushed it and died before its commit, or one that
  // is still running commits it now (another process attached meanwhile).
  // The servers count a rank's push of a step once: where they hold it,
  // this client's push of that step is answered from it, and its own
  // gradients there are not used. Such a push stands until the step is
  // committed or its barrier deadline passes. Taken at CreateOrAttach, and
  // not updated after: ask again by attaching again.
  uint64_t pushed_ahead() const;
  // The lr each group's step (step() at CreateOrAttach) was committed with
  // (StepOptions' lr or group_lr, before the group's lr_multiplier): a
  // trainer resuming a scheduled lr can compare its own. Empty for a new
  // job, a step applied as a skip, or servers too old to say. Taken at
  // CreateOrAttach, as pushed_ahead.
  std::vector<double> applied_group_lr() const;
  // Bytes of gradient per streamed message, once attached: ClientOptions::chunk_bytes,
  // or what the client chose for the job.
  uint64_t chunk_bytes() const;

 private:
  struct Impl;
  explicit Client(std::unique_ptr<Impl> impl);
  // Commits step t as a skip, params into out; see Commit.
  absl::Status CommitSkip(uint64_t t, const std::vector<char*>& out);
  // PushInOrder, after the call's checks (Push and PushInOrder each make
  // them once).
  absl::StatusOr<PushResult> PushGradients(uint64_t step, absl::Span<const std::string> order,
                                           const std::function<const void*(size_t)>& grad,
                                           const std::function<bool(size_t)>& ready, const StepOptions* intent);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardopt
