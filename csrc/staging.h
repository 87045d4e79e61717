// Staging arena: host buffers for snapshots, one arena per rank.
//
// The arena is a file in /dev/shm (mode 0600), mmap'd MAP_SHARED and
// pre-faulted, so a COMPLETE snapshot outlives a crash of the training process
// and a supervisor can flush it. Layout (all offsets 4 KiB aligned):
//
//   [ArenaHeader 4 KiB]
//   slot i at kPage + i * slot_stride:
//     [SlotHeader 4 KiB][chunk CRC table][meta JSON area][data area]
//
// Slot protocol: begin_write() stores state=WRITING before any data is touched;
// commit() writes the CRC table checksum, the header fields and a header CRC,
// then stores state=COMPLETE last (release order). A reader trusts a slot only
// when the state is COMPLETE and the header CRC matches, so a snapshot is never
// half-visible, whatever moment the writer dies at.
//
// Sources: staging_file.cpp (the file: create/open/validate, mapping, reservation,
// pre-faulting, huge pages, owner), staging.cpp (the slots: state machine,
// manifests, CRC tables, leases), staging_layout.h (geometry + header CRCs).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace cudasnap {

constexpr uint64_t kPage = 4096;
constexpr uint64_t kArenaMagic = 0x314e524150534e43ull;  // "CNSPARN1"
constexpr uint64_t kSlotMagic = 0x31544f4c50534e43ull;   // "CNSPLOT1"
constexpr uint32_t kArenaVersion = 1;
constexpr int kMaxSlots = 8;

enum SlotState : uint32_t { kEmpty = 0, kWriting = 1, kComplete = 2 };

struct ArenaHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t num_slots;
  uint64_t slot_stride;
  uint64_t data_capacity;
  uint64_t meta_capacity;
  uint64_t chunk_bytes;
  uint64_t max_chunks;
  uint64_t total_bytes;
  int64_t owner_pid;
  uint64_t created_ns;
  char job[128];
  uint32_t header_crc;
  uint32_t reserved;
};

struct SlotHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t state;  // SlotState, accessed with atomic builtins
  uint64_t seq;
  int64_t step;
  uint64_t data_bytes;
  uint64_t meta_bytes;
  uint64_t num_chunks;
  uint64_t complete_ns;
  int64_t writer_pid;
  uint32_t meta_crc;
  uint32_t table_crc;
  uint32_t header_crc;  // CRC of this struct with header_crc = 0, state = COMPLETE
  uint32_t reserved;
};

// "EMPTY", "WRITING", "COMPLETE" (SlotInfo::state), or "UNKNOWN".
const char* slot_state_name(uint32_t state) noexcept;

struct SlotInfo {
  int index = -1;
  uint32_t state = kEmpty;
  bool valid = false;  // COMPLETE and every header check passed
  std::string problem;  // why a COMPLETE-looking slot is not valid
  uint64_t seq = 0;
  int64_t step = -1;
  uint64_t data_bytes = 0;
  uint64_t meta_bytes = 0;
  uint64_t num_chunks = 0;
  uint64_t complete_ns = 0;
  int64_t writer_pid = 0;
};

// Set from another thread to stop a long arena set-up (create / prefault) at
// its next piece (every kSetupPiece bytes); the set-up then throws StagingError.
// `paused` > 0 (a restore reading an arena slot: it wants the cores and the mmap
// lock) holds the set-up at its next piece until it drops to 0 again, or the
// flag is set; nested pauses count.
struct CancelFlag {
  std::atomic<bool> set{false};
  std::atomic<int> paused{0};
};
// Blocks (1 ms sleeps) while `cancel` is paused and not set; null: returns at once.
void wait_while_paused(const CancelFlag* cancel);
constexpr uint64_t kSetupPiece = 64ull << 20;
// The part of a slot manifest that stays the same from one boundary to the next
// (the tensor table: ~190 B per tensor). Built once per layout; a slot whose meta
// area already holds this prefix (same id, written by this process) gets only the
// suffix (host state + step) at the next boundary, and the meta CRC is continued
// from the prefix's CRC, so the per-boundary cost does not grow with the tensors.
struct MetaPrefix {
  explicit MetaPrefix(std::string b);
  std::string bytes;
  uint64_t id;   // unique in this process
  uint32_t crc;  // crc32c(0, bytes)
};

// What begin_write() puts into a slot's meta area: prefix (may be null) + suffix.
struct SlotMeta {
  std::shared_ptr<const MetaPrefix> prefix;
  std::string suffix;
  uint64_t size() const { return (prefix ? prefix->bytes.size() : 0) + suffix.size(); }
};

class Arena {
 public:
  // Create a new arena file (fails if it exists). Checks free space first.
  // Space is reserved (fallocate) and, with `prefault`, mapped in pieces of
  // kSetupPiece, checking `cancel` between pieces: a cancelled set-up removes
  // the file and throws StagingError. The mapping gets MADV_HUGEPAGE advice.
  static std::shared_ptr<Arena> create(const std::string& path, int num_slots,
                                       uint64_t data_capacity, uint64_t meta_capacity,
                                       uint64_t chunk_bytes, const std::string& job,
                                       bool prefault, const CancelFlag* cancel = nullptr);
  // An arena in process-private memory from `alloc` (e.g. cudaHostAlloc when
  // cudaHostRegister of the shared file fails). It does not outlive the process.
  using AllocFn = void* (*)(uint64_t bytes);
  using FreeFn = void (*)(void* ptr);
  static std::shared_ptr<Arena> create_private(int num_slots, uint64_t data_capacity,
                                               uint64_t meta_capacity, uint64_t chunk_bytes,
                                               const std::string& job, AllocFn alloc,
                                               FreeFn free_fn);
  // Open an existing arena file; validates the arena header. A writable open
  // pre-faults the mapping unless `prefault` is false (then call prefault()
  // later, e.g. on a background thread).
  static std::shared_ptr<Arena> open(const std::string& path, bool writable,
                                     bool prefault = true);
  // Bytes an arena of this geometry occupies.
  static uint64_t required_bytes(int num_slots, uint64_t data_capacity,
                                 uint64_t meta_capacity, uint64_t chunk_bytes);

  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  const std::string& path() const { return path_; }
  int num_slots() const { return static_cast<int>(hdr()->num_slots); }
  uint64_t data_capacity() const { return hdr()->data_capacity; }
  uint64_t meta_capacity() const { return hdr()->meta_capacity; }
  uint64_t chunk_bytes() const { return hdr()->chunk_bytes; }
  uint64_t max_chunks() const { return hdr()->max_chunks; }
  uint64_t total_bytes() const { return size_; }
  std::string job() const;
  // The process using the arena now: the last claim_owner() caller, else the creator.
  int64_t owner_pid() const;
  // Records the calling process as the arena's user (a restarted trainer that
  // adopted its predecessor's arena). The field lives outside the CRC'd
  // header, written with one atomic store, so no crash can tear the header.
  void claim_owner();
  uint8_t* base() const { return base_; }
  bool writable() const { return writable_; }
  bool shared() const { return fd_ >= 0; }

  SlotInfo slot_info(int slot) const;
  // Most recently committed valid COMPLETE slot (highest seq), or -1. Not the
  // highest step: a run that restarted from an older step (fresh start over an
  // arena a dead run left, restore that fell back to disk) must see its own
  // snapshots as the newest as soon as it commits one.
  int newest_complete() const;
  // A slot that may be overwritten now: not the newest COMPLETE one, not leased.
  int pick_write_slot() const;

  void begin_write(int slot, int64_t step, const std::string& meta);
  // Torn-state safe: the state goes to WRITING before the meta area is touched,
  // the prefix is rewritten unless this slot's meta area holds it already (a
  // per-process record, cleared before and set after each prefix write), and
  // commit() covers the whole meta with the header CRC.
  void begin_write(int slot, int64_t step, const SlotMeta& meta);
  // Id of the MetaPrefix this slot's meta area holds (0: none known).
  uint64_t meta_prefix_id(int slot) const;
  // Called once all chunk CRCs are in the table; publishes the slot.
  void commit(int slot, int64_t step, uint64_t data_bytes);
  // Marks a slot EMPTY (e.g. after a failed copy).
  void invalidate(int slot);

  uint8_t* data(int slot) const;
  // data(slot), after checking that `n` bytes fit in a slot (StagingError).
  uint8_t* data_span(int slot, uint64_t n) const;
  uint32_t* table(int slot) const;
  std::string read_meta(int slot) const;  // verifies the meta CRC
  std::vector<uint32_t> read_table(int slot) const;

  void lease(int slot);
  void release(int slot);
  int leases(int slot) const;
  // Leased by a reader in another process (an OFD lock on the arena file).
  bool leased_elsewhere(int slot) const;

  // Reserves (fallocate: a set-up that crashed half-way left holes) and maps
  // every page of the arena now (MADV_POPULATE_WRITE, else a read touch: never
  // a write, so it is safe beside readers and writers of the slots), in pieces,
  // checking `cancel` between them (throws StagingError when set).
  void prefault(const CancelFlag* cancel = nullptr);
  // MADV_HUGEPAGE on the mapping: "advised", or why not. tmpfs (/dev/shm) uses
  // huge pages only when /sys/kernel/mm/transparent_hugepage/shmem_enabled is
  // advise / within_size / always.
  const std::string& huge_pages() const { return huge_pages_; }
  void unlink_file();

  // cudaHostRegister bookkeeping (set by the CUDA backend).
  bool cuda_registered = false;
  int cuda_device = -1;  // the device it was page-locked or allocated for (-1: none)
  // Set by the CUDA backend when it registers the mapping (register_arena):
  // undoes the registration. ~Arena calls it before unmapping, so a range is
  // never left registered after its mapping is gone (a later mapping at the
  // same address could not be registered). Must not throw.
  using ReleaseFn = void (*)(Arena& arena) noexcept;
  ReleaseFn release_registration = nullptr;
  // Unique in this process, never reused (unlike base(): a new mapping may get
  // the address of an unmapped one).
  uint64_t serial() const { return serial_; }

 private:
  Arena() = default;
  ArenaHeader* hdr() const { return reinterpret_cast<ArenaHeader*>(base_); }
  SlotHeader* slot_hdr(int slot) const;
  void check_slot(int slot) const;
  void init_layout(int num_slots, uint64_t data_capacity, uint64_t meta_capacity,
                   uint64_t chunk_bytes, const std::string& job);
  FreeFn free_fn_ = nullptr;
  uint64_t slot_offset(int slot) const;
  void advise_huge_pages();
  void populate(const CancelFlag* cancel);
  std::string huge_pages_ = "not advised";

  uint64_t serial_ = next_serial();
  static uint64_t next_serial();
  std::string path_;
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  bool writable_ = false;
  mutable std::mutex mu_;
  std::array<std::atomic<int>, kMaxSlots> leases_{};
  uint64_t next_seq_ = 1;
  // seq (+1) of the last COMPLETE header whose table and meta CRCs were checked.
  mutable std::array<uint64_t, kMaxSlots> verified_seq_{};
  // Per slot: MetaPrefix id held in the meta area, its length and CRC (0: none).
  std::array<uint64_t, kMaxSlots> prefix_id_{};
  std::array<uint64_t, kMaxSlots> prefix_len_{};
  std::array<uint32_t, kMaxSlots> prefix_crc_{};
};

uint64_t monotonic_ns();
uint64_t wall_ns();

}  // namespace cudasnap
