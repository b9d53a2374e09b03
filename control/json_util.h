// Small helpers for reading operator-supplied JSON with errors that name the field.
// Every failure is INVALID_ARGUMENT "<path>: <problem>".
#ifndef MOE_CONTROL_JSON_UTIL_H_
#define MOE_CONTROL_JSON_UTIL_H_

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace moe::json {

using Json = nlohmann::ordered_json;

// Arrays and objects nested deeper than this are refused (INVALID_ARGUMENT naming `what`).
inline constexpr int kMaxNesting = 64;

absl::StatusOr<Json> ParseFile(const std::string& path);
// `text` as the file `path`, whole or not at all: written beside it and renamed over it once
// flushed and closed, so that a failed write leaves any earlier file as it was.
// INVALID_ARGUMENT "<what> <path>: cannot write (<reason>)".
absl::Status WriteFile(const std::string& path, const std::string& text, const std::string& what);
absl::StatusOr<Json> Parse(const std::string& text, const std::string& what);

inline absl::Status Invalid(const std::string& path, const std::string& problem) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", problem));
}

// Member `key` of object `obj` (at `path`); NOT_FOUND-style INVALID_ARGUMENT when missing.
absl::StatusOr<const Json*> Member(const Json& obj, const std::string& path, const std::string& key);
absl::StatusOr<int64_t> Int(const Json& v, const std::string& path);
absl::StatusOr<double> Number(const Json& v, const std::string& path);
absl::StatusOr<std::string> String(const Json& v, const std::string& path);
absl::StatusOr<const Json*> Array(const Json& v, const std::string& path);
absl::StatusOr<bool> Bool(const Json& v, const std::string& path);

// Refuses a member of object `obj` (at `path`; "" at the top) that is not one of `known`:
// INVALID_ARGUMENT "<path>.<key>: unknown member (known: ...)". For documents whose every member
// changes what runs, where one this reader skipped would be served as if it were not there.
absl::Status OnlyMembers(const Json& obj, const std::string& path, std::initializer_list<const char*> known);

// Optional members: the fallback when absent.
absl::StatusOr<int64_t> IntOr(const Json& obj, const std::string& path, const std::string& key, int64_t fallback);
absl::StatusOr<std::string> StringOr(const Json& obj, const std::string& path, const std::string& key,
                                     const std::string& fallback);

}  // namespace moe::json

#endif  // MOE_CONTROL_JSON_UTIL_H_
