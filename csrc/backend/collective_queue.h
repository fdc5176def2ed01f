// Ordered progress for collectives: one worker thread runs queued collectives in issue order.
// A synchronous call (asyncOp=false) with nothing queued or running runs inline on the caller's
// thread, skipping the hand-off; anything else waits its turn, so order is always preserved.
// A task submitted from inside a running task (a future callback that issues a collective and
// waits for it, as torch's PowerSGD hook does) runs right there, after everything queued before it:
// handing it to the worker would deadlock, since the worker is the thread waiting.
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
  std::thread::id runner_;  // the thread running tasks while busy_
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace tdx
