// A small fork-join thread pool for the CPU backend's loops, built to degrade gracefully when
// its cores are shared (another dflash process, unrelated load): work is split into more
// chunks than threads and claimed dynamically, so the caller never waits for a worker that the
// OS has not scheduled yet (it runs the unclaimed chunks itself); idle workers spin a bounded
// time (yielding) for the next loop, then sleep on a condition variable. Not reentrant: one
// parallel_for at a time (the engine's thread).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace dflash {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
  // Calls fn(begin, end) over contiguous chunks covering [0, n), each exactly once, from the
  // caller and the workers; runs inline when n < min_parallel (too little work to be worth
  // waking threads). fn must not depend on how [0, n) is split.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                    int64_t min_parallel = 2);

  // Chunks per thread of a parallel_for (more chunks: better balance when a thread is late).
  static constexpr int64_t kChunksPerThread = 4;

 private:
  // One loop as the workers see it (read under mu_, fixed while its generation is current).
  struct Job {
    const std::function<void(int64_t, int64_t)>* fn = nullptr;
    int64_t n = 0;
    int64_t chunks = 0;
  };
  void worker_loop();
  // Claims and runs chunks of generation `generation` until none is left (or the generation
  // has moved on).
  void run_chunks(uint64_t generation, const Job& job);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  Job job_;                               // guarded by mu_
  int sleeping_ = 0;                      // workers waiting on wake_ (guarded by mu_)
  bool stop_ = false;                     // guarded by mu_
  std::atomic<uint64_t> generation_{0};   // bumped (under mu_) for every parallel loop
  std::atomic<uint64_t> claim_{0};        // generation << 32 | next unclaimed chunk
  std::atomic<int64_t> chunks_done_{0};   // chunks of the current loop finished
  std::atomic<bool> stopping_{false};
};

}  // namespace dflash
