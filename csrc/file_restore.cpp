#include "file_restore.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>

#include "crc32c.h"
#include "error.h"
#include "flusher.h"
#include "staging.h"  // monotonic_ns
#include "thread_pool.h"

namespace cudasnap {
namespace {

constexpr uint64_t kAlign = 4096;  // O_DIRECT: buffer, offset and length alignment

// Part of one span that lies in one chunk.
struct Piece {
  uint64_t dst;
  uint64_t off;  // in the chunk
  uint64_t n;
  bool device;   // dst is a device address (ScatterOptions::sink copies it)
};

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};

// Reads exactly [off, off + n) of fd into dst (an O_DIRECT read asks for `n` rounded up
// to the alignment: the file's tail is shorter, which is not an error).
void read_exact(int fd, uint8_t* dst, uint64_t n, uint64_t off, bool direct,
                const std::string& name) {
  uint64_t got = 0;
  while (got < n) {
    uint64_t want = n - got;
    if (direct) want = (want + kAlign - 1) / kAlign * kAlign;
    ssize_t r = ::pread(fd, dst + got, std::min<uint64_t>(want, 1ull << 30),
                        static_cast<off_t>(off + got));
    if (r < 0 && errno == EINTR) continue;
    CUDASNAP_SYSCHECK(r, ErrorKind::Io, "pread of " << name << " at offset " << off + got);
    CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, r > 0, name << " ended early at offset " << off + got);
    // An aligned O_DIRECT read returns whole blocks only: a short one mid-file ends
    // on a block boundary, so the next read stays aligned.
    got += std::min<uint64_t>(static_cast<uint64_t>(r), n - got);
    count_bytes_read(static_cast<uint64_t>(r));
  }
}

// The file as the manifest describes it (a chunk size up to 4 GiB, one checksum per
// chunk, a regular file of `nbytes`); *st is its fstat. Returns the number of chunks.
uint64_t check_file(int fd, const std::string& name, uint64_t nbytes, uint64_t chunk_bytes,
                    uint64_t ncrcs, struct stat* st) {
  CUDASNAP_CHECK(chunk_bytes > 0, "read_verify_scatter: chunk_bytes is 0");
  CUDASNAP_CHECK(chunk_bytes <= (1ull << 32), "read_verify_scatter: chunk_bytes " << chunk_bytes
                                                  << " is larger than 4 GiB");
  const uint64_t nchunks = nbytes / chunk_bytes + (nbytes % chunk_bytes != 0);
  CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, ncrcs == nchunks,
                      name << ": manifest lists " << ncrcs << " chunk checksums for "
                           << nchunks << " chunks");
  CUDASNAP_SYSCHECK(::fstat(fd, st), ErrorKind::Io, "fstat of " << name);
  CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, S_ISREG(st->st_mode), name << " is not a regular file");
  CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, static_cast<uint64_t>(st->st_size) == nbytes,
                      name << " is " << st->st_size << " bytes, the manifest says " << nbytes
                           << " (truncated or replaced)");
  return nchunks;
}

// The bytes of the file read already: [0, n) at `data`.
struct Head {
  const uint8_t* data = nullptr;
  uint64_t n = 0;
};

// The head read beside the caller's planning, if it is of this very file (`st`); its
// chunks are checked like the ones read.
Head take_head(FileReadAhead* ahead, const struct stat& st, uint64_t nbytes) {
  Head head;
  if (ahead != nullptr) {
    const uint64_t held = ahead->finish();
    if (ahead->dev() == static_cast<uint64_t>(st.st_dev) &&
        ahead->ino() == static_cast<uint64_t>(st.st_ino)) {
      head.data = ahead->data();
      head.n = std::min(held, nbytes);
    }
  }
  return head;
}

// A destination [lo, hi) of span `span`.
struct Range {
  uint64_t lo, hi, span;
};

// Every span checked before the first read (copy_spans' rules, the file as source); the
// destinations of the spans that copy bytes, sorted by address space (host first, then
// the `every[n_host..]` device ones), then address.
std::vector<Range> checked_destinations(const std::vector<HostSpan>& every, uint64_t n_host,
                                        uint64_t nbytes) {
  std::vector<Range> dsts;
  dsts.reserve(every.size());
  for (uint64_t i = 0; i < every.size(); ++i) {
    const HostSpan& s = every[i];
    if (s.nbytes == 0) continue;
    CUDASNAP_CHECK(s.src_offset <= nbytes && s.nbytes <= nbytes - s.src_offset,
                   "read_verify_scatter: span " << i << " reads bytes [" << s.src_offset << ", "
                                                << s.src_offset << " + " << s.nbytes
                                                << ") outside the file of " << nbytes << " bytes");
    CUDASNAP_CHECK(s.dst != 0, "read_verify_scatter: span " << i << " has a null destination");
    CUDASNAP_CHECK(s.nbytes <= std::numeric_limits<uint64_t>::max() - s.dst,
                   "read_verify_scatter: span " << i << " destination of " << s.nbytes
                                                << " bytes wraps around");
    dsts.push_back({s.dst, s.dst + s.nbytes, i});
  }
  // Overlaps only within one address space.
  std::sort(dsts.begin(), dsts.end(), [&](const Range& a, const Range& b) {
    return (a.span >= n_host) != (b.span >= n_host) ? a.span < n_host : a.lo < b.lo;
  });
  for (uint64_t k = 1; k < dsts.size(); ++k) {
    if ((dsts[k].span >= n_host) != (dsts[k - 1].span >= n_host)) continue;
    CUDASNAP_CHECK(dsts[k].lo >= dsts[k - 1].hi,
                   "read_verify_scatter: destinations of spans " << dsts[k - 1].span << " and "
                                                                  << dsts[k].span << " overlap");
  }
  return dsts;
}

// Each span cut at chunk boundaries; the pieces of chunk c are
// pieces[first[c] .. first[c + 1]), in file order within a chunk.
struct ChunkPieces {
  std::vector<uint64_t> first;
  std::vector<Piece> pieces;
};

ChunkPieces cut_at_chunks(const std::vector<HostSpan>& every, const std::vector<Range>& dsts,
                          uint64_t n_host, uint64_t nchunks, uint64_t chunk_bytes) {
  std::vector<uint64_t> count(nchunks + 1, 0);
  for (const Range& r : dsts) {
    const HostSpan& s = every[r.span];
    for (uint64_t c = s.src_offset / chunk_bytes; c * chunk_bytes < s.src_offset + s.nbytes; ++c)
      ++count[c];
  }
  ChunkPieces cut;
  std::vector<uint64_t>& first = cut.first;
  first.assign(nchunks + 1, 0);
  for (uint64_t c = 0; c < nchunks; ++c) first[c + 1] = first[c] + count[c];
  std::vector<Piece>& pieces = cut.pieces;
  pieces.resize(first[nchunks]);
  std::vector<uint64_t> fill(first);
  // In file order within a chunk: the copies then read the buffer front to back.
  std::vector<uint64_t> order(dsts.size());
  for (uint64_t k = 0; k < dsts.size(); ++k) order[k] = dsts[k].span;
  std::sort(order.begin(), order.end(), [&](uint64_t a, uint64_t b) {
    return every[a].src_offset < every[b].src_offset;
  });
  for (uint64_t i : order) {
    const HostSpan& s = every[i];
    uint64_t off = s.src_offset, end = s.src_offset + s.nbytes;
    while (off < end) {
      const uint64_t c = off / chunk_bytes;
      const uint64_t n = std::min(end, (c + 1) * chunk_bytes) - off;
      pieces[fill[c]++] = {s.dst + (off - s.src_offset), off - c * chunk_bytes, n, i >= n_host};
      off += n;
    }
  }
  return cut;
}

// O_DIRECT on `fd` where asked and possible (*old_flags: the flags to put back), else
// the sequential read-ahead hint where asked. Returns whether O_DIRECT is on.
bool set_read_mode(int fd, const ScatterOptions& opts, uint64_t nbytes, uint64_t chunk_bytes,
                   int* old_flags) {
  bool direct = false;
  if (opts.direct && nbytes > 0 && chunk_bytes % kAlign == 0) {
    *old_flags = ::fcntl(fd, F_GETFL);
    direct = *old_flags >= 0 && ::fcntl(fd, F_SETFL, *old_flags | O_DIRECT) == 0;
  }
  if (!direct && opts.sequential && nbytes > 0)
    (void)::posix_fadvise(fd, 0, static_cast<off_t>(nbytes), POSIX_FADV_SEQUENTIAL);
  return direct;
}

// The readers of one call: each claims units of `per` whole chunks until none is left or
// a chunk failed, reads the unit (or takes it from the head), checks each chunk's CRC32C,
// then copies the chunk's pieces.
struct Readers {
  int fd;
  const std::string& name;
  uint64_t nbytes, chunk_bytes, nchunks;
  const std::vector<uint32_t>& crcs;
  const ChunkPieces& cut;
  Head head;
  UnitSink* sink;
  bool direct;
  uint64_t per, units, unit_bytes;

  std::atomic<uint64_t> next{0};
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> read_bytes{0}, applied{0}, from_head{0};
  std::atomic<int64_t> bad{-1};
  std::mutex bad_mu{};
  uint32_t bad_stored = 0, bad_read = 0;

  void work(int t);
  // [lo, hi) of the file, read into `buf` or taken from the head; where it lies.
  const uint8_t* fetch_unit(uint64_t lo, uint64_t hi, uint8_t* buf);
  // Checks chunks [c0, c1) at `base`, copying each one's pieces once it passed; false when
  // one failed (recorded, every reader told to stop, the unit done with the sink).
  bool verify_and_copy(int t, uint64_t c0, uint64_t c1, const uint8_t* base);
  void record_bad(uint64_t c, uint32_t crc);
};

void Readers::work(int t) {
  // One unit, never more than the file (a chunk size larger than the data is allowed).
  const uint64_t cap =
      std::max(kAlign, (std::min(unit_bytes, nbytes) + kAlign - 1) / kAlign * kAlign);
  std::unique_ptr<uint8_t, FreeDeleter> own;
  if (sink == nullptr) {
    uint8_t* raw = nullptr;
    if (::posix_memalign(reinterpret_cast<void**>(&raw), kAlign, cap) != 0 || raw == nullptr)
      throw std::bad_alloc();
    own.reset(raw);
  }
  for (;;) {
    if (stop.load(std::memory_order_acquire)) return;
    const uint64_t u = next.fetch_add(1);
    if (u >= units) return;
    const uint64_t c0 = u * per, c1 = std::min(nchunks, c0 + per);
    const uint64_t lo = c0 * chunk_bytes, hi = std::min(nbytes, c1 * chunk_bytes);
    // The sink's buffers rotate per unit (a device copy may still read the last one).
    uint8_t* buf = sink ? sink->buffer(t, cap) : own.get();
    if (!verify_and_copy(t, c0, c1, fetch_unit(lo, hi, buf))) return;
    if (sink) sink->unit_done(t);
  }
}

const uint8_t* Readers::fetch_unit(uint64_t lo, uint64_t hi, uint8_t* buf) {
  if (hi <= head.n) {  // read already (FileReadAhead): checked all the same
    const uint8_t* base = head.data + lo;
    if (sink) {  // a device copy reads page-locked memory: the sink's buffer
      std::memcpy(buf, head.data + lo, hi - lo);
      base = buf;
    }
    from_head.fetch_add(hi - lo, std::memory_order_relaxed);
    return base;
  }
  read_exact(fd, buf, hi - lo, lo, direct, name);
  read_bytes.fetch_add(hi - lo, std::memory_order_relaxed);
  return buf;
}

bool Readers::verify_and_copy(int t, uint64_t c0, uint64_t c1, const uint8_t* base) {
  for (uint64_t c = c0; c < c1; ++c) {
    const uint8_t* chunk = base + (c - c0) * chunk_bytes;
    const uint64_t n = std::min(chunk_bytes, nbytes - c * chunk_bytes);
    const uint32_t crc = crc32c(0, chunk, n);
    if (crc != crcs[c]) {  // nothing of this chunk (or the rest of the unit) is copied
      record_bad(c, crc);
      if (sink) sink->unit_done(t);  // the copies of its chunks before this one
      return false;
    }
    uint64_t moved = 0;
    for (uint64_t k = cut.first[c]; k < cut.first[c + 1]; ++k) {
      const Piece& p = cut.pieces[k];
      if (p.device)
        sink->copy(t, p.dst, chunk + p.off, p.n);
      else
        copy_bytes(reinterpret_cast<uint8_t*>(p.dst), chunk + p.off, p.n);
      moved += p.n;
    }
    applied.fetch_add(moved, std::memory_order_relaxed);
  }
  return true;
}

void Readers::record_bad(uint64_t c, uint32_t crc) {
  std::lock_guard<std::mutex> g(bad_mu);
  if (bad.load() < 0 || static_cast<int64_t>(c) < bad.load()) {
    bad.store(static_cast<int64_t>(c));
    bad_stored = crcs[c];
    bad_read = crc;
  }
  stop.store(true, std::memory_order_release);
}

// The readers' figures and the time since `t0` into *stats (bad_chunk left to the caller).
void fill_stats(const Readers& r, uint64_t t0, ScatterStats* stats) {
  stats->read_bytes = r.read_bytes.load();
  stats->ahead_bytes = r.from_head.load();
  stats->applied_bytes = r.applied.load();
  stats->seconds = static_cast<double>(monotonic_ns() - t0) * 1e-9;
}

}  // namespace

void FileReadAhead::Free::operator()(uint8_t* p) const { std::free(p); }

FileReadAhead::FileReadAhead(int fd, uint64_t limit, uint64_t piece)
    : piece_(std::max<uint64_t>(piece, kAlign)) {
  // Best effort throughout: whatever fails here leaves target 0 (nothing held) and
  // says why in error(); the scatter then reads the whole file itself.
  fd_ = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (fd_ < 0) {
    error_ = std::string("dup: ") + std::strerror(errno);
    return;
  }
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    error_ = std::string("fstat: ") + std::strerror(errno);
    return;
  }
  dev_ = static_cast<uint64_t>(st.st_dev);
  ino_ = static_cast<uint64_t>(st.st_ino);
  if (!S_ISREG(st.st_mode) || st.st_size <= 0 || limit == 0) return;
  const uint64_t want = std::min(static_cast<uint64_t>(st.st_size), limit);
  uint8_t* raw = nullptr;
  if (::posix_memalign(reinterpret_cast<void**>(&raw), kAlign,
                       (want + kAlign - 1) / kAlign * kAlign) != 0 || raw == nullptr) {
    error_ = "no memory for " + std::to_string(want) + " bytes";
    return;
  }
  buf_.reset(raw);
  target_ = want;
  try {
    thread_ = std::thread([this] { run(); });
  } catch (const std::exception& e) {  // no thread (EAGAIN): nothing is read ahead
    error_ = std::string("no reader thread: ") + e.what();
    target_ = 0;
    buf_.reset();
  }
}

FileReadAhead::~FileReadAhead() {
  finish();
  if (fd_ >= 0) (void)::close(fd_);
}

std::string FileReadAhead::error() const {
  std::lock_guard<std::mutex> g(mu_);
  return error_;
}

void FileReadAhead::run() {
  try {
    read_head();
  } catch (const std::exception& e) {  // (a message's allocation): never past the thread
    std::lock_guard<std::mutex> g(mu_);
    error_ = std::string("reader failed: ") + e.what();
  }
}

void FileReadAhead::read_head() {
  uint64_t off = 0;
  while (off < target_ && !stop_.load(std::memory_order_acquire)) {
    const ssize_t r = ::pread(fd_, buf_.get() + off, std::min(piece_, target_ - off),
                              static_cast<off_t>(off));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      const std::string why = r < 0 ? std::string(std::strerror(errno)) : "the file ended there";
      std::lock_guard<std::mutex> g(mu_);
      error_ = "pread at offset " + std::to_string(off) + ": " + why;
      return;
    }
    off += static_cast<uint64_t>(r);
    count_bytes_read(static_cast<uint64_t>(r));
    got_.store(off, std::memory_order_release);
  }
}

uint64_t FileReadAhead::finish() {
  stop_.store(true, std::memory_order_release);
  std::lock_guard<std::mutex> g(join_mu_);  // two callers: one joins, the other waits
  if (thread_.joinable()) thread_.join();
  return held();
}

void FileReadAhead::release() {
  finish();
  std::lock_guard<std::mutex> g(join_mu_);
  got_.store(0, std::memory_order_release);
  buf_.reset();
}

void read_verify_scatter(int fd, const std::string& name, uint64_t nbytes, uint64_t chunk_bytes,
                         const std::vector<uint32_t>& crcs, const std::vector<HostSpan>& spans,
                         const ScatterOptions& opts, ScatterStats* stats) {
  CUDASNAP_CHECK(stats != nullptr, "read_verify_scatter: no stats");
  *stats = ScatterStats{};
  const uint64_t t0 = monotonic_ns();
  struct stat st {};
  const uint64_t nchunks = check_file(fd, name, nbytes, chunk_bytes, crcs.size(), &st);
  const Head head = take_head(opts.ahead, st, nbytes);

  // Host spans, then the device ones (their own address space: copied by the sink).
  const uint64_t n_host = spans.size();
  std::vector<HostSpan> all_spans;
  const bool with_device = opts.device_spans != nullptr && !opts.device_spans->empty();
  if (with_device) {
    CUDASNAP_CHECK(opts.sink != nullptr, "read_verify_scatter: device spans without a sink");
    all_spans.reserve(n_host + opts.device_spans->size());
    all_spans.insert(all_spans.end(), spans.begin(), spans.end());
    all_spans.insert(all_spans.end(), opts.device_spans->begin(), opts.device_spans->end());
  }
  const std::vector<HostSpan>& every = with_device ? all_spans : spans;
  const ChunkPieces cut =
      cut_at_chunks(every, checked_destinations(every, n_host, nbytes), n_host, nchunks,
                    chunk_bytes);

  const uint64_t per = std::max<uint64_t>(1, opts.io_bytes / chunk_bytes);
  const uint64_t units = nchunks / per + (nchunks % per != 0);
  int old_flags = -1;
  const bool direct = set_read_mode(fd, opts, nbytes, chunk_bytes, &old_flags);
  stats->direct = direct;

  Readers r{fd, name, nbytes, chunk_bytes, nchunks, crcs, cut, head, opts.sink, direct,
            per, units, per * chunk_bytes};
  const int threads = static_cast<int>(
      std::min<uint64_t>(static_cast<uint64_t>(std::max(opts.threads, 1)), std::max<uint64_t>(units, 1)));
  auto worker = [&](uint64_t i) {
    try {
      r.work(static_cast<int>(i));
    } catch (...) {  // a failed read (or no buffer): the other readers stop too
      r.stop.store(true, std::memory_order_release);
      throw;
    }
  };
  try {
    parallel_for(static_cast<uint64_t>(threads), threads, worker);
    if (r.sink) r.sink->drain();  // every device copy done before this returns
  } catch (...) {
    r.stop.store(true);
    if (r.sink) {
      try {
        r.sink->drain();  // no copy may still read a buffer (the sink frees them)
      } catch (...) {
      }
    }
    if (direct) (void)::fcntl(fd, F_SETFL, old_flags);
    fill_stats(r, t0, stats);
    throw;
  }
  if (direct) (void)::fcntl(fd, F_SETFL, old_flags);
  fill_stats(r, t0, stats);
  stats->bad_chunk = r.bad.load();
  if (stats->bad_chunk >= 0) {
    const uint64_t c = static_cast<uint64_t>(stats->bad_chunk);
    const uint64_t lo = c * chunk_bytes, hi = std::min(nbytes, lo + chunk_bytes);
    CUDASNAP_CHECK_KIND(ErrorKind::Corrupt, false,
                        name << ": chunk " << c << " (bytes " << lo << ".." << hi
                             << ") fails its CRC32C (stored " << r.bad_stored << ", read "
                             << r.bad_read << "); none of its bytes was copied, "
                             << stats->applied_bytes
                             << " bytes of chunks verified before it had been");
  }
}

}  // namespace cudasnap
