#include "staging.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <ctime>

#include "crc32c.h"
#include "error.h"
#include "test_hooks.h"

namespace cudasnap {
namespace {

uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

uint64_t table_bytes(uint64_t max_chunks) { return round_up(max_chunks * 4, kPage); }

uint64_t stride_for(uint64_t data_capacity, uint64_t meta_capacity, uint64_t chunk_bytes) {
  uint64_t max_chunks = (data_capacity + chunk_bytes - 1) / chunk_bytes;
  return kPage + table_bytes(max_chunks) + round_up(meta_capacity, kPage) +
         round_up(data_capacity, kPage);
}

uint32_t header_crc(const SlotHeader& h) {
  SlotHeader c = h;
  c.header_crc = 0;
  c.state = kComplete;
  return crc32c(0, &c, sizeof(c));
}

uint32_t arena_crc(const ArenaHeader& h) {
  ArenaHeader c = h;
  c.header_crc = 0;
  return crc32c(0, &c, sizeof(c));
}

std::string human(uint64_t b) {
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

}  // namespace

uint64_t monotonic_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

uint64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

uint64_t Arena::required_bytes(int num_slots, uint64_t data_capacity, uint64_t meta_capacity,
                               uint64_t chunk_bytes) {
  return kPage + uint64_t(num_slots) * stride_for(data_capacity, meta_capacity, chunk_bytes);
}

std::shared_ptr<Arena> Arena::create(const std::string& path, int num_slots,
                                     uint64_t data_capacity, uint64_t meta_capacity,
                                     uint64_t chunk_bytes, const std::string& job,
                                     bool prefault, const CancelFlag* cancel) {
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, num_slots >= 2 && num_slots <= kMaxSlots,
                      "arena needs 2.." << kMaxSlots << " slots, got " << num_slots);
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, chunk_bytes >= kPage && chunk_bytes % kPage == 0,
                      "chunk_bytes must be a positive multiple of 4096, got " << chunk_bytes);
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, data_capacity > 0, "arena data capacity is 0");
  uint64_t total = required_bytes(num_slots, data_capacity, meta_capacity, chunk_bytes);

  // Free-space check up front: a tmpfs that fills later would SIGBUS us.
  std::string dir = path.substr(0, path.find_last_of('/'));
  if (dir.empty()) dir = "/";
  struct statvfs vfs {};
  CUDASNAP_SYSCHECK(statvfs(dir.c_str(), &vfs), ErrorKind::Staging,
                    "cannot stat the staging directory " << dir);
  uint64_t avail = uint64_t(vfs.f_bavail) * vfs.f_frsize;
  uint64_t fs_size = uint64_t(vfs.f_blocks) * vfs.f_frsize;
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, total <= avail,
                      "staging arena " << path << " needs " << human(total) << " ("
                                       << num_slots << " slots of " << human(data_capacity)
                                       << ") but " << dir << " has only " << human(avail)
                                       << " free of " << human(fs_size)
                                       << "; free space there or lower num_slots");

  auto a = std::shared_ptr<Arena>(new Arena());
  a->path_ = path;
  a->writable_ = true;
  CUDASNAP_SYSCHECK(a->fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600),
                    ErrorKind::Staging, "cannot create staging arena " << path);
  try {
    CUDASNAP_SYSCHECK(fchmod(a->fd_, 0600), ErrorKind::Staging, "chmod 0600 " << path);
    // The full size first: with shmem_enabled=within_size tmpfs then backs the
    // reserved range with huge pages.
    CUDASNAP_SYSCHECK(ftruncate(a->fd_, static_cast<off_t>(total)), ErrorKind::Staging,
                      "cannot size staging arena " << path << " to " << human(total));
    auto reserve = [&](uint64_t off, uint64_t n) {
      int rc = posix_fallocate(a->fd_, static_cast<off_t>(off), static_cast<off_t>(n));
      CUDASNAP_CHECK_KIND(ErrorKind::Staging, rc == 0,
                          "cannot reserve " << human(total) << " for staging arena " << path
                                            << ": posix_fallocate failed: " << std::strerror(rc)
                                            << " (errno " << rc << ")");
    };
    // Header pages first, then the headers: a crash (or a reader) during the
    // long reservation below sees a valid arena with empty slots, never a
    // zero-filled file. prefault() of an adopted arena reserves whatever a
    // crashed set-up left unreserved.
    const uint64_t stride = stride_for(data_capacity, meta_capacity, chunk_bytes);
    reserve(0, kPage);
    for (int i = 0; i < num_slots; ++i) reserve(kPage + uint64_t(i) * stride, kPage);
    void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd_, 0);
    CUDASNAP_CHECK_KIND(ErrorKind::Staging, p != MAP_FAILED,
                        "mmap of " << human(total) << " staging arena " << path
                                   << " failed: " << std::strerror(errno));
    a->base_ = static_cast<uint8_t*>(p);
    a->size_ = total;
    a->advise_huge_pages();
    a->init_layout(num_slots, data_capacity, meta_capacity, chunk_bytes, job);
    for (uint64_t off = 0; off < total; off += kSetupPiece) {
      CUDASNAP_CHECK_KIND(ErrorKind::Staging, !(cancel && cancel->set.load()),
                          "set-up of staging arena " << path << " cancelled");
      reserve(off, std::min(kSetupPiece, total - off));
    }
    if (prefault) a->populate(cancel);
  } catch (...) {
    a->unlink_file();
    throw;
  }
  return a;
}

void Arena::init_layout(int num_slots, uint64_t data_capacity, uint64_t meta_capacity,
                        uint64_t chunk_bytes, const std::string& job) {
  ArenaHeader* h = hdr();
  std::memset(h, 0, sizeof(ArenaHeader));
  h->magic = kArenaMagic;
  h->version = kArenaVersion;
  h->num_slots = static_cast<uint32_t>(num_slots);
  h->slot_stride = stride_for(data_capacity, meta_capacity, chunk_bytes);
  h->data_capacity = data_capacity;
  h->meta_capacity = meta_capacity;
  h->chunk_bytes = chunk_bytes;
  h->max_chunks = (data_capacity + chunk_bytes - 1) / chunk_bytes;
  h->total_bytes = size_;
  h->owner_pid = getpid();
  h->created_ns = wall_ns();
  std::strncpy(h->job, job.c_str(), sizeof(h->job) - 1);
  for (int i = 0; i < num_slots; ++i) {
    SlotHeader* s = slot_hdr(i);
    std::memset(s, 0, sizeof(SlotHeader));
    s->magic = kSlotMagic;
    s->version = kArenaVersion;
    s->step = -1;
  }
  h->header_crc = arena_crc(*h);
}

std::shared_ptr<Arena> Arena::create_private(int num_slots, uint64_t data_capacity,
                                             uint64_t meta_capacity, uint64_t chunk_bytes,
                                             const std::string& job, AllocFn alloc,
                                             FreeFn free_fn) {
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, num_slots >= 2 && num_slots <= kMaxSlots,
                      "arena needs 2.." << kMaxSlots << " slots, got " << num_slots);
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, chunk_bytes >= kPage && chunk_bytes % kPage == 0,
                      "chunk_bytes must be a positive multiple of 4096, got " << chunk_bytes);
  CUDASNAP_CHECK(alloc && free_fn, "create_private needs alloc and free functions");
  uint64_t total = required_bytes(num_slots, data_capacity, meta_capacity, chunk_bytes);
  auto a = std::shared_ptr<Arena>(new Arena());
  a->path_ = "(process-private)";
  a->writable_ = true;
  a->base_ = static_cast<uint8_t*>(alloc(total));
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, a->base_ != nullptr,
                      "allocation of a " << human(total) << " private staging arena failed");
  a->free_fn_ = free_fn;
  a->size_ = total;
  a->init_layout(num_slots, data_capacity, meta_capacity, chunk_bytes, job);
  return a;
}

std::shared_ptr<Arena> Arena::open(const std::string& path, bool writable, bool prefault) {
  auto a = std::shared_ptr<Arena>(new Arena());
  a->path_ = path;
  a->writable_ = writable;
  // O_NOFOLLOW + the checks below: /dev/shm is shared by every user of the host,
  // and an arena planted there (or a symlink to one) must never be used. A
  // writable open (adopt, restore, flush) also refuses another user's arena and
  // one writable by group/others; read-only opens (inspection: `cudasnap
  // status`/`gc` read the owner pid) accept any owner.
  const int flags = (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK;
  CUDASNAP_SYSCHECK(a->fd_ = ::open(path.c_str(), flags), ErrorKind::Staging,
                    "cannot open staging arena " << path);
  struct stat st {};
  CUDASNAP_SYSCHECK(fstat(a->fd_, &st), ErrorKind::Staging, "cannot stat " << path);
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, S_ISREG(st.st_mode),
                      "staging arena " << path << " is not a regular file");
  if (writable) {
    CUDASNAP_CHECK_KIND(ErrorKind::Staging, st.st_uid == geteuid(),
                        "staging arena " << path << " is owned by uid " << st.st_uid
                                         << ", not by this process (uid " << geteuid()
                                         << "); refusing to use it");
    CUDASNAP_CHECK_KIND(ErrorKind::Staging, (st.st_mode & 022) == 0,
                        "staging arena " << path << " has mode " << std::oct
                                         << (st.st_mode & 0777) << std::dec
                                         << " (writable by group/others); refusing to use it");
  }
  uint64_t size = static_cast<uint64_t>(st.st_size);
  CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, size >= kPage,
                      "staging arena " << path << " is truncated (" << size << " bytes)");
  int prot = PROT_READ | (writable ? PROT_WRITE : 0);
  void* p = mmap(nullptr, size, prot, MAP_SHARED, a->fd_, 0);
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, p != MAP_FAILED,
                      "mmap of staging arena " << path << " failed: " << std::strerror(errno));
  a->base_ = static_cast<uint8_t*>(p);
  a->size_ = size;
  const ArenaHeader* h = a->hdr();
  CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, h->magic == kArenaMagic,
                      path << " is not a cudasnap staging arena (bad magic)");
  CUDASNAP_CHECK_KIND(ErrorKind::Incompatible, h->version == kArenaVersion,
                      "staging arena " << path << " has format version " << h->version
                                       << ", this build reads " << kArenaVersion);
  CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, h->header_crc == arena_crc(*h),
                      "staging arena " << path << " header checksum mismatch");
  CUDASNAP_CHECK_KIND(ErrorKind::Corrupt,
                      h->num_slots >= 2 && h->num_slots <= kMaxSlots && h->chunk_bytes >= kPage &&
                          h->chunk_bytes % kPage == 0 &&
                          // data()/table()/meta offsets use max_chunks: it must agree too
                          h->max_chunks == (h->data_capacity + h->chunk_bytes - 1) / h->chunk_bytes &&
                          h->slot_stride == stride_for(h->data_capacity, h->meta_capacity,
                                                       h->chunk_bytes) &&
                          h->total_bytes == required_bytes(int(h->num_slots), h->data_capacity,
                                                           h->meta_capacity, h->chunk_bytes) &&
                          h->total_bytes <= size,
                      "staging arena " << path << " has an inconsistent geometry (file "
                                       << size << " bytes, header says " << h->total_bytes
                                       << ")");
  // A trainer adopting its predecessor's arena: map every page now (or later,
  // off the training thread), not one minor fault per 4 KiB during its first
  // snapshot copies.
  if (writable) a->advise_huge_pages();
  if (writable && prefault) a->prefault();
  return a;
}

Arena::~Arena() {
  if (base_ && free_fn_) {
    free_fn_(base_);
  } else if (base_) {
    munmap(base_, size_);
  }
  if (fd_ >= 0) ::close(fd_);
}

void Arena::prefault(const CancelFlag* cancel) {
  if (!base_ || size_ == 0) return;
  if (fd_ >= 0 && writable_) {
    // Reserve what is not yet (a set-up that crashed half-way): no SIGBUS later.
    for (uint64_t off = 0; off < size_; off += kSetupPiece) {
      CUDASNAP_CHECK_KIND(ErrorKind::Staging, !(cancel && cancel->set.load()),
                          "pre-faulting staging arena " << path_ << " cancelled");
      uint64_t n = std::min(kSetupPiece, size_ - off);
      int rc = posix_fallocate(fd_, static_cast<off_t>(off), static_cast<off_t>(n));
      CUDASNAP_CHECK_KIND(ErrorKind::Staging, rc == 0,
                          "cannot reserve the " << human(size_) << " of staging arena " << path_
                                                << ": posix_fallocate failed: "
                                                << std::strerror(rc));
    }
  }
  populate(cancel);
}

void Arena::populate(const CancelFlag* cancel) {
  // Small pieces: MADV_POPULATE_WRITE holds the process's mmap lock (read) while it
  // runs, and an mmap/munmap of the training thread (a large tensor allocation)
  // waits for the piece in progress: 4 MiB keep that wait to about a millisecond.
  constexpr uint64_t kPiece = 4ull << 20;
  bool populate = true;
  for (uint64_t off = 0; off < size_; off += kPiece) {
    CUDASNAP_CHECK_KIND(ErrorKind::Staging, !(cancel && cancel->set.load()),
                        "pre-faulting staging arena " << path_ << " cancelled");
    uint64_t n = std::min(kPiece, size_ - off);
#ifdef MADV_POPULATE_WRITE
    // Simulated write faults: pages mapped writable, contents untouched.
    if (populate && writable_ && madvise(base_ + off, n, MADV_POPULATE_WRITE) == 0) continue;
#endif
    populate = false;
    // Fallback: a read of each page (tmpfs pages exist after fallocate, and a
    // shared mapping maps them writable). Never a write: the slots may be in use.
    volatile const uint8_t* p = base_ + off;
    uint8_t sink = 0;
    for (uint64_t i = 0; i < n; i += kPage) sink ^= p[i];
    (void)sink;
  }
}

void Arena::advise_huge_pages() {
#ifdef MADV_HUGEPAGE
  if (madvise(base_, size_, MADV_HUGEPAGE) == 0) {
    huge_pages_ = "advised";
  } else {
    huge_pages_ = std::string("MADV_HUGEPAGE refused: ") + std::strerror(errno);
  }
#else
  huge_pages_ = "MADV_HUGEPAGE not available on this system";
#endif
}

void Arena::unlink_file() {
  if (fd_ >= 0 && !path_.empty()) ::unlink(path_.c_str());
}

namespace {
// Live-owner field: 8 bytes in the arena header page, past the CRC'd ArenaHeader.
constexpr uint64_t kLiveOwnerOffset = 2048;
static_assert(sizeof(ArenaHeader) <= kLiveOwnerOffset, "arena header grew into the owner field");
}  // namespace

int64_t Arena::owner_pid() const {
  int64_t live = __atomic_load_n(reinterpret_cast<int64_t*>(base_ + kLiveOwnerOffset),
                                 __ATOMIC_ACQUIRE);
  return live > 0 ? live : hdr()->owner_pid;
}

void Arena::claim_owner() {
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, writable_, "arena " << path_ << " is read-only");
  __atomic_store_n(reinterpret_cast<int64_t*>(base_ + kLiveOwnerOffset),
                   static_cast<int64_t>(getpid()), __ATOMIC_RELEASE);
}

std::string Arena::job() const {
  return std::string(hdr()->job, strnlen(hdr()->job, sizeof(hdr()->job)));
}

uint64_t Arena::slot_offset(int slot) const {
  return kPage + uint64_t(slot) * hdr()->slot_stride;
}

void Arena::check_slot(int slot) const {
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, slot >= 0 && slot < num_slots(),
                      "slot " << slot << " out of range (arena has " << num_slots() << ")");
}

SlotHeader* Arena::slot_hdr(int slot) const {
  return reinterpret_cast<SlotHeader*>(base_ + slot_offset(slot));
}

uint32_t* Arena::table(int slot) const {
  check_slot(slot);
  return reinterpret_cast<uint32_t*>(base_ + slot_offset(slot) + kPage);
}

uint8_t* Arena::data_span(int slot, uint64_t n) const {
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, n <= data_capacity(),
                      "view of " << n << " bytes exceeds slot capacity " << data_capacity());
  return data(slot);
}

const char* slot_state_name(uint32_t state) noexcept {
  static const char* names[] = {"EMPTY", "WRITING", "COMPLETE"};
  return state <= 2 ? names[state] : "UNKNOWN";
}

uint8_t* Arena::data(int slot) const {
  check_slot(slot);
  return base_ + slot_offset(slot) + kPage + table_bytes(max_chunks()) +
         round_up(meta_capacity(), kPage);
}

static uint8_t* meta_ptr(uint8_t* base, uint64_t off, uint64_t max_chunks) {
  return base + off + kPage + table_bytes(max_chunks);
}

SlotInfo Arena::slot_info(int slot) const {
  check_slot(slot);
  std::lock_guard<std::mutex> g(mu_);
  const SlotHeader* sp = slot_hdr(slot);
  SlotInfo info;
  info.index = slot;
  info.state = __atomic_load_n(&sp->state, __ATOMIC_ACQUIRE);
  SlotHeader s = *sp;
  info.seq = s.seq;
  info.step = s.step;
  info.data_bytes = s.data_bytes;
  info.meta_bytes = s.meta_bytes;
  info.num_chunks = s.num_chunks;
  info.complete_ns = s.complete_ns;
  info.writer_pid = s.writer_pid;
  if (info.state != kComplete) return info;
  if (s.magic != kSlotMagic) {
    info.problem = "bad slot magic";
  } else if (s.version != kArenaVersion) {
    info.problem = "slot format version " + std::to_string(s.version);
  } else if (s.header_crc != header_crc(s)) {
    info.problem = "slot header checksum mismatch";
  } else if (s.data_bytes > data_capacity() || s.meta_bytes > meta_capacity()) {
    info.problem = "slot sizes exceed the arena capacity";
  } else if (s.num_chunks != (s.data_bytes + chunk_bytes() - 1) / chunk_bytes()) {
    info.problem = "slot chunk count does not match its byte count";
  } else if (verified_seq_[slot] == s.seq + 1) {
    info.valid = true;  // table and meta already verified for this header
  } else if (crc32c(0, table(slot), s.num_chunks * 4) != s.table_crc) {
    info.problem = "slot chunk-checksum table mismatch";
  } else if (crc32c(0, meta_ptr(base_, slot_offset(slot), max_chunks()), s.meta_bytes) !=
             s.meta_crc) {
    info.problem = "slot manifest checksum mismatch";
  } else {
    info.valid = true;
    verified_seq_[slot] = s.seq + 1;
  }
  return info;
}

int Arena::newest_complete() const {
  int best = -1;
  SlotInfo best_info;
  for (int i = 0; i < num_slots(); ++i) {
    SlotInfo s = slot_info(i);
    if (!s.valid) continue;
    if (best < 0 || s.seq > best_info.seq) {
      best = i;
      best_info = s;
    }
  }
  return best;
}

int Arena::pick_write_slot() const {
  int newest = newest_complete();
  int pick = -1;
  uint64_t pick_seq = 0;
  bool pick_invalid = false;
  for (int i = 0; i < num_slots(); ++i) {
    if (i == newest || leases_[i].load() > 0 || leased_elsewhere(i)) continue;
    SlotInfo s = slot_info(i);
    bool invalid = !s.valid;  // EMPTY, WRITING (torn) or bad: reuse first
    if (pick < 0 || (invalid && !pick_invalid) ||
        (invalid == pick_invalid && s.seq < pick_seq)) {
      pick = i;
      pick_seq = s.seq;
      pick_invalid = invalid;
    }
  }
  return pick;
}

MetaPrefix::MetaPrefix(std::string b) : bytes(std::move(b)) {
  static std::atomic<uint64_t> next_id{1};
  id = next_id.fetch_add(1);
  crc = crc32c(0, bytes.data(), bytes.size());
}

void Arena::begin_write(int slot, int64_t step, const std::string& meta) {
  begin_write(slot, step, SlotMeta{nullptr, meta});
}

uint64_t Arena::meta_prefix_id(int slot) const {
  check_slot(slot);
  std::lock_guard<std::mutex> g(mu_);
  return prefix_id_[slot];
}

void Arena::begin_write(int slot, int64_t step, const SlotMeta& meta) {
  check_slot(slot);
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, writable_, "arena " << path_ << " is read-only");
  const uint64_t size = meta.size();
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, size <= meta_capacity(),
                      "snapshot manifest is " << size << " bytes, the arena's meta area "
                                              << meta_capacity() << "; rebuild the arena");
  std::lock_guard<std::mutex> g(mu_);
  // Checked under the lock that lease() takes: a reader that leased first wins.
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, leases_[slot].load() == 0,
                      "slot " << slot << " is being read (leased); cannot overwrite it");
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, !leased_elsewhere(slot),
                      "slot " << slot << " is being read (leased) by another process (a flush of "
                                 "the supervisor?); cannot overwrite it");
  SlotHeader* s = slot_hdr(slot);
  __atomic_store_n(&s->state, uint32_t(kWriting), __ATOMIC_SEQ_CST);
  verified_seq_[slot] = 0;
  uint64_t max_seq = 0;
  for (int i = 0; i < num_slots(); ++i) max_seq = std::max(max_seq, slot_hdr(i)->seq);
  next_seq_ = std::max(next_seq_, max_seq + 1);
  s->seq = next_seq_++;
  s->step = step;
  s->writer_pid = getpid();
  s->meta_bytes = size;
  uint8_t* m = meta_ptr(base_, slot_offset(slot), max_chunks());
  const MetaPrefix* p = meta.prefix.get();
  if (p == nullptr || prefix_id_[slot] != p->id) {
    prefix_id_[slot] = 0;  // until the new prefix is whole
    if (p != nullptr) std::memcpy(m, p->bytes.data(), p->bytes.size());
    prefix_id_[slot] = p ? p->id : 0;
    prefix_len_[slot] = p ? p->bytes.size() : 0;
    prefix_crc_[slot] = p ? p->crc : 0;
  }
  std::memcpy(m + prefix_len_[slot], meta.suffix.data(), meta.suffix.size());
}

void Arena::commit(int slot, int64_t step, uint64_t data_bytes) {
  check_slot(slot);
  CUDASNAP_CHECK_KIND(ErrorKind::Staging, data_bytes <= data_capacity(),
                      "snapshot of " << data_bytes << " bytes exceeds slot capacity "
                                     << data_capacity());
  std::lock_guard<std::mutex> g(mu_);
  SlotHeader* s = slot_hdr(slot);
  CUDASNAP_CHECK_KIND(ErrorKind::Staging,
                      __atomic_load_n(&s->state, __ATOMIC_ACQUIRE) == kWriting && s->step == step,
                      "commit of slot " << slot << " step " << step
                                        << " without a matching begin_write");
  test_hooks::kill_point("copy");
  s->magic = kSlotMagic;
  s->version = kArenaVersion;
  s->data_bytes = data_bytes;
  s->num_chunks = (data_bytes + chunk_bytes() - 1) / chunk_bytes();
  s->table_crc = crc32c(0, table(slot), s->num_chunks * 4);
  test_hooks::kill_point("header");
  // The prefix CRC is continued over the suffix: O(suffix), same value as a CRC of it all.
  const uint64_t plen = prefix_id_[slot] ? prefix_len_[slot] : 0;
  s->meta_crc = crc32c(plen ? prefix_crc_[slot] : 0,
                       meta_ptr(base_, slot_offset(slot), max_chunks()) + plen,
                       s->meta_bytes - plen);
  s->complete_ns = wall_ns();
  s->header_crc = header_crc(*s);
  __atomic_store_n(&s->state, uint32_t(kComplete), __ATOMIC_SEQ_CST);
  // This process just computed both CRCs from the bytes it wrote: the next
  // slot_info() (every boundary's pick_write_slot) need not re-read the meta.
  // read_meta()/read_table() (flush, restore) still verify the bytes they return.
  verified_seq_[slot] = s->seq + 1;
}

void Arena::invalidate(int slot) {
  check_slot(slot);
  std::lock_guard<std::mutex> g(mu_);
  verified_seq_[slot] = 0;
  __atomic_store_n(&slot_hdr(slot)->state, uint32_t(kEmpty), __ATOMIC_SEQ_CST);
}

std::string Arena::read_meta(int slot) const {
  SlotInfo s = slot_info(slot);
  CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, s.valid,
                      "slot " << slot << " of " << path_ << " is not a complete snapshot"
                              << (s.problem.empty() ? "" : ": " + s.problem));
  const uint8_t* m = meta_ptr(base_, slot_offset(slot), max_chunks());
  std::string out(reinterpret_cast<const char*>(m), s.meta_bytes);
  uint32_t want = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    want = slot_hdr(slot)->meta_crc;
  }
  CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, crc32c(0, out.data(), out.size()) == want,
                      "slot " << slot << " of " << path_ << ": slot manifest checksum mismatch");
  return out;
}

std::vector<uint32_t> Arena::read_table(int slot) const {
  SlotInfo s = slot_info(slot);
  // num_chunks of a slot that is not valid is unchecked: it could point past the table.
  CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, s.valid,
                      "slot " << slot << " of " << path_ << " is not a complete snapshot"
                              << (s.problem.empty() ? "" : ": " + s.problem));
  const uint32_t* t = table(slot);
  std::vector<uint32_t> out(t, t + s.num_chunks);
  uint32_t want = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    want = slot_hdr(slot)->table_crc;
  }
  CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, crc32c(0, out.data(), out.size() * 4) == want,
                      "slot " << slot << " of " << path_ << ": slot chunk-checksum table mismatch");
  return out;
}

// Cross-process leases. Besides the in-process count, the first lease of a slot
// takes an open-file-description read lock on byte `slot` of the arena file
// (advisory: it does not affect the mapping). A writer in another process sees
// it with F_OFD_GETLK and leaves the slot alone; the lock dies with the process
// (or open file) holding it, so a killed flusher never pins a slot. Where the
// kernel has no OFD locks (EINVAL) leases stay per process, as before.
namespace {
bool ofd_lock(int fd, int slot, short type) {
  struct flock fl;
  std::memset(&fl, 0, sizeof(fl));
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = slot;
  fl.l_len = 1;
  return ::fcntl(fd, F_OFD_SETLK, &fl) == 0;
}
}  // namespace

bool Arena::leased_elsewhere(int slot) const {
  if (fd_ < 0) return false;  // a process-private arena: nobody else can read it
  struct flock fl;
  std::memset(&fl, 0, sizeof(fl));
  fl.l_type = F_WRLCK;  // would a write lock conflict? Only with another file's read lock.
  fl.l_whence = SEEK_SET;
  fl.l_start = slot;
  fl.l_len = 1;
  if (::fcntl(fd_, F_OFD_GETLK, &fl) != 0) return false;  // no OFD locks: per-process leases
  return fl.l_type != F_UNLCK;
}

void Arena::lease(int slot) {
  check_slot(slot);
  std::lock_guard<std::mutex> g(mu_);
  if (leases_[slot].fetch_add(1) == 0 && fd_ >= 0) {
    // A read lock conflicts only with write locks, which nobody takes: failure
    // means no OFD support (EINVAL) or a kernel lock-table limit (ENOLCK).
    (void)ofd_lock(fd_, slot, F_RDLCK);
  }
}

void Arena::release(int slot) {
  check_slot(slot);
  std::lock_guard<std::mutex> g(mu_);
  int prev = leases_[slot].fetch_sub(1);
  if (prev <= 0) {
    leases_[slot].fetch_add(1);
    CUDASNAP_CHECK_KIND(ErrorKind::Staging, false, "release of slot " << slot << " not leased");
  }
  if (prev == 1 && fd_ >= 0) (void)ofd_lock(fd_, slot, F_UNLCK);
}

int Arena::leases(int slot) const {
  check_slot(slot);
  return leases_[slot].load();
}

}  // namespace cudasnap
