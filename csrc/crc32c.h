// CRC32C (Castagnoli), hardware accelerated where the CPU allows.
//
// Dispatch (once, at load): with SSE4.2, long buffers run three independent
// crc32 instruction chains over the thirds of each block (the instruction has a
// latency of 3 cycles but a throughput of 1, so one chain leaves 2/3 of the unit
// idle) and join them with precomputed zero-extension tables; short tails use
// one chain. Without SSE4.2 a portable slice-by-8 table version runs.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cudasnap {

// Continue a CRC32C over `len` bytes; start with crc = 0.
uint32_t crc32c(uint32_t crc, const void* data, size_t len) noexcept;

// Copy `len` bytes from `src` to `dst` (not overlapping) and continue a CRC32C
// over them, reading the source once; same result as memcpy + crc32c(crc, dst, len).
uint32_t crc32c_copy(uint32_t crc, void* dst, const void* src, size_t len) noexcept;

// True when the SSE4.2 instruction path is in use.
bool crc32c_hardware() noexcept;

// Named implementations, for tests and bench/crc_bench.py (same contract as
// crc32c): "portable" (slice-by-8 tables), "sse42_1way" (the single-chain
// instruction loop, the pre-3-way code path), "sse42_3way" (what crc32c uses on
// SSE4.2 machines). Returns false when `impl` is unknown or the CPU lacks it.
bool crc32c_impl(const char* impl, uint32_t crc, const void* data, size_t len,
                 uint32_t* out) noexcept;

}  // namespace cudasnap
