// Status helpers shared by every layer of moe-runtime.
//
// Debian's Abseil (20220623) ships absl::Status / absl::StatusOr but no propagation macros,
// so this header keeps the two the codebase uses, plus one place that turns foreign error
// codes (errno, CUDA, NCCL, UCX, SQLite, ...) into absl::Status with the code's name, its
// message, the failing expression and file:line (the pattern of NCCL's checks.h).
//
// Thread-safety: everything here is stateless.
#ifndef MOE_RUNTIME_STATUS_H_
#define MOE_RUNTIME_STATUS_H_

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace moe {

// Builds the Status for a failed call into a foreign library. `library` names it ("CUDA",
// "NCCL", "UCX", "errno", ...), `code_name` is the library's symbolic code, `message` its
// text, `expr` the source expression.
absl::Status ForeignError(absl::StatusCode code, absl::string_view library, absl::string_view code_name,
                          absl::string_view message, absl::string_view expr, const char* file, int line);

// errno-style failure: maps common errno values to a matching absl::StatusCode.
absl::Status ErrnoError(int err, absl::string_view expr, const char* file, int line);

// Keeps the first error seen (teardown paths report the first failure, not the last).
inline void UpdateFirstError(absl::Status* first, const absl::Status& next) {
  if (first->ok() && !next.ok()) *first = next;
}

// The exit status of the moe-runtime daemons and tools (moe-rankd, moe-controller, engine_driver,
// ...; moectl has its own four-way table, docs/cli.md), so scripts tell a caller's mistake from a
// failure of the system:
//   0 (kExitOk)      the status is OK;
//   2 (kExitUsage)   the input was wrong: flags, files, arguments, or a request the other side
//                    refused as such (INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND,
//                    ALREADY_EXISTS, OUT_OF_RANGE);
//   1 (kExitFailure) anything else (unreachable or unauthenticated peers, internal errors).
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;
int ExitCode(const absl::Status& status);

// Aborts with file:line and the message when an invariant of the program (never of its input)
// does not hold: input is answered with a Status, a broken invariant is a bug.
[[noreturn]] void CheckFailed(const char* condition, const char* file, int line, absl::string_view message);

namespace status_internal {
inline absl::Status AsStatus(absl::Status s) { return s; }
template <typename T>
inline absl::Status AsStatus(const absl::StatusOr<T>& s) {
  return s.status();
}
}  // namespace status_internal

}  // namespace moe

#define MOE_STATUS_CONCAT_INNER_(a, b) a##b
#define MOE_STATUS_CONCAT_(a, b) MOE_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (a Status or StatusOr) is not OK.
#define RETURN_IF_ERROR(expr)                                              \
  do {                                                                     \
    ::absl::Status moe_status_ = ::moe::status_internal::AsStatus((expr)); \
    if (!moe_status_.ok()) return moe_status_;                             \
  } while (0)

// ASSIGN_OR_RETURN(lhs, rexpr): evaluates the StatusOr `rexpr`; on error returns its status,
// otherwise moves the value into `lhs` (which may be a declaration, e.g. `auto x`).
#define ASSIGN_OR_RETURN(lhs, rexpr) ASSIGN_OR_RETURN_IMPL_(MOE_STATUS_CONCAT_(moe_statusor_, __LINE__), lhs, rexpr)

#define ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                           \
  if (!statusor.ok()) return statusor.status();      \
  lhs = std::move(statusor).value()

// MOE_CHECK(cond) / MOE_CHECK(cond, message): the invariant `cond` holds, or the process aborts.
#define MOE_CHECK(cond, ...)                                                    \
  do {                                                                          \
    if (!(cond)) ::moe::CheckFailed(#cond, __FILE__, __LINE__, "" __VA_ARGS__); \
  } while (0)

// errno-returning POSIX calls: `RETURN_IF_ERRNO(::close(fd))` returns when the call is < 0.
#define RETURN_IF_ERRNO(expr)                                                   \
  do {                                                                          \
    if ((expr) < 0) return ::moe::ErrnoError(errno, #expr, __FILE__, __LINE__); \
  } while (0)

#endif  // MOE_RUNTIME_STATUS_H_
