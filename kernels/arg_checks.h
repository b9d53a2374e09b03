// The kernels' host-side checks of their params structs (validate.cc), before any launch:
// KERNEL_INVALID_IF(cond, message parts...) returns INVALID_ARGUMENT with the parts joined
// (absl::StrCat) when `cond` holds. Messages start with the params field they name.
#ifndef MOE_KERNELS_ARG_CHECKS_H_
#define MOE_KERNELS_ARG_CHECKS_H_

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

#define KERNEL_INVALID_IF(cond, ...)                                            \
  do {                                                                          \
    if (cond) return ::absl::InvalidArgumentError(::absl::StrCat(__VA_ARGS__)); \
  } while (0)

#endif  // MOE_KERNELS_ARG_CHECKS_H_
