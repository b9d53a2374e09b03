#include "runtime/status.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace moe {

int ExitCode(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return kExitOk;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kOutOfRange:
      return kExitUsage;
    default:
      return kExitFailure;
  }
}

void CheckFailed(const char* condition, const char* file, int line, absl::string_view message) {
  std::fprintf(stderr, "%s:%d: invariant violated: %s%s%.*s\n", file, line, condition, message.empty() ? "" : ": ",
               static_cast<int>(message.size()), message.data());
  std::fflush(stderr);
  std::abort();
}

absl::Status ForeignError(absl::StatusCode code, absl::string_view library, absl::string_view code_name,
                          absl::string_view message, absl::string_view expr, const char* file, int line) {
  return absl::Status(
      code, absl::StrCat(library, " error ", code_name, " (", message, ") in `", expr, "` at ", file, ":", line));
}

absl::Status ErrnoError(int err, absl::string_view expr, const char* file, int line) {
  absl::StatusCode code = absl::StatusCode::kInternal;
  switch (err) {
    case ENOENT:
      code = absl::StatusCode::kNotFound;
      break;
    case EACCES:
    case EPERM:
      code = absl::StatusCode::kPermissionDenied;
      break;
    case EEXIST:
      code = absl::StatusCode::kAlreadyExists;
      break;
    case EINVAL:
      code = absl::StatusCode::kInvalidArgument;
      break;
    case ETIMEDOUT:
      code = absl::StatusCode::kDeadlineExceeded;
      break;
    case ENOMEM:
    case ENOSPC:
      code = absl::StatusCode::kResourceExhausted;
      break;
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
      code = absl::StatusCode::kUnavailable;
      break;
    default:
      break;
  }
  const char* name = strerrorname_np(err);
  return ForeignError(code, "errno", name != nullptr ? name : "E?", std::strerror(err), expr, file, line);
}

}  // namespace moe
