// Internal to the staging arena's sources (staging_file.cpp: the arena file,
// mapping and set-up; staging.cpp: the slot state machine, manifests and
// leases): the slot geometry and header checksums both sides compute.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include "crc32c.h"
#include "staging.h"

namespace cudasnap::staging_detail {

inline uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

inline uint64_t table_bytes(uint64_t max_chunks) { return round_up(max_chunks * 4, kPage); }

inline uint64_t stride_for(uint64_t data_capacity, uint64_t meta_capacity, uint64_t chunk_bytes) {
  uint64_t max_chunks = (data_capacity + chunk_bytes - 1) / chunk_bytes;
  return kPage + table_bytes(max_chunks) + round_up(meta_capacity, kPage) +
         round_up(data_capacity, kPage);
}

inline uint32_t header_crc(const SlotHeader& h) {
  SlotHeader c = h;
  c.header_crc = 0;
  c.state = kComplete;
  return crc32c(0, &c, sizeof(c));
}

inline uint32_t arena_crc(const ArenaHeader& h) {
  ArenaHeader c = h;
  c.header_crc = 0;
  return crc32c(0, &c, sizeof(c));
}

inline std::string human(uint64_t b) {
  // GiB with two decimals for big sizes (what operators size /dev/shm in);
  // smaller ones in MiB/KiB, always with the exact byte count: "0.00 GiB" says nothing.
  char buf[96];
  if (b >= (1ull << 30)) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", b / double(1ull << 30));
  } else if (b >= (1ull << 20)) {
    std::snprintf(buf, sizeof(buf), "%.2f MiB (%llu bytes)", b / double(1ull << 20),
                  static_cast<unsigned long long>(b));
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f KiB (%llu bytes)", b / 1024.0,
                  static_cast<unsigned long long>(b));
  }
  return buf;
}

}  // namespace cudasnap::staging_detail
