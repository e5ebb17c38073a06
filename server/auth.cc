#include "server/auth.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "rpc/bearer_token.h"
#include "server/memory_budget.h"
#include "server/messages.h"

namespace shardopt {
namespace {

constexpr size_t kMinTokenBytes = 16;

// Equal when `given` is `secret`, in time that depends only on the length
// of `secret`: every byte is looked at whatever the first difference.
bool ConstantTimeEquals(absl::string_view secret, absl::string_view given) {
  unsigned diff = secret.size() != given.size();
  for (size_t i = 0; i < secret.size(); ++i) {
    const unsigned char g = given.empty() ? 0 : given[i % given.size()];
    diff |= static_cast<unsigned char>(secret[i]) ^ g;
  }
  return diff == 0;
}

}  // namespace

const char* ActionName(Action a) {
  switch (a) {
    case Action::kCreate: return "CreateJob";
    case Action::kInit: return "Init";
    case Action::kPush: return "Push";
    case Action::kCommit: return "Commit";
    case Action::kDescribe: return "Describe";
    case Action::kRead: return "Read";
    case Action::kCheckpoint: return "Checkpoint";
    case Action::kDrop: return "DropJob";
  }
  return "?";
}

bool Caller::Covers(const std::string& job) const {
  return role == Role::kAdmin ||
         std::any_of(prefixes.begin(), prefixes.end(),
                     [&](const std::string& p) { return p == "*" || absl::StartsWith(job, p); });
}

absl::Status Caller::Allows(Action action, const std::string& job) const {
  if (role == Role::kAdmin) return absl::OkStatus();
  // No job is no job outside the prefixes: the caller's mistake, as the
  // store tells an admin (JobStore::Find), not a refusal of its rights.
  if (job.empty()) return absl::InvalidArgumentError("the request names no job (its job is empty)");
  if (!Covers(job)) {
    return absl::PermissionDeniedError(absl::StrCat("'", name, "' may not ", ActionName(action), " job ", Quote(job),
                                                    ": it is outside the token's job prefixes"));
  }
  if (action == Action::kDrop) {
    return absl::PermissionDeniedError(absl::StrCat(
        "'", name, "' is a trainer; only an admin token may DropJob (job ", Quote(job),
        "), but for a job of the trainer's prefixes that holds nothing yet, dropped naming its life "
        "(DropJobRequest.incarnation)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<TokenTable> TokenTable::Parse(absl::string_view text) {
  TokenTable table;
  absl::flat_hash_map<std::string, int> names;  // each name's line
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    std::vector<absl::string_view> fields = absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    // A comment begins with a field that begins with '#'. A '#' inside a
    // field is the field's: a job prefix "ml#a/" cut at its '#' read as
    // "ml", every job of "ml#b/" included (an outside probe's tenant read
    // and stepped another's job so), and a token cut so matched a shorter one.
    fields.erase(std::find_if(fields.begin(), fields.end(), [](absl::string_view f) { return f.front() == '#'; }),
                 fields.end());
    if (fields.empty()) continue;
    // Errors name lines, never a field: in a line that lacks a column, any
    // field may be the token.
    const auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("tokens file line ", line_number, ": ", why));
    };
    if (fields.size() < 3) return bad("expected <name> <role> <token> [<prefix> ...] [max_memory=<bytes>]");
    Entry e;
    e.caller.name = std::string(fields[0]);
    if (fields[1] == "trainer") {
      e.caller.role = Role::kTrainer;
    } else if (fields[1] == "admin") {
      e.caller.role = Role::kAdmin;
    } else {
      return bad("the role (second field) is neither trainer nor admin");
    }
    e.token = std::string(fields[2]);
    if (e.token.size() < kMinTokenBytes) {
      return bad(absl::StrCat("the token (third field) is shorter than ", kMinTokenBytes, " characters"));
    }
    if (!std::all_of(e.token.begin(), e.token.end(), SendableTokenByte)) {
      return bad("the token (third field) holds a byte that is not printable ASCII, which no client can send");
    }
    for (size_t i = 3; i < fields.size(); ++i) {
      constexpr absl::string_view kMaxMemory = "max_memory=";
      if (!absl::StartsWithIgnoreCase(fields[i], kMaxMemory)) {
        e.caller.prefixes.emplace_back(fields[i]);
        continue;
      }
      // Read as a prefix, "MAX_MEMORY=5Mi" would leave the token uncapped,
      // and the "Mi" of "max_memory=5 Mi" would scope it to jobs named Mi...
      if (!absl::StartsWith(fields[i], kMaxMemory)) return bad("max_memory= is written in lower case");
      if (i + 1 != fields.size()) return bad("max_memory= must be the line's last field, its bytes without a space");
      const std::optional<uint64_t> bytes = MemoryBudget::ParseBytes(fields[i].substr(kMaxMemory.size()));
      if (!bytes) return bad("max_memory= needs a positive byte count such as 64Gi or 512M");
      e.caller.max_memory = *bytes;
    }
    if (e.caller.role == Role::kTrainer && e.caller.prefixes.empty()) {
      return bad("a trainer without a job prefix (give '*' for every job)");
    }
    // An admin may use every job: prefixes there would read as a scope that
    // is not kept.
    // ('*' alone says what an admin has anyway, and files written so before
    // this check keep loading.)
    if (e.caller.role == Role::kAdmin &&
        !std::all_of(e.caller.prefixes.begin(), e.caller.prefixes.end(), [](const std::string& p) { return p == "*"; })) {
      return bad("an admin with job prefixes: an admin may use every job (make it a trainer to scope it)");
    }
    if (auto [it, added] = names.emplace(e.caller.name, line_number); !added) {
      return bad(absl::StrCat("the name of line ", it->second, " again"));
    }
    for (const Entry& other : table.entries_) {
      if (ConstantTimeEquals(other.token, e.token)) {
        return bad(absl::StrCat("the token of line ", names[other.caller.name], " again"));
      }
    }
    table.entries_.push_back(std::move(e));
  }
  return table;
}

absl::StatusOr<Caller> TokenTable::Authenticate(absl::string_view authorization) const {
  if (authorization.empty()) {
    return absl::UnauthenticatedError("this server needs a bearer token (metadata 'authorization: Bearer <token>')");
  }
  // The scheme in any case (RFC 7235) and spaces around the token, which
  // holds none (Parse splits the file's columns on them).
  constexpr absl::string_view kScheme = "Bearer ";
  if (authorization.size() < kScheme.size() ||
      !absl::EqualsIgnoreCase(authorization.substr(0, kScheme.size()), kScheme)) {
    return absl::UnauthenticatedError("the 'authorization' metadata must be 'Bearer <token>'");
  }
  const absl::string_view token = absl::StripAsciiWhitespace(authorization.substr(kScheme.size()));
  const Entry* found = nullptr;
  for (const Entry& e : entries_) {  // no early exit: the time says nothing of which entry matched
    if (ConstantTimeEquals(e.token, token)) found = &e;
  }
  if (found == nullptr) return absl::UnauthenticatedError("the bearer token is not one this server knows");
  return found->caller;
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromFile(std::string path) {
  std::unique_ptr<Authenticator> auth(new Authenticator(std::move(path)));
  if (absl::Status st = auth->Reload(); !st.ok()) return st;
  return auth;
}

absl::Status Authenticator::Reload() {
  // A directory opens and reads as empty: "has no token" would mislead.
  if (std::error_code ec; std::filesystem::is_directory(path_, ec)) {
    return absl::InvalidArgumentError(absl::StrCat(path_, " is a directory, not a tokens file"));
  }
  std::ifstream in(path_);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) return absl::NotFoundError(absl::StrCat("tokens file ", path_, " cannot be read"));
  auto table = TokenTable::Parse(text.str());
  if (!table.ok()) return absl::Status(table.status().code(), absl::StrCat(path_, ": ", table.status().message()));
  if (table->size() == 0) return absl::InvalidArgumentError(absl::StrCat("tokens file ", path_, " has no token"));
  auto shared = std::make_shared<const TokenTable>(*std::move(table));
  absl::MutexLock lock(&mu_);
  table_ = std::move(shared);
  generation_.fetch_add(1, std::memory_order_release);
  return absl::OkStatus();
}

absl::StatusOr<Caller> Authenticator::Authenticate(absl::string_view authorization) const {
  std::shared_ptr<const TokenTable> table;
  {
    absl::MutexLock lock(&mu_);
    table = table_;
  }
  return table->Authenticate(authorization);
}

size_t Authenticator::size() const {
  absl::MutexLock lock(&mu_);
  return table_->size();
}

std::vector<std::pair<std::string, uint64_t>> TokenTable::MaxMemory() const {
  std::vector<std::pair<std::string, uint64_t>> caps;
  for (const Entry& e : entries_) {
    if (e.caller.max_memory > 0) caps.emplace_back(e.caller.name, e.caller.max_memory);
  }
  return caps;
}

std::vector<std::pair<std::string, uint64_t>> Authenticator::MaxMemory() const {
  absl::MutexLock lock(&mu_);
  return table_->MaxMemory();
}

}  // namespace shardopt
