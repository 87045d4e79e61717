// CRC32C (Castagnoli), hardware accelerated with SSE4.2 where available.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cudasnap {

// Continue a CRC32C over `len` bytes; start with crc = 0.
uint32_t crc32c(uint32_t crc, const void* data, size_t len) noexcept;

// True when the SSE4.2 instruction path is in use.
bool crc32c_hardware() noexcept;

}  // namespace cudasnap
