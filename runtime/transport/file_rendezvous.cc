#include "runtime/transport/file_rendezvous.h"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace moe {
namespace {

// The whole of a published file; nullopt while it is absent or empty.
std::optional<std::string> ReadPublished(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::string contents((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (contents.empty()) return std::nullopt;
  return contents;
}

}  // namespace

absl::Status PublishFile(const std::string& dir, const std::string& name, absl::string_view contents) {
  const std::string path = absl::StrCat(dir, "/", name);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    if (!out.flush()) return absl::UnavailableError(absl::StrCat("rendezvous: cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("rendezvous: cannot publish ", name, " into ", dir));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> AwaitFiles(const std::string& dir, const std::vector<std::string>& names,
                                                    absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<std::optional<std::string>> got(names.size());
  while (true) {
    std::vector<std::string> missing;
    for (size_t i = 0; i < names.size(); ++i) {
      if (!got[i].has_value()) got[i] = ReadPublished(absl::StrCat(dir, "/", names[i]));
      if (!got[i].has_value()) missing.push_back(names[i]);
    }
    if (missing.empty()) break;
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("rendezvous: ", absl::StrJoin(missing, ", "),
                                                      " not published in ", dir, " within ",
                                                      absl::FormatDuration(timeout)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::vector<std::string> out;
  out.reserve(names.size());
  for (std::optional<std::string>& g : got) out.push_back(*std::move(g));
  return out;
}

}  // namespace moe
