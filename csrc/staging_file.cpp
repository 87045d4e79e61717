// Staging arena, the file side: creation (free-space check, reservation,
// pre-faulting), opening and validating an existing arena, the process-private
// variant, huge-page advice and the owner field. The slot state machine is in
// staging.cpp.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "error.h"
#include "staging.h"
#include "staging_layout.h"

namespace cudasnap {

using staging_detail::arena_crc;
using staging_detail::human;
using staging_detail::stride_for;

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

void wait_while_paused(const CancelFlag* cancel) {
  while (cancel != nullptr && cancel->paused.load() > 0 && !cancel->set.load())
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
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
      wait_while_paused(cancel);
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

uint64_t Arena::next_serial() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

Arena::~Arena() {
  // A registration outliving its mapping would pin pages nobody can reach
  // and refuse any later registration of a mapping at the same address.
  if (ReleaseFn fn = release_registration) {
    release_registration = nullptr;
    fn(*this);
  }
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
      wait_while_paused(cancel);
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
    wait_while_paused(cancel);
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

}  // namespace cudasnap
