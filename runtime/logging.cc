#include "runtime/logging.h"

#include "spdlog/sinks/stdout_color_sinks.h"

namespace moe {

void InitLogging(const std::string& program, const std::string& level) {
  auto logger = spdlog::stderr_color_mt(program);
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %n: %v");
  logger->set_level(spdlog::level::from_str(level));
  spdlog::set_default_logger(logger);
}

}  // namespace moe
