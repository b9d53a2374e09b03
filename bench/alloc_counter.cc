#include "bench/alloc_counter.h"

#include <execinfo.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <new>

namespace {
thread_local int64_t t_allocations = 0;
thread_local bool t_trace = false;
thread_local bool t_in_trace = false;  // backtrace() may allocate: not traced again

void Count(std::size_t n) {
  ++t_allocations;
  if (!t_trace || t_in_trace) return;
  t_in_trace = true;
  void* frames[24];
  const int depth = backtrace(frames, 24);
  char line[64];
  const int len = std::snprintf(line, sizeof line, "allocation of %zu bytes:\n", n);
  if (len > 0) (void)!write(STDERR_FILENO, line, static_cast<std::size_t>(len));
  backtrace_symbols_fd(frames + 2, depth > 2 ? depth - 2 : 0, STDERR_FILENO);  // from the caller of new
  t_in_trace = false;
}

void* Allocate(std::size_t n) {
  Count(n);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* AllocateAligned(std::size_t n, std::align_val_t a) {
  Count(n);
  const std::size_t align = static_cast<std::size_t>(a);
  if (void* p = std::aligned_alloc(align, (n + align - 1) / align * align)) return p;
  throw std::bad_alloc();
}
}  // namespace

namespace moe::bench {
int64_t ThreadAllocations() { return t_allocations; }
void TraceThreadAllocations(bool on) {
  if (on) {  // the first backtrace() loads its unwinder: not inside a traced allocation
    void* frame[1];
    backtrace(frame, 1);
  }
  t_trace = on;
}
}  // namespace moe::bench

void* operator new(std::size_t n) { return Allocate(n); }
void* operator new[](std::size_t n) { return Allocate(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  Count(n);
  return std::malloc(n == 0 ? 1 : n);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  Count(n);
  return std::malloc(n == 0 ? 1 : n);
}
void* operator new(std::size_t n, std::align_val_t a) { return AllocateAligned(n, a); }
void* operator new[](std::size_t n, std::align_val_t a) { return AllocateAligned(n, a); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
