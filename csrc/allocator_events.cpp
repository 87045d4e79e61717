#include "allocator_events.h"

#include <algorithm>
#include <cctype>
#include <chrono>

#include "error.h"

namespace cudasnap {

namespace {

constexpr const char* kActionNames[] = {
    "alloc",         "free_requested", "free_completed", "segment_alloc",
    "segment_free",  "segment_map",    "segment_unmap",  "snapshot",
    "oom",           "annotate",       "unknown",
};

}  // namespace

const char* trace_action_name(TraceAction a) noexcept {
  int i = static_cast<int>(a);
  if (i < 0 || i > static_cast<int>(TraceAction::UNKNOWN)) i = static_cast<int>(TraceAction::UNKNOWN);
  return kActionNames[i];
}

bool parse_trace_action(const std::string& name, TraceAction* out) noexcept {
  std::string n;
  n.reserve(name.size());
  for (char c : name) n.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  for (int i = 0; i <= static_cast<int>(TraceAction::UNKNOWN); ++i) {
    if (n == kActionNames[i]) {
      *out = static_cast<TraceAction>(i);
      return true;
    }
  }
  return false;
}

std::vector<Interval> merge_spans(const std::vector<Span>& spans) {
  std::vector<Interval> v;
  v.reserve(spans.size());
  for (const Span& s : spans)
    if (s.nbytes > 0) v.emplace_back(s.addr, s.addr + s.nbytes);
  std::sort(v.begin(), v.end());
  std::vector<Interval> out;
  for (const Interval& iv : v) {
    if (!out.empty() && iv.first <= out.back().second)
      out.back().second = std::max(out.back().second, iv.second);
    else
      out.push_back(iv);
  }
  return out;
}

EventQueue::~EventQueue() { stop_auto_drain(); }

void EventQueue::record(const TraceEvent& ev) noexcept {
  try {
    std::lock_guard<std::mutex> g(mu_);
    queue_.push_back(ev);
    recorded_.fetch_add(1, std::memory_order_relaxed);
    if (auto_threshold_ && queue_.size() == auto_threshold_) drain_cv_.notify_one();
  } catch (...) {
    dropped_.fetch_add(1);
  }
}

void EventQueue::take(std::vector<TraceEvent>& out) {
  out.clear();
  std::lock_guard<std::mutex> g(mu_);
  std::swap(queue_, out);
  in_flight_ = out.size();
}

void EventQueue::finish_batch(uint64_t n) {
  std::lock_guard<std::mutex> g(mu_);  // counts() reads both under it
  applied_.fetch_add(n, std::memory_order_relaxed);
  in_flight_ = 0;
  drained_cv_.notify_all();
}

QueueCounts EventQueue::counts() const {
  QueueCounts c;
  std::lock_guard<std::mutex> g(mu_);
  c.recorded = recorded_.load();
  c.applied = applied_.load();
  c.dropped = dropped_.load();
  c.queued = queue_.size() + in_flight_;  // a batch being applied is still queued
  return c;
}

void EventQueue::start_auto_drain(uint64_t threshold, std::function<void()> drain) {
  CUDASNAP_CHECK(threshold > 0, "auto-drain threshold must be positive");
  std::lock_guard<std::mutex> g(mu_);
  auto_threshold_ = threshold;
  auto_stop_ = false;
  if (!auto_thread_.joinable()) {
    auto_drain_fn_ = std::move(drain);
    auto_thread_ = std::thread([this] { auto_drain_loop(); });
  }
  drain_cv_.notify_one();
}

void EventQueue::stop_auto_drain() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!auto_thread_.joinable()) return;
    auto_stop_ = true;
  }
  drain_cv_.notify_all();
  auto_thread_.join();
  std::lock_guard<std::mutex> g(mu_);
  auto_threshold_ = 0;
  auto_stop_ = false;
  drained_cv_.notify_all();  // waiters: nothing more will be drained for them
}

bool EventQueue::wait_auto_drained(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  auto idle = [&] { return auto_threshold_ == 0 || queue_.size() + in_flight_ < auto_threshold_; };
  if (timeout_s < 0) {
    drained_cv_.wait(lk, idle);
    return true;
  }
  return drained_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), idle);
}

void EventQueue::auto_drain_loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      drain_cv_.wait(lk, [&] {
        return auto_stop_ || (auto_threshold_ && queue_.size() >= auto_threshold_);
      });
      if (auto_stop_) return;
    }
    try {
      auto_drain_fn_();
    } catch (...) {
      dropped_.fetch_add(1);  // an allocation failure while applying: unreliable
    }
  }
}

}  // namespace cudasnap
