// Process-wide logging: spdlog to stderr, one pattern for every binary of the project.
#ifndef MOE_RUNTIME_LOGGING_H_
#define MOE_RUNTIME_LOGGING_H_

#include <string>

#include "spdlog/spdlog.h"

namespace moe {

// Installs a stderr logger named `program` as spdlog's default. `level` is one of spdlog's
// level names ("info", "warn", "debug", ...); unknown names fall back to info.
void InitLogging(const std::string& program, const std::string& level = "info");

}  // namespace moe

#endif  // MOE_RUNTIME_LOGGING_H_
