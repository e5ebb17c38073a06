// Early returns on error, named after abseil's later ABSL_RETURN_IF_ERROR and
// ABSL_ASSIGN_OR_RETURN so that an upgrade to an abseil that has them is a
// rename. Debian 12's abseil (20220623) has neither.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Evaluates `expr`, an absl::Status, and returns it from the calling
// function unless it is OK.
#define SHARDOPT_RETURN_IF_ERROR(expr)                  \
  do {                                                  \
    if (::absl::Status shardopt_status_ = (expr);       \
        !shardopt_status_.ok()) {                       \
      return shardopt_status_;                          \
    }                                                   \
  } while (false)

// Evaluates `rexpr`, an absl::StatusOr<T>; returns its status from the
// calling function unless it is OK, else moves its value into `lhs`
// (a declaration such as `auto x` or an existing variable).
#define SHARDOPT_ASSIGN_OR_RETURN(lhs, rexpr) \
  SHARDOPT_ASSIGN_OR_RETURN_IMPL_(SHARDOPT_STATUS_CONCAT_(shardopt_statusor_, __LINE__), lhs, rexpr)

#define SHARDOPT_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                    \
  if (!statusor.ok()) return std::move(statusor).status();    \
  lhs = *std::move(statusor)

#define SHARDOPT_STATUS_CONCAT_INNER_(a, b) a##b
#define SHARDOPT_STATUS_CONCAT_(a, b) SHARDOPT_STATUS_CONCAT_INNER_(a, b)
