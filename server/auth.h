// Who may call what: bearer tokens, each with a role and the job-name
// prefixes it may use, read from a tokens file that a SIGHUP reloads.
// No gRPC here: the service hands in the `authorization` header's value
// (service.cc), and tests drive this directly.
//
// The tokens file, one token per line ('#' starts a comment):
//
//   <name> <role> <token> [<prefix> ...] [max_memory=<bytes>]
//
// - name: who holds the token, for logs and per-client caps; the token
//   itself is never logged.
// - role: `trainer` may create, initialize, push, commit, describe, read
//   and checkpoint jobs whose names start with one of its prefixes (`*` for
//   every job); `admin` may do all of that and drop, for any job.
// - token: at least 16 characters, compared in constant time.
// - max_memory: the most the jobs this token makes may hold on a server
//   (tenant_ledger.h), bytes with --memory_limit's suffixes (64Gi), last on
//   the line; none: no cap but the server's. (So a prefix cannot begin with
//   "max_memory=" in any case.)
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace shardopt {

enum class Role { kTrainer, kAdmin };

// What an RPC does to its job.
enum class Action { kCreate, kInit, kPush, kCommit, kDescribe, kRead, kCheckpoint, kDrop };
const char* ActionName(Action a);

// An authenticated caller.
struct Caller {
  std::string name;  // the tokens file's name, or the peer's address when tokens are off
  Role role = Role::kAdmin;
  std::vector<std::string> prefixes;  // empty with kAdmin: every job
  uint64_t max_memory = 0;            // the jobs it makes, on one server; 0: no cap

  // OK, or PERMISSION_DENIED naming the caller, the action and the job
  // (INVALID_ARGUMENT for a trainer's empty `job`, as the store answers an
  // admin's).
  absl::Status Allows(Action action, const std::string& job) const;
  // Whether `job` is under the caller's prefixes (an admin's: every job),
  // which every action but a drop needs; without building Allows' message.
  bool Covers(const std::string& job) const;
};

// Whether the caller of a stream, as the tokens are now, may do `action` to
// `job`: OK, UNAUTHENTICATED (its token is no longer in the file) or
// PERMISSION_DENIED. A stream asks at each message, so that a token removed,
// or its prefixes narrowed, stops the streams it has open too; the answer
// is worked out again only when the tokens were reloaded since
// (Authenticator::generation).
using CallerCheck = std::function<absl::Status(Action action, const std::string& job)>;

// One tokens file's contents.
class TokenTable {
 public:
  // INVALID_ARGUMENT naming the line when a line is malformed, a role is
  // unknown, a token is short or repeated, or a trainer has no prefix.
  static absl::StatusOr<TokenTable> Parse(absl::string_view text);

  // The caller of an `authorization` header's value ("Bearer <token>"):
  // UNAUTHENTICATED when it is empty, malformed or no token matches. Every
  // entry is compared, each in time that does not depend on where the
  // bytes differ.
  absl::StatusOr<Caller> Authenticate(absl::string_view authorization) const;
  size_t size() const { return entries_.size(); }
  // Each token's name and max_memory, for those that have one.
  std::vector<std::pair<std::string, uint64_t>> MaxMemory() const;

 private:
  struct Entry {
    std::string token;
    Caller caller;
  };
  std::vector<Entry> entries_;
};

// The server's tokens: a file, loaded at start and again on Reload.
class Authenticator {
 public:
  // The file must load, or the server does not start.
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromFile(std::string path);

  // Reads the file again. On an error the old tokens stay in force.
  absl::Status Reload() ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<Caller> Authenticate(absl::string_view authorization) const ABSL_LOCKS_EXCLUDED(mu_);
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<std::pair<std::string, uint64_t>> MaxMemory() const ABSL_LOCKS_EXCLUDED(mu_);
  // How many times tokens were loaded: a caller authorized at one value
  // needs no new check until it changes.
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }

 private:
  explicit Authenticator(std::string path) : path_(std::move(path)) {}
  const std::string path_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const TokenTable> table_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> generation_{0};  // bumped after table_ is replaced
};

}  // namespace shardopt
