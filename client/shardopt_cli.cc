// shardopt: the admin command line. Talks to one server.
//   shardopt --server=HOST:PORT describe JOB
//   shardopt --server=HOST:PORT read JOB TENSOR master|exp_avg|exp_avg_sq|param [OFFSET [COUNT]]
//   shardopt --server=HOST:PORT drop JOB
//   shardopt export --checkpoint_dir=DIR [--step=N] [--dtype=fp32|bf16] JOB OUT.safetensors
//   shardopt help [VERB]
// export reads a complete checkpoint from disk, no server needed, and writes
// each tensor's master: fp32 exactly (a BF16 group's bf16 master widened,
// exactly), or rounded to bf16 with --dtype=bf16.
#include <algorithm>
#include <climits>
#include <cmath>
#include <csignal>
#include <chrono>
#include <filesystem>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <map>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "google/protobuf/util/json_util.h"
#include "kernels/adamw_math.h"
#include "base/control_bytes.h"
#include "checkpoint/catalog.h"
#include "checkpoint/files.h"
#include "checkpoint/format.h"
#include "client/checkpoint_export.h"
#include "client/fanout.h"
#include "client/option_checks.h"
#include "shardopt/safetensors.h"
#include "grpc/support/log.h"
#include "grpcpp/grpcpp.h"
#include "rpc/grpc_edge.h"
#include "shardopt/v1/optimizer.grpc.pb.h"
#include "tools/flags.h"

ABSL_FLAG(std::string, server, "localhost:50051", "list, describe, drop, checkpoint, read: the server, HOST:PORT");
ABSL_FLAG(std::string, tls_ca, "",
          "list, describe, drop, checkpoint, read: PEM CA of the server's certificate (without it, the system's roots); "
          "any of --tls_ca, --tls_cert and --tls_key set turns TLS on");
ABSL_FLAG(std::string, tls_cert, "",
          "list, describe, drop, checkpoint, read: PEM certificate of this client, for mutual TLS");
ABSL_FLAG(std::string, tls_key, "", "list, describe, drop, checkpoint, read: PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "list, describe, drop, checkpoint, read: with TLS, the name the server's certificate must carry, where "
          "--server reaches it by another (an IP, or localhost through kubectl port-forward); default: --server's host");
ABSL_FLAG(std::string, token_file, "",
          "list, describe, drop, checkpoint, read: a file holding the bearer token for a server with --tokens_file; "
          "without it the environment variable SHARDOPT_TOKEN, if set");
ABSL_FLAG(int, timeout_s, 60, "list, describe, drop, checkpoint, read: each call's deadline, in seconds, at least 1");
ABSL_FLAG(std::string, checkpoint_dir, "", "export: the servers' --checkpoint_dir, where the checkpoint is");
ABSL_FLAG(uint64_t, step, 0, "export: the checkpoint's step; 0 is the newest complete one");
ABSL_FLAG(std::string, dtype, "fp32", "export: fp32 (the master exactly) or bf16 (rounded to nearest even)");

namespace v1 = shardopt::v1;

namespace {

struct Verb {
  const char* name;
  const char* synopsis;     // what follows "shardopt "
  const char* description;  // for `shardopt help VERB`
  size_t min_args, max_args;  // after the verb
};

constexpr Verb kVerbs[] = {
    {"describe", "[--server=HOST:PORT] describe JOB",
     "Prints the job as the server holds it (step, groups, tensors, memory, device) as JSON.", 1, 1},
    {"list", "[--server=HOST:PORT] list",
     "Prints the jobs the server holds, those the token may describe, as JSON: each one's step, worldSize,\n"
     "trainersPerRank (a node group's G, 0 where its maker said none), tensors, memory, owner (the token it\n"
     "counts against) and what its step waits for. Jobs a restarted server has not restored yet are not held.",
     0, 0},
    {"drop", "[--server=HOST:PORT] drop JOB", "Drops the job and its state from the server.", 1, 1},
    {"checkpoint", "[--server=HOST:PORT] checkpoint JOB [STEP]",
     "Writes the server's part of the job's checkpoint of STEP (default: the step the server holds), and\n"
     "prints the answer as JSON. Run it on every server of the job, with the same STEP, while its trainers\n"
     "are stopped: the server that writes the last part marks the checkpoint complete (\"complete\": true).\n"
     "A server at another step refuses (FAILED_PRECONDITION).",
     1, 2},
    {"read", "[--server=HOST:PORT] read JOB TENSOR master|exp_avg|exp_avg_sq|param [OFFSET [COUNT]]",
     "Prints one state array of the server's shard of TENSOR, one value per line: the master, Adam's m\n"
     "(exp_avg) or v (exp_avg_sq), as the job holds them, or the bf16 params of the last commit. OFFSET\n"
     "is the tensor's element to start at, which must lie in the server's shard (`describe` shows each\n"
     "tensor's shard; default: the shard's start); COUNT (default 0) is how many, 0 meaning to the\n"
     "shard's end.",
     3, 5},
    {"export", "export --checkpoint_dir=DIR [--step=N] [--dtype=fp32|bf16] JOB OUT.safetensors",
     "Writes each tensor's master from a complete checkpoint under DIR (the newest, or step N) to a\n"
     "safetensors file: fp32 exactly, or rounded to bf16. Reads the disk; no server is needed.",
     2, 2},
    {"help", "help [VERB]", "Prints the usage, or VERB's.", 0, 1},
};

const Verb* FindVerb(const std::string& name) {
  for (const Verb& verb : kVerbs) {
    if (name == verb.name) return &verb;
  }
  return nullptr;
}

std::string Usage() {
  std::string usage = "the shardopt admin command line\nusage:\n";
  for (const Verb& verb : kVerbs) absl::StrAppend(&usage, "  shardopt ", verb.synopsis, "\n");
  absl::StrAppend(&usage, "'shardopt help VERB' describes VERB; 'shardopt --help' lists the flags.");
  return usage;
}

// An answer as the CLI prints it: JSON, every field shown.
void PrintJson(const google::protobuf::Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  std::cout << json;
}

uint64_t ParseCount(const Verb& verb, const char* what, const std::string& text) {
  uint64_t value = 0;
  // Digits only: SimpleAtoi would also take " 5" and "+5".
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos || !absl::SimpleAtoi(text, &value)) {
    shardopt::UsageError(absl::StrCat(verb.name, ": ", what, " must be a whole number in digits, got '", text,
                                      "'\nusage: shardopt ", verb.synopsis));
  }
  return value;
}

// An error's names (a job's, a tensor's, a path) are whatever someone gave:
// their control bytes go out as \xHH, as the server's log writes them, and
// not as escape sequences or line breaks to the operator's terminal.
int Fail(const absl::Status& st) {
  std::cerr << "shardopt: " << shardopt::EscapeControlBytes(st.ToString()) << "\n";
  return 1;
}

// A server's error, named by --server; no answer in time also says, where
// `effect` is given, what that means for the call's effect: one of these.
constexpr char kEffectUnknown[] = "; whether the call took effect is unknown: describe the job to see";
constexpr char kNoCheckpointAsked[] = "; no checkpoint was asked for: without STEP, checkpoint first asks the job's step";
int Fail(const grpc::Status& st, const char* effect = "") {
  absl::Status said = shardopt::FromGrpcStatus(st, absl::GetFlag(FLAGS_server));
  if (st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    said = absl::DeadlineExceededError(absl::StrCat(
        said.message(), " (no answer within --timeout_s=", absl::GetFlag(FLAGS_timeout_s),
        ", which bounds the whole call, a read's stream included: the server may be hung, stopped or overloaded",
        effect, ")"));
  } else {
    // What it may mean, as the client libraries say it (one attempt here):
    // gRPC says only "failed to connect", which a TLS mismatch reads as too,
    // and "CANCELLED" for a call a stopping server had not begun.
    said = shardopt::fanout::WithRetryAdvice(said, 1);
  }
  return Fail(said);
}

// One chunk of state, a value per line (bf16 widened: exact).
void PrintValues(const v1::StateChunk& chunk) {
  const std::string& d = chunk.data();
  const bool fp32 = chunk.dtype() == v1::FP32;
  for (size_t i = 0, esize = fp32 ? 4 : 2; i + esize <= d.size(); i += esize) {
    float x;
    uint16_t h;
    if (fp32) {
      std::memcpy(&x, d.data() + i, 4);
    } else {
      std::memcpy(&h, d.data() + i, 2);
      x = shardopt::math::bf16_to_float(h);
    }
    std::printf("%.9g\n", x);
  }
}

}  // namespace

int main(int argc, char** argv) {
  // A file-size limit (ulimit -f) then fails export's write with EFBIG,
  // which is reported and its temporary file removed, instead of killing
  // the process with nothing said.
  signal(SIGXFSZ, SIG_IGN);
  // gRPC's own log lines ("E1206 ... ssl_transport_security.cc:1501]
  // Handshake failed ...") said again, in its words, what the call's status
  // says, which is printed as the error.
  gpr_set_log_function([](gpr_log_func_args*) {});
  const std::string usage = Usage();
  const std::vector<std::string> args = shardopt::ParseFlags(argc, argv, usage);
  if (args.empty()) shardopt::UsageError(absl::StrCat("no verb given\n", usage));
  const Verb* verb = FindVerb(args[0]);
  if (verb == nullptr) shardopt::UsageError(absl::StrCat("unknown verb '", args[0], "'\n", usage));
  const size_t n = args.size() - 1;
  if (n < verb->min_args || n > verb->max_args) {
    const std::string what = n < verb->min_args ? "too few arguments"
                             : absl::StrCat("too many arguments: ",
                                            absl::StrJoin(args.begin() + 1 + verb->max_args, args.end(), " "));
    shardopt::UsageError(absl::StrCat(verb->name, ": ", what, "\nusage: shardopt ", verb->synopsis));
  }
  const std::string command = verb->name;

  if (command == "help") {
    if (n == 0) {
      std::cout << usage << "\n";
      return 0;
    }
    const Verb* about = FindVerb(args[1]);
    if (about == nullptr) shardopt::UsageError(absl::StrCat("help: unknown verb '", args[1], "'\n", usage));
    std::cout << "usage: shardopt " << about->synopsis << "\n" << about->description << "\n";
    return 0;
  }
  // A name protobuf would send, and the server refuse the whole message; a
  // job of such a name cannot exist, so none has a checkpoint to export.
  for (size_t i = 1; i <= std::min<size_t>(n, command == "read" ? 2 : 1); ++i) {
    if (absl::Status st = shardopt::CheckNameIsUtf8(i == 1 ? "JOB" : "TENSOR", args[i]); !st.ok()) {
      shardopt::UsageError(std::string(st.message()));
    }
  }
  if (command == "export") {
    const std::string dtype = absl::GetFlag(FLAGS_dtype);
    if (dtype != "fp32" && dtype != "bf16") {
      shardopt::UsageError(absl::StrCat("--dtype must be fp32 or bf16, got '", dtype, "'"));
    }
    const std::string checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
    if (checkpoint_dir.empty()) {
      shardopt::UsageError(absl::StrCat("export needs --checkpoint_dir\nusage: shardopt ", verb->synopsis));
    }
    // Many tools read `-` as stdout; this one would write a file of that name.
    if (args[2] == "-") shardopt::UsageError("export writes OUT.safetensors to a file; '-' (stdout) is not taken");
    const absl::Status exported =
        shardopt::ExportCheckpoint(checkpoint_dir, absl::GetFlag(FLAGS_step), dtype == "bf16", args[1], args[2]);
    return exported.ok() ? 0 : Fail(exported);
  }

  // Every argument is checked before the server is contacted.
  if (absl::StripAsciiWhitespace(absl::GetFlag(FLAGS_server)).empty()) {
    shardopt::UsageError("--server must name a server, HOST:PORT");
  }
  if (absl::Status st = shardopt::CheckServerAddress(absl::GetFlag(FLAGS_server)); !st.ok()) {
    shardopt::UsageError(absl::StrCat("--server: ", st.message()));
  }
  if (absl::GetFlag(FLAGS_timeout_s) < 1) {
    shardopt::UsageError(absl::StrCat("--timeout_s must be at least 1, got ", absl::GetFlag(FLAGS_timeout_s)));
  }
  v1::ReadRequest read;
  if (command == "read") {
    read.set_job(args[1]);
    read.set_tensor(args[2]);
    const std::map<std::string, v1::StateKind> kinds = {
        {"master", v1::MASTER}, {"exp_avg", v1::EXP_AVG}, {"exp_avg_sq", v1::EXP_AVG_SQ}, {"param", v1::PARAM_BF16}};
    const auto kind = kinds.find(args[3]);
    if (kind == kinds.end()) {
      shardopt::UsageError(absl::StrCat("read: the state is master, exp_avg, exp_avg_sq or param, not '", args[3],
                                        "'\nusage: shardopt ", verb->synopsis));
    }
    read.set_kind(kind->second);
    if (n > 3) read.set_offset(ParseCount(*verb, "OFFSET", args[4]));
    if (n > 4) read.set_length(ParseCount(*verb, "COUNT", args[5]));
  }

  grpc::ChannelArguments channel_args;
  shardopt::TuneChannelArguments(&channel_args);
  // gRPC gives one connection attempt 20 s (GRPC_ARG_MIN_RECONNECT_BACKOFF_MS
  // is that timeout too): a server that accepts and never answers failed a
  // longer --timeout_s there, UNAVAILABLE, read as down where it is hung.
  // The attempt may take a call's whole --timeout_s and 10 s more, so that
  // the call's deadline always ends it first (at exactly the deadline, the
  // attempt's end won the race at times).
  channel_args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS,
                      (std::max(10, std::min(absl::GetFlag(FLAGS_timeout_s), INT_MAX / 1000 - 10)) + 10) * 1000);
  if (const std::string name = absl::GetFlag(FLAGS_tls_server_name); !name.empty()) {
    if (absl::GetFlag(FLAGS_tls_ca).empty() && absl::GetFlag(FLAGS_tls_cert).empty() &&
        absl::GetFlag(FLAGS_tls_key).empty()) {
      shardopt::UsageError("--tls_server_name is for TLS: give --tls_ca too");
    }
    channel_args.SetSslTargetNameOverride(name);
  }
  // The PEM files, then the token file.
  std::string text[4];
  const std::string paths[4] = {absl::GetFlag(FLAGS_tls_ca), absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                                absl::GetFlag(FLAGS_token_file)};
  for (int i = 0; i < 4; ++i) {
    if (paths[i].empty()) continue;
    std::ifstream in(paths[i]);
    std::stringstream contents;
    contents << in.rdbuf();
    if (!in) return Fail(absl::NotFoundError(absl::StrCat(paths[i], " cannot be read")));
    text[i] = contents.str();
    // An empty PEM file would mean no TLS at all: plaintext, to a server the
    // caller meant to verify. (An empty token file is refused below.)
    if (i < 3 && absl::StripAsciiWhitespace(text[i]).empty()) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(paths[i], " holds nothing (empty, or not a file): TLS needs its PEM text")));
    }
  }
  if (absl::Status tls = shardopt::CheckTlsPem(text[0], text[1], text[2]); !tls.ok()) {
    // CheckTlsPem names each file by its role; here its path is known too.
    std::string given;
    const char* flags[3] = {"--tls_ca", "--tls_cert", "--tls_key"};
    for (int i = 0; i < 3; ++i) {
      if (!paths[i].empty()) absl::StrAppend(&given, given.empty() ? "" : ", ", flags[i], "=", paths[i]);
    }
    return Fail(absl::Status(tls.code(), absl::StrCat(tls.message(), " (", given, ")")));
  }
  // The file's token, else the environment's. A file that holds none is a
  // mistake (an empty Secret), not a wish to call without a token.
  if (!paths[3].empty() && absl::StripAsciiWhitespace(text[3]).empty()) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(paths[3], " holds no token (empty, only whitespace, or not a file)")));
  }
  const char* env = std::getenv("SHARDOPT_TOKEN");
  auto token = shardopt::CleanBearerToken(!paths[3].empty() ? absl::string_view(text[3])
                                          : env != nullptr  ? absl::string_view(env)
                                                            : absl::string_view());
  if (!token.ok()) return Fail(token.status());
  auto stub = v1::Optimizer::NewStub(grpc::CreateCustomChannel(
      absl::GetFlag(FLAGS_server), shardopt::ChannelCredentialsFor(text[0], text[1], text[2]), channel_args));
  // One context per call, each with the token and a deadline: a server that
  // does not answer must not hang the tool.
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  const auto context = [&] {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->set_deadline(std::chrono::system_clock::now() +
                                  std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s)));
    if (!token->empty()) contexts.back()->AddMetadata("authorization", "Bearer " + *token);
    return contexts.back().get();
  };

  // Every page of the job's tensors, as one answer.
  const auto describe = [&](v1::DescribeResponse* resp) {
    google::protobuf::RepeatedPtrField<v1::TensorState> tensors;
    do {
      v1::DescribeRequest req;
      req.set_job(args[1]);
      req.set_tensor_offset(tensors.size());
      if (auto st = stub->Describe(context(), req, resp); !st.ok()) return st;
      if (resp->tensors_size() == 0) break;
      for (v1::TensorState& t : *resp->mutable_tensors()) *tensors.Add() = std::move(t);
    } while (static_cast<uint32_t>(tensors.size()) < resp->tensor_count());
    *resp->mutable_tensors() = std::move(tensors);
    resp->set_tensor_offset(0);  // the pages joined: the answer starts at the first tensor
    return grpc::Status::OK;
  };
  if (command == "describe") {
    v1::DescribeResponse resp;
    if (auto st = describe(&resp); !st.ok()) return Fail(st);
    PrintJson(resp);
    return 0;
  }
  if (command == "list") {
    v1::ListJobsRequest req;
    v1::ListJobsResponse page, all;
    do {
      if (auto st = stub->ListJobs(context(), req, &page); !st.ok()) return Fail(st);
      if (page.jobs_size() == 0) break;
      req.set_after(page.jobs(page.jobs_size() - 1).job());
      for (v1::JobSummary& job : *page.mutable_jobs()) *all.add_jobs() = std::move(job);
    } while (page.more());
    page.mutable_jobs()->Swap(all.mutable_jobs());
    page.set_more(false);  // the pages joined
    PrintJson(page);
    return 0;
  }
  if (command == "checkpoint") {
    v1::CheckpointRequest req;
    req.set_job(args[1]);
    if (n > 1) {
      req.set_step(ParseCount(*verb, "STEP", args[2]));
    } else {
      v1::DescribeRequest ask;
      ask.set_job(args[1]);
      ask.set_max_tensors(1);  // the step, not the tensors
      v1::DescribeResponse held;
      if (auto st = stub->Describe(context(), ask, &held); !st.ok()) return Fail(st, kNoCheckpointAsked);
      req.set_step(held.step());
    }
    v1::CheckpointResponse resp;
    if (auto st = stub->Checkpoint(context(), req, &resp); !st.ok()) return Fail(st, kEffectUnknown);
    PrintJson(resp);
    return 0;
  }
  if (command == "drop") {
    v1::DropJobRequest req;
    req.set_job(args[1]);
    v1::DropJobResponse resp;
    if (auto st = stub->DropJob(context(), req, &resp); !st.ok()) return Fail(st, kEffectUnknown);
    std::cout << "dropped " << args[1] << "\n";
    return 0;
  }
  // read. Without an OFFSET, from the start of this server's shard, which
  // is the tensor's start on one server only.
  if (n <= 3) {
    v1::DescribeResponse held;
    if (auto st = describe(&held); !st.ok()) return Fail(st);
    for (const v1::TensorState& t : held.tensors()) {
      if (t.name() == read.tensor()) read.set_offset(t.shard().offset());
    }
  }
  // The chunks of a read are one step's state only if they all say the
  // same step: a trainer committing meanwhile would mix two. So the read is
  // kept whole until it ends, and made again (three tries) while they differ.
  for (int attempt = 1;; ++attempt) {
    grpc::ClientContext* ctx = context();
    auto reader = stub->Read(ctx, read);
    std::vector<v1::StateChunk> chunks;
    bool mixed = false;
    for (v1::StateChunk chunk; !mixed && reader->Read(&chunk);) {
      mixed = !chunks.empty() && chunk.step() != chunks.front().step();
      chunks.push_back(std::move(chunk));
    }
    if (mixed) ctx->TryCancel();
    if (auto st = reader->Finish(); !mixed && !st.ok()) return Fail(st);
    if (!mixed) {
      for (const v1::StateChunk& chunk : chunks) PrintValues(chunk);
      return 0;
    }
    if (attempt == 3) {
      return Fail(absl::AbortedError(absl::StrCat(
          "tensor '", read.tensor(), "' of job '", read.job(), "' changed step during each of 3 reads (a trainer "
          "is stepping it); read it between steps, or a smaller range")));
    }
  }
}
