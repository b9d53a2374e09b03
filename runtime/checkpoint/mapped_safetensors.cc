#include "runtime/checkpoint/mapped_safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <sys/mman.h>
#include <sys/stat.h>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace moe {

int SafetensorsDtypeWidth(const std::string& dtype) {
  if (dtype == "BF16" || dtype == "F16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "U8" || dtype == "I8" || dtype == "F8_E4M3" || dtype == "F8_E5M2" || dtype == "BOOL") return 1;
  return 0;
}

int64_t TensorRef::elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // checked at Open
  return n;
}

namespace {

absl::Status Corrupt(const std::string& path, const std::string& what) {
  return absl::DataLossError(absl::StrCat(path, ": ", what));
}

// The tensor's byte count from dtype and shape, or an error naming it (overflow included).
absl::StatusOr<uint64_t> ShapeBytes(const std::string& path, const std::string& name, const TensorRef& t) {
  const int width = SafetensorsDtypeWidth(t.dtype);
  if (width == 0) return Corrupt(path, absl::StrCat("tensor ", name, ": unknown dtype '", t.dtype, "'"));
  uint64_t n = static_cast<uint64_t>(width);
  for (int64_t d : t.shape) {
    if (d < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) {
      return Corrupt(path, absl::StrCat("tensor ", name, ": shape overflows or has a negative dimension"));
    }
  }
  return n;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MappedSafetensors>> MappedSafetensors::Open(const std::string& path) {
  // O_NONBLOCK: a FIFO's open would otherwise wait for a writer (no effect on regular files).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return absl::NotFoundError(absl::StrCat(path, ": cannot stat: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    // A device or FIFO (a path handed in a bundle) would be read without end or block the reader.
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(path, ": not a regular file"));
  }
  std::unique_ptr<MappedSafetensors> f(new MappedSafetensors());
  f->path_ = path;
  f->size_ = static_cast<uint64_t>(st.st_size);
  if (f->size_ < 8) {
    ::close(fd);
    return Corrupt(path, "shorter than the header length");
  }
  f->fd_ = fd;  // closed with the mapping
  void* p = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
  if (p == MAP_FAILED) return absl::ResourceExhaustedError(absl::StrCat(path, ": mmap: ", std::strerror(errno)));
  f->base_ = static_cast<const uint8_t*>(p);
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(f->base_[i]) << (8 * i);
  if (len > f->size_ - 8) return Corrupt(path, "header length past the end of file");
  if (len > kMaxHeaderBytes) {
    return Corrupt(path, absl::StrCat("header length ", len, " bytes is past the ", kMaxHeaderBytes >> 20,
                                      " MiB a header may have"));
  }
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(f->base_ + 8, f->base_ + 8 + len);
  } catch (const nlohmann::json::exception& e) {
    return Corrupt(path, absl::StrCat("malformed header: ", e.what()));
  }
  if (!header.is_object()) return Corrupt(path, "header is not a JSON object");
  const uint64_t data_start = 8 + len;
  const uint64_t data_size = f->size_ - data_start;
  std::vector<std::pair<uint64_t, uint64_t>> extents;
  for (auto it = header.begin(); it != header.end(); ++it) {
    try {
      if (it.key() == "__metadata__") {
        for (auto m = it.value().begin(); m != it.value().end(); ++m)
          f->metadata_[m.key()] = m.value().get<std::string>();
        continue;
      }
      const auto& v = it.value();
      TensorRef t;
      t.dtype = v.at("dtype").get<std::string>();
      t.shape = v.at("shape").get<std::vector<int64_t>>();
      const auto off = v.at("data_offsets").get<std::vector<uint64_t>>();
      if (off.size() != 2 || off[0] > off[1] || off[1] > data_size) {
        return Corrupt(path, absl::StrCat("tensor ", it.key(), ": data_offsets outside the data"));
      }
      auto bytes = ShapeBytes(path, it.key(), t);
      if (!bytes.ok()) return bytes.status();
      if (*bytes != off[1] - off[0]) {
        return Corrupt(path, absl::StrCat("tensor ", it.key(), ": ", off[1] - off[0], " bytes do not match ", t.dtype,
                                          " of its shape (", *bytes, ")"));
      }
      t.data = f->base_ + data_start + off[0];
      t.bytes = *bytes;
      if (off[1] > off[0]) extents.emplace_back(off[0], off[1]);  // an empty tensor overlaps nothing
      f->tensors_[it.key()] = std::move(t);
    } catch (const nlohmann::json::exception& e) {
      return Corrupt(path, absl::StrCat("tensor ", it.key(), ": ", e.what()));
    }
  }
  std::sort(extents.begin(), extents.end());
  for (size_t i = 1; i < extents.size(); ++i) {
    if (extents[i].first < extents[i - 1].second) return Corrupt(path, "tensors' data_offsets overlap");
  }
  return f;
}

MappedSafetensors::~MappedSafetensors() {
  if (base_ != nullptr) ::munmap(const_cast<uint8_t*>(base_), size_);
  if (fd_ >= 0) ::close(fd_);
}

absl::Status MappedSafetensors::CheckIntact() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return absl::DataLossError(absl::StrCat(path_, ": cannot stat: ", std::strerror(errno)));
  if (static_cast<uint64_t>(st.st_size) < size_) {
    return absl::DataLossError(
        absl::StrCat(path_, ": the file is ", st.st_size, " bytes, ", size_,
                     " when it was opened: it was truncated or rewritten in place (replace a "
                     "served checkpoint's files by rename, or restart the rank on the new one)"));
  }
  return absl::OkStatus();
}

const TensorRef* MappedSafetensors::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

void MappedSafetensors::Prefetch(const TensorRef& t) const {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t begin = static_cast<uint64_t>(t.data - base_) / page * page;
  const uint64_t end = static_cast<uint64_t>(t.data - base_) + t.bytes;
  if (end > begin) ::madvise(const_cast<uint8_t*>(base_) + begin, end - begin, MADV_WILLNEED);
}

void MappedSafetensors::Release(const TensorRef& t) const {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t begin = static_cast<uint64_t>(t.data - base_);
  const uint64_t first = (begin + page - 1) / page * page, last = (begin + t.bytes) / page * page;
  if (last > first) ::madvise(const_cast<uint8_t*>(base_) + first, last - first, MADV_DONTNEED);
}

}  // namespace moe
