#include "backend/collective_queue.h"

namespace tdx {

CollectiveQueue::CollectiveQueue() : thread_([this] { loop(); }) {}

CollectiveQueue::~CollectiveQueue() { stop(); }

void CollectiveQueue::submit(std::function<void()> task, bool inlineOk) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (busy_ && runner_ == std::this_thread::get_id()) {
      // Re-entrant: drain what was queued before this task, then run it, in issue order.
      tasks_.push_back(std::move(task));
      drain(lock);
      return;
    }
    if (!(inlineOk && tasks_.empty() && !busy_)) {
      tasks_.push_back(std::move(task));
      cv_.notify_one();
      return;
    }
    busy_ = true;
    runner_ = std::this_thread::get_id();
  }
  task();  // tasks report their own errors through their Work
  release();
}

CollectiveQueue::Turn CollectiveQueue::turn() {
  std::unique_lock<std::mutex> lock(mu_);
  if (busy_ && runner_ == std::this_thread::get_id()) {
    drain(lock);
    return Turn(this, /*reentrant=*/true);
  }
  if (!tasks_.empty() || busy_) return Turn(nullptr, false);
  busy_ = true;
  runner_ = std::this_thread::get_id();
  return Turn(this, /*reentrant=*/false);
}

void CollectiveQueue::drain(std::unique_lock<std::mutex>& lock) {
  while (!tasks_.empty()) {
    auto next = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    next();
    lock.lock();
  }
}

void CollectiveQueue::release() {
  std::lock_guard<std::mutex> lock(mu_);
  busy_ = false;
  if (!tasks_.empty()) cv_.notify_one();
}

void CollectiveQueue::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

void CollectiveQueue::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return (!tasks_.empty() && !busy_) || (stop_ && tasks_.empty()); });
    if (tasks_.empty()) return;  // stopping
    auto task = std::move(tasks_.front());
    tasks_.pop_front();
    busy_ = true;
    runner_ = std::this_thread::get_id();
    lock.unlock();
    task();
    lock.lock();
    busy_ = false;
  }
}

}  // namespace tdx
