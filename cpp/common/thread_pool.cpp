// Fork-join thread pool (see thread_pool.h).
#include "common/thread_pool.h"

#include <algorithm>
#include <exception>

#include "common/error.h"

namespace dflash {

ThreadPool::ThreadPool(int num_threads) {
  try {
    workers_.reserve(num_threads > 1 ? num_threads - 1 : 0);
    for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
  } catch (const std::exception& e) {
    // The OS refused a thread: stop and join those started (destroying a joinable
    // std::thread would terminate the process) and report it.
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
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
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t)>* job;
    int64_t n;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      n = job_n_;
    }
    const int64_t parts = num_threads();
    const int64_t begin = n * index / parts, end = n * (index + 1) / parts;
    if (begin < end) (*job)(begin, end);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                              int64_t min_parallel) {
  if (n <= 0) return;
  if (workers_.empty() || n < min_parallel) {
    fn(0, n);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    job_n_ = n;
    pending_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  const int64_t parts = num_threads();
  const int64_t end = n / parts;
  if (end > 0) fn(0, end);
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
}

}  // namespace dflash
