// Staging arena, the slot side: slot state machine (begin_write / commit /
// invalidate), validation of COMPLETE slots, manifests (meta prefix + suffix),
// CRC tables and leases (in-process counts + cross-process OFD locks). The
// arena file, its mapping and set-up are in staging_file.cpp.
#include "staging.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "crc32c.h"
#include "error.h"
#include "staging_layout.h"
#include "test_hooks.h"

namespace cudasnap {

using staging_detail::header_crc;
using staging_detail::round_up;
using staging_detail::table_bytes;

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
