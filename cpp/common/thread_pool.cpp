// Fork-join thread pool with dynamic chunk claiming and bounded spinning (see thread_pool.h).
#include "common/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <exception>

#include "common/error.h"

namespace dflash {

namespace {

// How long an idle worker (and a caller waiting for the last chunks) spins, yielding the core
// between polls, before it sleeps. Long enough to bridge the gap between the loops of one step,
// short enough that a shared core is not held for long.
constexpr std::chrono::microseconds kSpinTime{50};

// Polls `ready` while yielding, for at most kSpinTime; true if it became ready.
template <typename Ready>
bool spin_until(const Ready& ready) {
  const auto deadline = std::chrono::steady_clock::now() + kSpinTime;
  for (int i = 0;; ++i) {
    if (ready()) return true;
    std::this_thread::yield();
    if ((i & 15) == 15 && std::chrono::steady_clock::now() >= deadline) return ready();
  }
}

uint64_t claim_word(uint64_t generation, uint64_t chunk) { return (generation << 32) | chunk; }

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  try {
    workers_.reserve(num_threads > 1 ? num_threads - 1 : 0);
    for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  } catch (const std::exception& e) {
    // The OS refused a thread: stop and join those started (destroying a joinable
    // std::thread would terminate the process) and report it.
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      stopping_ = true;
    }
    wake_.notify_all();
    const size_t started = workers_.size();
    for (auto& t : workers_) t.join();
    workers_.clear();
    throw Error(detail::concat("cannot start ", num_threads, " CPU threads (started ", started + 1,
                               "): ", e.what(), "; pass a smaller num_threads"));
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_chunks(uint64_t generation, const Job& job) {
  for (;;) {
    uint64_t word = claim_.load(std::memory_order_acquire);
    uint64_t chunk;
    do {
      chunk = word & 0xFFFFFFFFu;
      if ((word >> 32) != (generation & 0xFFFFFFFFu) || static_cast<int64_t>(chunk) >= job.chunks) return;
    } while (!claim_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel));
    const int64_t c = static_cast<int64_t>(chunk);
    const int64_t begin = job.n * c / job.chunks, end = job.n * (c + 1) / job.chunks;
    if (begin < end) (*job.fn)(begin, end);
    if (chunks_done_.fetch_add(1, std::memory_order_acq_rel) + 1 == job.chunks) {
      std::lock_guard<std::mutex> lock(mu_);  // the caller may be about to sleep on done_
      done_.notify_one();
    }
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    spin_until([&] { return generation_.load(std::memory_order_acquire) != seen || stopping_.load(); });
    Job job;
    uint64_t generation;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (!stop_ && generation_.load() == seen) {
        ++sleeping_;
        wake_.wait(lock, [&] { return stop_ || generation_.load() != seen; });
        --sleeping_;
      }
      if (stop_) return;
      generation = generation_.load();
      job = job_;
    }
    seen = generation;
    run_chunks(generation, job);
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                              int64_t min_parallel) {
  if (n <= 0) return;
  if (workers_.empty() || n < min_parallel) {
    fn(0, n);
    return;
  }
  Job job;
  job.fn = &fn;
  job.n = n;
  job.chunks = std::min<int64_t>(n, num_threads() * kChunksPerThread);
  uint64_t generation;
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = job;
    chunks_done_.store(0, std::memory_order_relaxed);
    generation = generation_.load() + 1;
    claim_.store(claim_word(generation & 0xFFFFFFFFu, 0), std::memory_order_release);
    generation_.store(generation, std::memory_order_release);
    wake = sleeping_ > 0;
  }
  if (wake) wake_.notify_all();
  run_chunks(generation, job);  // the caller works too, and takes every chunk nobody claimed
  const auto all_done = [&] { return chunks_done_.load(std::memory_order_acquire) == job.chunks; };
  if (!spin_until(all_done)) {
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, all_done);
  }
  std::lock_guard<std::mutex> lock(mu_);
  job_ = Job();
}

}  // namespace dflash
