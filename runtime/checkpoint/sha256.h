// SHA-256 as lowercase hex, fed incrementally (OpenSSL's EVP): the checkpoint's expert digests,
// their combination per slot and the version of a directory without a sidecar.
#ifndef MOE_RUNTIME_CHECKPOINT_SHA256_H_
#define MOE_RUNTIME_CHECKPOINT_SHA256_H_

#include <cstddef>
#include <string>

#include <openssl/evp.h>

namespace moe {

class Sha256Hex {
 public:
  Sha256Hex() : ctx_(EVP_MD_CTX_new()) { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }
  ~Sha256Hex() { EVP_MD_CTX_free(ctx_); }
  Sha256Hex(const Sha256Hex&) = delete;
  Sha256Hex& operator=(const Sha256Hex&) = delete;

  void Update(const void* p, size_t bytes) { EVP_DigestUpdate(ctx_, p, bytes); }
  // The 64 hex digits (once: the context is finished).
  std::string Finish() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    EVP_DigestFinal_ex(ctx_, md, &len);
    static const char kHex[] = "0123456789abcdef";
    std::string out;
    for (unsigned int i = 0; i < len; ++i) {
      out.push_back(kHex[md[i] >> 4]);
      out.push_back(kHex[md[i] & 15]);
    }
    return out;
  }

 private:
  EVP_MD_CTX* ctx_;
};

}  // namespace moe

#endif  // MOE_RUNTIME_CHECKPOINT_SHA256_H_
