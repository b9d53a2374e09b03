#include "control/json_util.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace moe::json {

namespace {

// The deepest nesting of arrays and objects in `text`, outside strings. The parser is iterative,
// but copying, comparing and dumping a parsed value recurse: a document a million levels deep
// would overflow the stack of whatever handles it next.
int NestingDepth(const std::string& text) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

}  // namespace

absl::StatusOr<Json> Parse(const std::string& text, const std::string& what) {
  if (NestingDepth(text) > kMaxNesting) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": nested deeper than ", kMaxNesting, " levels"));
  }
  try {
    return Json::parse(text);
  } catch (const Json::exception& e) {  // parse errors, and out_of_range for a number such as 1e999
    return absl::InvalidArgumentError(absl::StrCat(what, ": malformed JSON: ", e.what()));
  }
}

absl::StatusOr<Json> ParseFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(path, ": cannot open file"));
  std::stringstream ss;
  ss << in.rdbuf();
  return Parse(ss.str(), path);
}

absl::Status WriteFile(const std::string& path, const std::string& text, const std::string& what) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  auto failed = [&](const std::string& why) {
    std::remove(tmp.c_str());
    return absl::InvalidArgumentError(absl::StrCat(what, " ", path, ": cannot write (", why, ")"));
  };
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return failed(std::strerror(errno));
    out << text;
    out.close();
    if (out.fail()) return failed("short write");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return failed(std::strerror(errno));
  return absl::OkStatus();
}

absl::StatusOr<const Json*> Member(const Json& obj, const std::string& path, const std::string& key) {
  if (!obj.is_object()) return Invalid(path, "expected an object");
  auto it = obj.find(key);
  if (it == obj.end()) return Invalid(path.empty() ? key : absl::StrCat(path, ".", key), "missing");
  return &*it;
}

absl::Status OnlyMembers(const Json& obj, const std::string& path, std::initializer_list<const char*> known) {
  if (!obj.is_object()) return Invalid(path.empty() ? "document" : path, "expected an object");
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    bool ok = false;
    for (const char* k : known) ok = ok || it.key() == k;
    if (ok) continue;
    std::string names;
    for (const char* k : known) absl::StrAppend(&names, names.empty() ? "" : ", ", k);
    return Invalid(path.empty() ? it.key() : absl::StrCat(path, ".", it.key()),
                   absl::StrCat("unknown member (known: ", names, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Int(const Json& v, const std::string& path) {
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::floor(d) == d && std::abs(d) < 9e15) return static_cast<int64_t>(d);
  }
  return Invalid(path, absl::StrCat("expected an integer, got ", v.dump()));
}

absl::StatusOr<double> Number(const Json& v, const std::string& path) {
  if (v.is_number()) return v.get<double>();
  return Invalid(path, absl::StrCat("expected a number, got ", v.dump()));
}

absl::StatusOr<std::string> String(const Json& v, const std::string& path) {
  if (v.is_string()) return v.get<std::string>();
  return Invalid(path, absl::StrCat("expected a string, got ", v.dump()));
}

absl::StatusOr<const Json*> Array(const Json& v, const std::string& path) {
  if (v.is_array()) return &v;
  return Invalid(path, absl::StrCat("expected an array, got ", v.type_name()));
}

absl::StatusOr<bool> Bool(const Json& v, const std::string& path) {
  if (v.is_boolean()) return v.get<bool>();
  return Invalid(path, absl::StrCat("expected true or false, got ", v.dump()));
}

absl::StatusOr<int64_t> IntOr(const Json& obj, const std::string& path, const std::string& key, int64_t fallback) {
  if (!obj.is_object() || !obj.contains(key)) return fallback;
  return Int(obj.at(key), absl::StrCat(path, path.empty() ? "" : ".", key));
}

absl::StatusOr<std::string> StringOr(const Json& obj, const std::string& path, const std::string& key,
                                     const std::string& fallback) {
  if (!obj.is_object() || !obj.contains(key)) return fallback;
  return String(obj.at(key), absl::StrCat(path, path.empty() ? "" : ".", key));
}

}  // namespace moe::json
