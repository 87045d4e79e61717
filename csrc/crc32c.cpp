#include "crc32c.h"

#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace cudasnap {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

// Block sizes of the 3-way form: LONG thirds for large buffers, SHORT for what
// remains; a tail shorter than 3*SHORT goes through one chain.
constexpr size_t kLong = 8192;
constexpr size_t kShort = 256;

// The raw register update (no pre/post inversion) is linear over GF(2):
//   update(s, A || B) = zeros_|B|(update(s, A)) ^ update(0, B)
// where zeros_n(s) = update(s, n zero bytes). ZeroTable holds zeros_n for one n
// as four byte-indexed tables, so applying it is 4 lookups.
struct ZeroTable {
  uint32_t t[4][256];
  uint32_t apply(uint32_t c) const noexcept {
    return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
  }
};

struct Tables {
  uint32_t t[8][256];
  ZeroTable zlong, zshort;
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
    build_zeros(zlong, kLong);
    build_zeros(zshort, kShort);
  }
  uint32_t zero_bytes(uint32_t c, size_t n) const noexcept {
    while (n--) c = (c >> 8) ^ t[0][c & 0xff];
    return c;
  }
  // zeros_n on each of the 32 basis vectors, then every table entry is the XOR
  // of the basis images of its set bits (linearity).
  void build_zeros(ZeroTable& z, size_t n) const noexcept {
    uint32_t basis[32];
    for (int b = 0; b < 32; ++b) basis[b] = zero_bytes(1u << b, n);
    for (int k = 0; k < 4; ++k)
      for (uint32_t i = 0; i < 256; ++i) {
        uint32_t v = 0;
        for (int b = 0; b < 8; ++b)
          if (i & (1u << b)) v ^= basis[8 * k + b];
        z.t[k][i] = v;
      }
  }
};

const Tables& tables() {
  static const Tables tbl;
  return tbl;
}

uint32_t crc_sw(uint32_t crc, const unsigned char* p, size_t n) noexcept {
  const Tables& T = tables();
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= crc;
    crc = T.t[7][v & 0xff] ^ T.t[6][(v >> 8) & 0xff] ^ T.t[5][(v >> 16) & 0xff] ^
          T.t[4][(v >> 24) & 0xff] ^ T.t[3][(v >> 32) & 0xff] ^
          T.t[2][(v >> 40) & 0xff] ^ T.t[1][(v >> 48) & 0xff] ^ T.t[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ T.t[0][(crc ^ *p++) & 0xff];
  return crc;
}

#if defined(__x86_64__)
inline uint64_t load64(const unsigned char* p) noexcept {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// The instruction loops below, in two forms: kCopy = false checksums [p, p+n);
// kCopy = true also stores every word it reads to `d` (crc32c_copy: the copy and
// its checksum read the source once; copy then checksum read each byte twice).
template <bool kCopy>
inline uint64_t take64(unsigned char* d, const unsigned char* p) noexcept {
  uint64_t v = load64(p);
  if constexpr (kCopy) std::memcpy(d, &v, 8);
  return v;
}

template <bool kCopy>
inline unsigned char take8(unsigned char* d, const unsigned char* p) noexcept {
  if constexpr (kCopy) *d = *p;
  return *p;
}

template <bool kCopy>
__attribute__((target("sse4.2"))) uint32_t hw_1way(uint32_t crc, unsigned char* d,
                                                    const unsigned char* p, size_t n) noexcept {
  uint64_t c = crc;
  for (; n >= 8; p += 8, d += kCopy ? 8 : 0, n -= 8) c = _mm_crc32_u64(c, take64<kCopy>(d, p));
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; ++p, d += kCopy ? 1 : 0, --n) c32 = _mm_crc32_u8(c32, take8<kCopy>(d, p));
  return c32;
}

// Three chains over [p, p+len), [p+len, p+2len), [p+2len, p+3len) (len a
// multiple of 8), joined with the zeros_len table.
template <bool kCopy>
__attribute__((target("sse4.2"))) inline uint32_t hw_block3(uint32_t crc, unsigned char* d,
                                                            const unsigned char* p, size_t len,
                                                            const ZeroTable& z) noexcept {
  uint64_t c0 = crc, c1 = 0, c2 = 0;
  const unsigned char* end = p + len;
  do {
    c0 = _mm_crc32_u64(c0, take64<kCopy>(d, p));
    c1 = _mm_crc32_u64(c1, take64<kCopy>(kCopy ? d + len : d, p + len));  // d: null unless kCopy
    c2 = _mm_crc32_u64(c2, take64<kCopy>(kCopy ? d + 2 * len : d, p + 2 * len));
    p += 8;
    if constexpr (kCopy) d += 8;
  } while (p < end);
  uint32_t c = z.apply(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
  return z.apply(c) ^ static_cast<uint32_t>(c2);
}

template <bool kCopy>
__attribute__((target("sse4.2"))) uint32_t hw_3way(uint32_t crc, unsigned char* d,
                                                    const unsigned char* p, size_t n) noexcept {
  const Tables& T = tables();
  // Align to 8 bytes first so the three chains' loads stay aligned.
  for (; n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0; ++p, d += kCopy ? 1 : 0, --n)
    crc = _mm_crc32_u8(crc, take8<kCopy>(d, p));
  const struct { size_t len; const ZeroTable& z; } blocks[] = {{kLong, T.zlong}, {kShort, T.zshort}};
  for (const auto& b : blocks) {
    while (n >= 3 * b.len) {
      crc = hw_block3<kCopy>(crc, d, p, b.len, b.z);
      p += 3 * b.len;
      if constexpr (kCopy) d += 3 * b.len;
      n -= 3 * b.len;
    }
  }
  return hw_1way<kCopy>(crc, d, p, n);
}

uint32_t crc_hw_1way(uint32_t crc, const unsigned char* p, size_t n) noexcept {
  return hw_1way<false>(crc, nullptr, p, n);
}

uint32_t crc_hw_3way(uint32_t crc, const unsigned char* p, size_t n) noexcept {
  return hw_3way<false>(crc, nullptr, p, n);
}

bool detect_hw() noexcept { return __builtin_cpu_supports("sse4.2"); }
#else
bool detect_hw() noexcept { return false; }
#endif

const bool kHw = detect_hw();

}  // namespace

bool crc32c_hardware() noexcept { return kHw; }

uint32_t crc32c(uint32_t crc, const void* data, size_t len) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  if (kHw) return ~crc_hw_3way(crc, p, len);
#endif
  return ~crc_sw(crc, p, len);
}

uint32_t crc32c_copy(uint32_t crc, void* dst, const void* src, size_t len) noexcept {
#if defined(__x86_64__)
  if (kHw)
    return ~hw_3way<true>(~crc, static_cast<unsigned char*>(dst),
                            static_cast<const unsigned char*>(src), len);
#endif
  std::memcpy(dst, src, len);
  return crc32c(crc, dst, len);
}

bool crc32c_impl(const char* impl, uint32_t crc, const void* data, size_t len,
                 uint32_t* out) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  if (std::strcmp(impl, "portable") == 0) {
    *out = ~crc_sw(~crc, p, len);
    return true;
  }
#if defined(__x86_64__)
  if (kHw && std::strcmp(impl, "sse42_1way") == 0) {
    *out = ~crc_hw_1way(~crc, p, len);
    return true;
  }
  if (kHw && std::strcmp(impl, "sse42_3way") == 0) {
    *out = ~crc_hw_3way(~crc, p, len);
    return true;
  }
#endif
  return false;
}

}  // namespace cudasnap
