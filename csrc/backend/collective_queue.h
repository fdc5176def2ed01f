// Ordered progress for collectives: one worker thread runs queued collectives in issue order.
// A synchronous call (asyncOp=false) with nothing queued or running runs inline on the caller's
// thread, skipping the hand-off; anything else waits its turn, so order is always preserved.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace tdx {

class CollectiveQueue {
 public:
  CollectiveQueue();
  ~CollectiveQueue();

  // Runs `task` now if `inlineOk` and the queue is idle, else queues it for the worker.
  void submit(std::function<void()> task, bool inlineOk);
  // Stops the worker after the tasks already queued. Idempotent.
  void stop();

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace tdx
